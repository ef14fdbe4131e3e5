"""Reading a file named by data or by saved state without letting it hang or exhaust the process.

Only regular files are read (a FIFO, a device such as /dev/zero or a directory is refused before a byte
is read: the file is opened non-blocking and checked with fstat), and never more than a size limit.
"""

from __future__ import annotations

import os
import stat


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
