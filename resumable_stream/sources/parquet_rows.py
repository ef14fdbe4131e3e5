"""Row groups of indexed parquet files, read with pyarrow through fsspec in one ranged read each.

The dataset index gives every row group's byte span, so reading row group *g* of a file is one
ranged read of that span plus, once per file and process, one read of the footer (checked against
the index's footer digest and row-group layout: a file rewritten since the index was built is a
StreamMismatchError naming it, never decoded against a stale layout). Every read is checked against the
file's recorded identity (:mod:`.ranged`) and every decoded row group against its footer
(:mod:`.row_group_check`) before it is handed on: an answer that fails a check is read once more from
the source, and a second failure is an error naming the file and row group, never a row. Tables are cast
to the index's features exactly as ``datasets``' parquet builder casts them, so rows come out as
``datasets`` would give them.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SourceError, StreamMismatchError
from ..io.ranged import ObjectChanged, WrongBytes, read_range
from ..observe.metrics import record_retry
from ..runtime.arrow_pool import rows_pool
from . import parquet_checks as row_group_check
from .parquet_footer import footer_digest, parse_footer, row_group_layout
from .parquet_local import cast_like_datasets, simple_schema

log = logging.getLogger(__name__)
T = TypeVar("T")


def read_checked(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, once more when its answer failed a check (a proxy's hiccup, a torn read); a second failure
    is a SourceError naming ``what`` (a StreamMismatchError when the object itself changed)."""
    try:
        return fn()
    except (WrongBytes, ObjectChanged) as e:
        log.warning("%s: %s; reading it once more from the source", what, e)
        record_retry("wrong_bytes")
    try:
        return fn()
    except ObjectChanged:
        raise
    except WrongBytes as e:
        raise SourceError(f"{what}: {e} (on two reads in a row: the server, or a cache or proxy in between, "
                          "answers with other bytes than the file's; nothing of it was used)") from None


# what pq.ParquetFile(source, metadata=..., pre_buffer=False, page_checksum_verification=True) opens its reader
# with, less the metadata (ParquetFile enables Arrow extension types where its reader does not by default)
_OPEN_OPTIONS: dict[str, Any] = {"pre_buffer": False, "page_checksum_verification": True}
_extensions = inspect.signature(pq.ParquetFile.__init__).parameters.get("arrow_extensions_enabled")
if _extensions is not None:
    _OPEN_OPTIONS["arrow_extensions_enabled"] = _extensions.default


def read_row_group(source, metadata: pq.FileMetaData, group: int) -> pa.Table:
    """``pq.ParquetFile(source, metadata=metadata, pre_buffer=False, page_checksum_verification=True)
    .read_row_group(group)``, allocated from :func:`rows_pool`. Pre-buffering is off: the bytes are in memory
    already, and a pre-buffering task on Arrow's IO threads would hold this Python file past the read
    (released by a C++ thread, maybe at interpreter exit)."""
    pool = rows_pool()
    if pool is not None:
        from pyarrow._parquet import ParquetReader

        reader = ParquetReader(memory_pool=pool)
        reader.open(source, metadata=metadata, **_OPEN_OPTIONS)
        return reader.read_row_group(group, column_indices=None, use_threads=True)
    return pq.ParquetFile(source, metadata=metadata, pre_buffer=False,
                          page_checksum_verification=True).read_row_group(group)


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


class ParquetFiles:
    """The row groups of the files of a dataset index (picklable: DataLoader workers get a copy)."""

    def __init__(self, index: dict[str, Any], storage_options: dict, footers: dict[str, bytes] | None = None):
        self._files = index["files"]
        # footers already read by whoever built the index (path -> bytes; still checked against its digest):
        # a rank or DataLoader worker given them reads no footer itself
        self.footers: dict[str, bytes] = dict(footers or {})
        self._storage_options = storage_options
        self._features = index["features"]
        # plain columns: the schema datasets would cast to, made without importing it (local_parquet.py)
        self._schema = simple_schema(self._features)
        if self._schema is None:
            import datasets

            self._schema = datasets.Features.from_dict(self._features).arrow_schema
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
    def features(self):
        """The index's features as ``datasets.Features`` (imports datasets)."""
        import datasets

        return datasets.Features.from_dict(self._features)

    @property
    def column_names(self) -> list[str]:
        return list(self._features)

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
            footer = read_checked(f"data file {entry['path']!r} (its footer)", lambda: read_range(
                entry["path"], size - length, size, self._storage_options, entry))
        digest = footer_digest(footer)
        if digest != entry["footer"]:
            raise StreamMismatchError(
                f"data file {entry['path']!r} was modified: its parquet footer no longer matches the dataset index "
                f"(footer digest: index {entry['footer']!r}, now {digest!r}); the data changed since the index or "
                "checkpoint was made", [(f"file modified: {entry['path']} (footer)", entry["footer"], digest)])
        md = parse_footer(footer, entry["path"])
        if row_group_layout(md) != entry["row_groups"]:    # a forged index would have us read other spans
            raise SourceError(f"dataset index: the row groups it lists for data file {entry['path']!r} are not the "
                              "ones its footer describes (the index was edited or damaged); rebuild it")
        return md

    def row_group(self, file: int, group: int) -> pa.Table:
        """Row group ``group`` of file ``file`` as one table, cast to the index's features, once its bytes
        passed every check."""
        entry = self._files[file]
        md = self.metadata(file)
        table = read_checked(f"data file {entry['path']!r} (row group {group})",
                             lambda: self._decoded(entry, md, group))
        cast = cast_like_datasets(table, self._schema)     # no value to cast: datasets' result, without it
        if cast is None:
            from datasets.table import table_cast

            cast = table_cast(table, self._schema)
        return cast

    def row_groups(self, file: int, groups: list[int]) -> list[pa.Table]:
        """Row groups ``groups`` of file ``file`` (adjacent, in file order) in one ranged read of their bytes, each
        decoded, checked against the footer and cast as :meth:`row_group` does: fewer requests, the same rows
        and checks. Bytes that fail a check are read once more, all of them (read_checked)."""
        entry = self._files[file]
        md = self.metadata(file)
        what = f"data file {entry['path']!r} (row groups {groups[0]}-{groups[-1]})"
        tables = read_checked(what, lambda: self._decoded_run(entry, md, groups))
        out = []
        for table in tables:
            cast = cast_like_datasets(table, self._schema)
            if cast is None:
                from datasets.table import table_cast

                cast = table_cast(table, self._schema)
            out.append(cast)
        return out

    def _decoded_run(self, entry: dict, md: pq.FileMetaData, groups: list[int]) -> list[pa.Table]:
        spans = [entry["row_groups"][g] for g in groups]
        start, end = spans[0][1], spans[-1][2]
        if any(b[1] < a[2] for a, b in zip(spans, spans[1:])):
            raise SourceError(f"data file {entry['path']!r}: row groups {groups} are not in file order")
        data = read_range(entry["path"], start, end, self._storage_options, entry)
        tables = []
        for group in groups:
            try:
                table = read_row_group(_Span(start, data, entry["size"]), md, group)
            except (pa.ArrowException, OSError) as e:    # the bytes of the right length are not these row groups'
                raise WrongBytes(f"row group {group}: its bytes do not decode ({type(e).__name__}: {e})") from None
            problem = row_group_check.problem(table, md, group)
            if problem is not None:
                raise WrongBytes(f"row group {group}: its decoded rows contradict the file's footer: {problem}")
            tables.append(table)
        return tables

    def _decoded(self, entry: dict, md: pq.FileMetaData, group: int) -> pa.Table:
        _, start, end = entry["row_groups"][group]
        data = read_range(entry["path"], start, end, self._storage_options, entry)
        try:
            table = read_row_group(_Span(start, data, entry["size"]), md, group)
        except (pa.ArrowException, OSError) as e:    # the bytes of the right length are not this row group's
            raise WrongBytes(f"its bytes do not decode ({type(e).__name__}: {e})") from None
        problem = row_group_check.problem(table, md, group)
        if problem is not None:
            raise WrongBytes(f"its decoded rows contradict the file's footer: {problem}")
        return table
