"""Row groups of indexed parquet files, read with pyarrow through fsspec in one ranged read each.

The dataset index gives every row group's byte span, so reading row group *g* of a file is one
ranged read of that span plus, once per file and process, one read of the footer (checked against
the index's footer digest: a file rewritten since the index was built is a StreamMismatchError
naming it, never decoded against a stale layout). Tables are cast to the index's features exactly
as ``datasets``' parquet builder casts them, so rows come out as ``datasets`` would give them.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import StreamMismatchError
from .index import footer_digest, parse_footer


class _Span(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``data``, at ``offset``, is present."""

    def __init__(self, offset: int, data: bytes, size: int):
        super().__init__()
        self._offset, self._data, self._size, self._pos = offset, memoryview(data), size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        start = self._pos - self._offset
        n = min(len(buffer), self._size - self._pos)
        if start < 0 or start + n > len(self._data):
            raise OSError(f"parquet read outside the fetched span ({self._pos}+{n})")
        buffer[:n] = self._data[start:start + n]
        self._pos += n
        return n


_FILESYSTEMS: dict[tuple, Any] = {}


def _filesystem(protocol: str, storage_options: dict):
    """This process's fsspec filesystem for ``protocol`` (a fresh one after a fork: with some fsspec versions
    a filesystem made before the fork hangs in a forked DataLoader worker)."""
    import fsspec

    options = dict(storage_options.get(protocol, {}))
    key = (os.getpid(), protocol, repr(sorted(options.items())))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        if any(k[0] != key[0] for k in _FILESYSTEMS):
            _FILESYSTEMS.clear()         # the parent's, unusable here
            fsspec.asyn.reset_lock()
        fs = _FILESYSTEMS[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    return fs


def read_range(path: str, start: int, end: int, storage_options: dict) -> bytes:
    """Bytes ``[start, end)`` of a local file or a URL (one ranged request); a short answer is an OSError
    (a network fault: retried by the caller)."""
    if "://" not in path or path.startswith("file://"):
        with open(path[len("file://"):] if path.startswith("file://") else path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    else:
        protocol = path.split("://", 1)[0]
        if protocol == "hf" and path.startswith("hf://datasets/"):
            from .hub import read_range as hub_read_range

            data = hub_read_range(path, start, end)      # one request (HfFileSystem: up to three, and 5 MB more)
        else:
            fs = _filesystem(protocol, storage_options)
            data = fs.cat_file(path, start=start, end=end)   # the whole URL: each fs strips what it must
    if len(data) != end - start:
        raise OSError(f"short read of {path!r}: {len(data)} of {end - start} bytes at {start}")
    return data


class ParquetFiles:
    """The row groups of the files of a dataset index (picklable: DataLoader workers get a copy)."""

    def __init__(self, index: dict[str, Any], storage_options: dict, footers: dict[str, bytes] | None = None):
        import datasets

        self._files = index["files"]
        # footers already read by whoever built the index (path -> bytes; still checked against its digest):
        # a rank or DataLoader worker given them reads no footer itself
        self.footers: dict[str, bytes] = dict(footers or {})
        self._storage_options = storage_options
        self.features = datasets.Features.from_dict(index["features"])
        self._schema = self.features.arrow_schema
        self._forget()

    def _forget(self) -> None:
        self._footers: dict[int, pq.FileMetaData] = {}
        self._lock = threading.Lock()
        self._reading: dict[int, Future] = {}      # footers being read, by file
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_footers", "_lock", "_reading", "_pid"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._forget()

    @property
    def column_names(self) -> list[str]:
        return list(self.features)

    def metadata(self, file: int) -> pq.FileMetaData:
        """The footer of file ``file``, checked against the index: read once per process; threads that ask
        while it is being read share that read's outcome (a failure included: no queue of retries)."""
        if self._pid != os.getpid():    # forked (a DataLoader worker): locks may be held by the parent's threads
            self._forget()
        md = self._footers.get(file)
        if md is not None:
            return md
        with self._lock:
            reading = self._reading.get(file)
            mine = reading is None
            if mine:
                reading = self._reading[file] = Future()
        if not mine:
            return reading.result()
        try:
            md = self._footers[file] = self._read_footer(file)
            reading.set_result(md)
            return md
        except BaseException as e:
            reading.set_exception(e)
            raise
        finally:
            with self._lock:
                self._reading.pop(file, None)

    def _read_footer(self, file: int) -> pq.FileMetaData:
        entry = self._files[file]
        size, length = entry["size"], entry["footer_bytes"]
        footer = self.footers.get(entry["path"])
        if footer is None:
            footer = read_range(entry["path"], size - length, size, self._storage_options)
        digest = footer_digest(footer)
        if digest != entry["footer"]:
            raise StreamMismatchError(
                f"data file {entry['path']!r} was modified: its parquet footer no longer matches the dataset index "
                f"(footer digest: index {entry['footer']!r}, now {digest!r}); the data changed since the index or "
                "checkpoint was made", [(f"file modified: {entry['path']} (footer)", entry["footer"], digest)])
        return parse_footer(footer, entry["path"])

    def row_group(self, file: int, group: int) -> pa.Table:
        """Row group ``group`` of file ``file`` as one table, cast to the index's features."""
        from datasets.table import table_cast

        entry = self._files[file]
        md = self.metadata(file)
        _, start, end = entry["row_groups"][group]
        data = read_range(entry["path"], start, end, self._storage_options)
        table = pq.ParquetFile(_Span(start, data, entry["size"]), metadata=md).read_row_group(group)
        return table_cast(table, self._schema)
