"""Reading a file named by data or by saved state without letting it hang or exhaust the process.

Only regular files are read (a FIFO, a device such as /dev/zero or a directory is refused before a byte
is read: the file is opened non-blocking and checked with fstat), and never more than a size limit. JSON
read from such a file is parsed only after a linear scan found it nested no deeper than a limit: deep
nesting would otherwise exhaust the parser's recursion (or that of whoever walks the result).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from typing import Any

import numpy as np

from ..limits import MAX_JSON_DEPTH


class FileRefused(Exception):
    """The file is not a regular file, or is larger than allowed. The message says which."""


def read_regular_file(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    OSError when it cannot be opened or read; FileRefused when it is not a regular file or is too large."""
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise FileRefused(f"{st.st_size} bytes, over the limit of {max_bytes}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:   # grew while being read
                raise FileRefused(f"over the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class JSONRefused(ValueError):
    """Not JSON, not UTF-8, or nested deeper than allowed. The message says which."""


_BRACKETS = np.zeros(256, dtype=bool)
_BRACKETS[list(b"[]{}")] = True
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def json_depth(data: bytes, chunk: int = 1 << 22) -> int:
    """How deep arrays and objects nest in the JSON text ``data`` (brackets inside strings do not count).

    Vectorized over chunks of ``chunk`` bytes, carrying the open string, the backslash run and the depth
    from one chunk to the next: time linear and memory bounded whatever the bytes. Exact for valid JSON;
    for invalid JSON exact up to where a parser would fail."""
    buf = np.frombuffer(data, dtype=np.uint8)
    depth = deepest = in_string = backslashes = 0
    for start in range(0, len(buf), chunk):
        b = buf[start:start + chunk]
        # last position at or before each one that is not a backslash (-1: none in this chunk)
        last = np.maximum.accumulate(np.where(b == _BACKSLASH, -1, np.arange(len(b), dtype=np.int64)))
        quotes = np.flatnonzero(b == _QUOTE)
        before = last[quotes - 1]
        before[quotes == 0] = -1
        run = quotes - 1 - before + np.where(before < 0, backslashes, 0)   # backslashes right before each quote
        real = quotes[run % 2 == 0]                                        # an odd run escapes the quote
        brackets = np.flatnonzero(_BRACKETS[b])
        outside = brackets[(np.searchsorted(real, brackets) + in_string) % 2 == 0]
        if len(outside):
            level = depth + np.cumsum((b[outside] & 2).astype(np.int64) - 1)   # [ { have bit 1 set, ] } not
            deepest, depth = max(deepest, int(level.max())), int(level[-1])
        in_string = (in_string + len(real)) % 2
        backslashes = len(b) - 1 - int(last[-1]) + (backslashes if last[-1] < 0 else 0)
    return deepest


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(data)`` once ``data`` is known to be UTF-8 nested at most ``max_depth`` deep; else
    JSONRefused (a ValueError) saying why, for the caller to name the file."""
    try:
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        text = data if isinstance(data, str) else data.decode("utf-8")
    except UnicodeError as e:
        raise JSONRefused(f"not UTF-8 ({e})") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise JSONRefused(f"JSON nested {depth} levels deep; allowed: at most {max_depth}")
    try:
        return json.loads(text)
    except ValueError as e:
        raise JSONRefused(f"not JSON ({e})") from None


# ------------------------------------------------------------------ atomic writes
def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_temp(directory: str) -> tuple[int, str]:
    """An exclusive new file next to the target, created with mode 0666 so the umask decides who may read it
    (mkstemp forces 0600: a group could not resume a shared checkpoint)."""
    while True:
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue


def atomic_write(path: str, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = create_temp(directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
