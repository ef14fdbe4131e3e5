"""Row groups of indexed parquet files, read with pyarrow in one ranged read each.

The footer is read once per file and process and checked against the index (a rewritten file is a
StreamMismatchError naming it); every read is checked against the file's identity and every decoded row group
against its footer (:mod:`.parquet_checks`): an answer that fails is read once more, a second failure is an error
naming the file and row group, never a row. Tables are cast to the index's features as ``datasets`` casts them.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SourceError, StreamMismatchError
from ..io.ranged import ObjectChanged, WrongBytes, read_range, read_range_parallel
from ..observe.metrics import record_retry
from ..runtime.arrow_pool import rows_pool
from . import parquet_checks as row_group_check
from .base import SeekableFile
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


# Arrow buffers over 8 MiB come from jemalloc's oversize arena, which gives them back to the OS when freed: decoded
# into one on a prefetch thread, every page of it faults in again (measured: a 12.5 MB text column of 5,000
# documents, ~3,000 faults and ~7 ms of CPU each time, ~1.5 us a row). A row group whose widest column chunk holds
# more than WHOLE_DECODE_BYTES (below 8 MiB: a builder's buffer may grow past its column's size) decodes in batches
# of about DECODE_CHUNK_BYTES of it instead: the same rows, in chunks (2 MiB: fewest faults, measured 1-4 MiB).
WHOLE_DECODE_BYTES = 6 << 20
DECODE_CHUNK_BYTES = 2 << 20


def batch_rows(metadata: pq.FileMetaData, group: int) -> int | None:
    """Rows per decoded batch of row group ``group`` that keep its widest column chunk's batches near
    DECODE_CHUNK_BYTES (by the footer's uncompressed sizes: an estimate); None: decode it whole."""
    rg = metadata.row_group(group)
    widest = max((rg.column(j).total_uncompressed_size for j in range(rg.num_columns)), default=0)
    if widest <= WHOLE_DECODE_BYTES or rg.num_rows < 2:
        return None
    return max(1, rg.num_rows * DECODE_CHUNK_BYTES // widest)


def read_row_group(source, metadata: pq.FileMetaData, group: int) -> pa.Table:
    """``pq.ParquetFile(source, metadata=metadata, pre_buffer=False, page_checksum_verification=True)
    .read_row_group(group)``, allocated from :func:`rows_pool` (a wide one in chunks of ``batch_rows``).
    Pre-buffering is off: the bytes are in memory already, and a pre-buffering task on Arrow's IO threads would
    hold this Python file past the read (released by a C++ thread, maybe at interpreter exit)."""
    pool = rows_pool()
    if pool is not None:
        from pyarrow._parquet import ParquetReader

        reader = ParquetReader(memory_pool=pool)
        reader.open(source, metadata=metadata, **_OPEN_OPTIONS)
        rows = batch_rows(metadata, group)
        if rows is None:
            return reader.read_row_group(group, column_indices=None, use_threads=True)
        batches = list(reader.iter_batches(rows, [group], column_indices=None, use_threads=True))
        return pa.Table.from_batches(batches, schema=reader.schema_arrow)
    return pq.ParquetFile(source, metadata=metadata, pre_buffer=False,
                          page_checksum_verification=True).read_row_group(group)


class _Span(SeekableFile):
    """A read-only file of ``size`` bytes of which only ``data``, at ``offset``, is present."""

    def __init__(self, offset: int, data: bytes, size: int):
        super().__init__()
        self._offset, self._data, self.size, self.pos = offset, memoryview(data), size, 0

    def read(self, n: int = -1):
        """A view of the fetched bytes, not a copy (pyarrow wraps what ``read`` returns as its buffer)."""
        start = self.pos - self._offset
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if start < 0 or start + n > len(self._data):
            raise OSError(f"parquet read outside the fetched span ({self.pos}+{n})")
        self.pos += n
        return self._data[start:start + n]


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
        return self.row_groups(file, [group])[0]

    def cast(self, table: pa.Table) -> pa.Table:
        """``table`` cast to the index's features (no value to cast: datasets' result, without it)."""
        cast = cast_like_datasets(table, self._schema)
        if cast is None:
            from datasets.table import table_cast

            cast = table_cast(table, self._schema)
        return cast

    def group_reading(self, file: int, group: int) -> GroupReading:
        """A large row group read batch by batch: its bytes fetched now (remote: in concurrent ranged reads), its
        rows decoded as they are asked for (``GroupReading``)."""
        entry = self._files[file]
        md = self.metadata(file)
        _, start, end = entry["row_groups"][group]
        data = read_range_parallel(entry["path"], start, end, self._storage_options, entry)
        return GroupReading(self, entry["path"], _Span(start, data, entry["size"]), md, group, len(data))

    def row_groups(self, file: int, groups: list[int]) -> list[pa.Table]:
        """Row groups ``groups`` of file ``file`` (adjacent, in file order) in one ranged read of their bytes, each
        decoded, checked against the footer and cast: fewer requests, the same rows and checks. Bytes that fail a
        check are read once more, all of them (read_checked)."""
        entry = self._files[file]
        md = self.metadata(file)
        span = f"row group {groups[0]}" if len(groups) == 1 else f"row groups {groups[0]}-{groups[-1]}"
        tables = read_checked(f"data file {entry['path']!r} ({span})", lambda: self._decoded(entry, md, groups))
        return [self.cast(table) for table in tables]

    def _decoded(self, entry: dict, md: pq.FileMetaData, groups: list[int]) -> list[pa.Table]:
        spans = [entry["row_groups"][g] for g in groups]
        start, end = spans[0][1], spans[-1][2]
        if any(b[1] < a[2] for a, b in zip(spans, spans[1:])):
            raise SourceError(f"data file {entry['path']!r}: row groups {groups} are not in file order")
        data = read_range(entry["path"], start, end, self._storage_options, entry)
        tables = []
        for group in groups:
            which = f"row group {group}: " if len(groups) > 1 else ""
            try:
                table = read_row_group(_Span(start, data, entry["size"]), md, group)
            except (pa.ArrowException, OSError) as e:    # the bytes of the right length are not these row groups'
                raise WrongBytes(f"{which}its bytes do not decode ({type(e).__name__}: {e})") from None
            problem = row_group_check.problem(table, md, group)
            if problem is not None:
                raise WrongBytes(f"{which}its decoded rows contradict the file's footer: {problem}")
            tables.append(table)
        return tables


# A row group whose column chunks span more bytes than this is decoded batch by batch: a window's first sample
# waits for its own rows, not for the whole group (100k-row groups of documents: seconds of decoding).
LARGE_GROUP_BYTES = 32 << 20
GROUP_BATCH_ROWS = 4096


class GroupReading:
    """One large row group being decoded, ``GROUP_BATCH_ROWS`` at a time (pyarrow's ``iter_batches``), one batch
    decoded ahead on a worker thread while the one before is used. Each batch is checked against the footer's
    bounds before it is handed on (``parquet_checks.RunningCheck``), the whole group exactly after its last; a
    failed check is a SourceError naming the file and row group (its rows before it were vouched for by the
    bounds only). ``nbytes``: what it holds (the fetched bytes and the decoded batches not yet taken)."""

    def __init__(self, files: ParquetFiles, path: str, span: _Span, md: pq.FileMetaData, group: int, fetched: int):
        self._files, self.path, self.group, self._fetched = files, path, group, fetched
        self._check = row_group_check.RunningCheck(md, group)
        pf = pq.ParquetFile(span, metadata=md, **_OPEN_OPTIONS)
        self._batches = pf.iter_batches(batch_size=GROUP_BATCH_ROWS, row_groups=[group], use_threads=True)
        self.rows = md.row_group(group).num_rows
        self.at = 0                  # rows handed on so far
        self._ready: list[pa.Table] = []
        self._ahead: Future | None = None
        self._done = False

    @property
    def nbytes(self) -> int:
        return self._fetched + sum(t.nbytes for t in self._ready)

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self._ready)

    def _decode_one(self) -> pa.Table | None:
        try:
            batch = next(self._batches, None)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"data file {self.path!r} (row group {self.group}): its bytes do not decode "
                              f"({type(e).__name__}: {e})") from None
        if batch is None:
            problem = self._check.finish()
            if problem is not None:
                raise SourceError(f"data file {self.path!r} (row group {self.group}): its decoded rows contradict "
                                  f"the file's footer: {problem}")
            return None
        table = pa.Table.from_batches([batch])
        problem = self._check.add(table)
        if problem is not None:
            raise SourceError(f"data file {self.path!r} (row group {self.group}): its decoded rows contradict the "
                              f"file's footer: {problem}")
        return self._files.cast(table)

    def decode_first(self, rows: int) -> None:
        """Decode (on this thread) until ``rows`` rows are ready (a fetch ahead: the first window's)."""
        while not self._done and self.num_rows < rows:
            table = self._decode_one()
            if table is None:
                self._done = True
            else:
                self._ready.append(table)

    def next_table(self) -> pa.Table | None:
        """The next decoded batch (None after the last); the one after it starts decoding meanwhile."""
        if self._ready:
            table = self._ready.pop(0)
        elif self._done:
            return None
        else:
            future, self._ahead = self._ahead, None
            table = future.result() if future is not None else self._decode_one()
            if table is None:
                self._done = True
                return None
        self.at += table.num_rows
        if not self._done and self._ahead is None and not self._ready:
            self._ahead = decoder_pool().submit(self._decode_one)
        return table

    def close(self) -> None:
        future, self._ahead = self._ahead, None
        if future is not None and not future.cancel():
            try:
                future.result()
            except Exception:      # noqa: BLE001 - a batch nobody reads
                pass


_POOL: list = []


def decoder_pool():
    """This process's threads decoding what a reader takes next (a large row group's next batch, the next piece of
    a JSON-lines shard) while it uses the one before; a forked worker makes its own."""
    from concurrent.futures import ThreadPoolExecutor

    if not _POOL or _POOL[0][0] != os.getpid():
        _POOL[:] = [(os.getpid(), ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="rs-decode"))]
    return _POOL[0][1]
