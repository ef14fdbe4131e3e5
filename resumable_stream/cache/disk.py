"""What the block cache trusts in its directory: raw bytes only, and only files inside the directory.

``cache.db`` may be written by anyone who can write the (node-shared) cache directory, and diskcache would
unpickle a row in pickle mode and open or delete any path a row names. Here a row is only read as raw bytes,
any other mode is an :class:`UnsafeEntry`, and a file name resolving outside the directory is never opened
nor deleted. :class:`SafeDisk` is the ``diskcache.Disk`` the store writes with; :func:`read_value` reads back."""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time

import diskcache

log = logging.getLogger(__name__)

DBNAME = diskcache.core.DBNAME
MODE_RAW, MODE_BINARY = diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY
# value files: two levels of two hex digits, then 28 hex digits + ".rsb" (diskcache's own names end in ".val":
# a sweep never takes a file this code did not write)
_VALUE_DIR = re.compile(r"[0-9a-f]{2}\Z")
_VALUE_FILE = re.compile(r"[0-9a-f]{28}\.rsb\Z")


class UnsafeEntry(ValueError):
    """A cache row that is not raw bytes inside the cache directory (pickled, or a path outside it)."""


def confined_path(directory: str, filename) -> str | None:
    """The real path of ``filename`` when it lies inside ``directory`` (symlinks resolved), else None."""
    if not isinstance(filename, str) or not filename or "\0" in filename or os.path.isabs(filename):
        return None
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, filename))
    return path if os.path.commonpath([root, path]) == root and path != root else None


def _read_regular_file(path: str) -> bytes:
    # O_NONBLOCK: a FIFO planted under a value name must not hang the reader; it is refused below
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeEntry("its value file is not a regular file")
        return f.read()


def read_value(directory: str, mode, filename, value) -> bytes:
    """The bytes of a cache row (``mode``, ``filename``, ``value``), never unpickled: UnsafeEntry for another mode
    or a file outside ``directory``, OSError when its file cannot be read (evicted meanwhile)."""
    if mode == MODE_RAW and isinstance(value, bytes):
        return value
    if mode == MODE_BINARY and value is None:
        path = confined_path(directory, filename)
        if path is None:
            raise UnsafeEntry(f"its file name {filename!r} is outside the cache directory")
        return _read_regular_file(path)
    raise UnsafeEntry(f"stored in diskcache mode {mode!r} ({type(value).__name__}); only raw bytes are read")


class SafeDisk(diskcache.Disk):
    """A ``diskcache.Disk`` for str keys and bytes values, its files confined to the directory; ``disk_*`` settings
    planted in ``cache.db`` are ignored, and the file of a failed write is removed."""

    def __init__(self, directory, **_settings):
        super().__init__(directory, min_file_size=2**15, pickle_protocol=0)
        self._last = threading.local()

    def filename(self, key=diskcache.core.UNKNOWN, value=diskcache.core.UNKNOWN):
        name, full_path = super().filename(key, value)
        name = name[: -len(".val")] + ".rsb"
        return name, os.path.join(self._directory, name)

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"block cache keys are str, not {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        if not raw:
            raise UnsafeEntry("a pickled key")
        return super().get(key, raw)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not read and type(value) is not bytes:
            raise TypeError(f"block cache values are bytes, not {type(value).__name__}")
        if not read and len(value) < self.min_file_size:
            return super().store(value, read, key)           # raw bytes in the row
        filename, full_path = self.filename(key, value)
        self._last.filename = filename
        try:
            size = self._write(full_path, iter((value,)) if not read else iter(lambda: value.read(2**22), b""),
                               "xb")
        except BaseException:
            self.remove(filename)                            # no partial file left behind (disk full...)
            self._last.filename = None
            raise
        return size, MODE_BINARY, filename, None

    def remove_last_write(self) -> None:
        """Remove the file of this thread's last ``store`` (its row was not committed)."""
        filename = getattr(self._last, "filename", None)
        self._last.filename = None
        if filename is not None:
            self.remove(filename)

    def fetch(self, mode, filename, value, read):
        if read:
            raise UnsafeEntry("file handles are not handed out")
        return read_value(self._directory, mode, filename, value)

    def remove(self, file_path):
        """Delete a value file and its emptied directories, only inside the cache directory."""
        path = confined_path(self._directory, file_path)
        if path is None:
            log.warning("block cache %s: not deleting %r, which is outside the cache directory",
                        self._directory, file_path)
            return
        try:
            os.remove(path)
        except OSError:
            return                           # already gone (another process evicted it)
        root, parent = os.path.realpath(self._directory), os.path.dirname(path)
        while parent != root and os.path.commonpath([root, parent]) == root:
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)


def sweep_orphans(directory: str, referenced: set[str], min_age_s: float) -> int:
    """Remove value files no row refers to (a deleted ``cache.db``, a killed write): only :class:`SafeDisk`'s names,
    older than ``min_age_s`` (a file is written before its row commits). Returns the files removed."""
    removed, now = 0, time.time()
    with os.scandir(directory) as top:
        firsts = [e.path for e in top if _VALUE_DIR.match(e.name) and e.is_dir(follow_symlinks=False)]
    for first in firsts:
        with os.scandir(first) as level:
            seconds = [e.path for e in level if _VALUE_DIR.match(e.name) and e.is_dir(follow_symlinks=False)]
        for second in seconds:
            with os.scandir(second) as files:
                for e in files:
                    name = os.path.relpath(e.path, directory)
                    if (_VALUE_FILE.match(e.name) and name not in referenced
                            and e.is_file(follow_symlinks=False)
                            and now - e.stat(follow_symlinks=False).st_mtime >= min_age_s):
                        try:
                            os.remove(e.path)
                            removed += 1
                        except OSError:
                            pass
            try:
                os.rmdir(second)
            except OSError:
                pass
        try:
            os.rmdir(first)
        except OSError:
            pass
    return removed
