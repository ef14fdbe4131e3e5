"""Parquet, indexed: one shard per row group, read with pyarrow as one ranged read of its byte span.

The index entry of a file is its identity plus its footer's digest and row-group layout (``index.py``); the
row groups are read, decoded and checked by :class:`~resumable_stream.sources.parquet_rows.ParquetFiles`, fetched
ahead by the :class:`~resumable_stream.sources.prefetch.Prefetcher` in the order the plan gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from ..config.specs import ReadSpec, SourceSpec
from ..errors import IncompleteFileError, SourceError, StreamMismatchError
from ..io import budget as request_budget
from ..io.net import RetryPolicy
from ..io.ranged import read_range, read_tail
from ..limits import is_int
from ..observe.metrics import record_coalesced, record_row_group
from ..plan import RowCounts
from .base import READ_BATCH_ROWS, FetchesAhead, IndexedReader, RetriedSource, ShardInfo
from .fingerprint_files import dataset_fingerprint
from .index import compact_index, identity_of
from .index_table import FileTable
from .parquet_footer import (
    FOOTER_TAIL_BYTES,
    PARQUET_LAYOUT_KEYS,
    features_of,
    file_entry,
    footer_digest,
    split_footer,
)
from .parquet_rows import GROUP_BATCH_ROWS, LARGE_GROUP_BYTES, GroupReading, ParquetFiles, read_checked

# the most bytes between two row groups of a file that one coalesced request reads along (parquet writers leave
# none: a row group's column chunks end where the next one's begin)
COALESCE_GAP = 64 << 10


def parquet_footer(path: str, size: int, retry: RetryPolicy | None = None, identity: dict | None = None,
                   tail: bytes | None = None) -> bytes:
    """The footer of a parquet file of ``size`` bytes (and ``identity``, checked on every answer): one ranged
    read of its tail (two when the footer is bigger than FOOTER_TAIL_BYTES; ``tail``: those bytes, read already).
    A file that begins as parquet does (or is shorter than that) but does not end with its magic has no footer
    yet: IncompleteFileError."""
    options = retry.storage_options if retry else {}
    given = [tail] if tail is not None else []

    def fetch() -> bytes:
        tail = given.pop() if given else read_range(path, max(0, size - FOOTER_TAIL_BYTES), size, options, identity)
        if tail[-4:] != b"PAR1":        # a parquet writer writes the magic first and again after the footer, last
            head = tail if len(tail) == size else read_range(path, 0, 4, options, identity)
            if b"PAR1".startswith(head[:4]):
                raise IncompleteFileError(f"data file {path!r}: not a complete parquet file (its {size} bytes "
                                          "begin as parquet but do not end with its footer and PAR1 magic)")
        length = split_footer(tail, size, path)
        if length > len(tail):
            tail = read_range(path, size - length, size - len(tail), options, identity) + tail
        return tail[len(tail) - length:]

    def checked() -> bytes:
        return read_checked(f"data file {path!r} (its footer)", fetch)

    try:
        if retry is not None and retry.applies(path):
            return retry.call(checked, f"data file {path!r}: reading its parquet footer", [path])
        return checked()
    except (SourceError, StreamMismatchError):
        raise
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None


def prefetch_depth(read: ReadSpec, remote: bool) -> int | None:
    """The most row groups fetched ahead per partition: ``data.prefetch_blocks`` (None: adaptive, up to the
    prefetcher's own cap); for local files at most what keeps the decoding threads busy and the row groups a
    window opens next in flight (one per core, at least ``interleave_shards``): there is no latency to hide,
    and each one ahead is a decoded row group held."""
    if remote or read.prefetch_blocks == 0:
        return read.prefetch_blocks
    local = max(os.cpu_count() or 1, read.interleave_shards)
    return local if read.prefetch_blocks is None else min(read.prefetch_blocks, local)


class ParquetReader(IndexedReader):
    """The registry's parquet entry (``registry._BUILTIN``)."""

    layout_keys = PARQUET_LAYOUT_KEYS
    content_keys = ("footer",)

    def index_file(self, path: str, retry: RetryPolicy | None, identity: dict,
                   footers: dict[str, bytes] | None = None) -> dict:
        if not isinstance(identity.get("size"), int):
            raise SourceError(f"data file {path!r}: its size is unknown; a parquet file needs one to be indexed")
        # ``footers`` may hold this file's footer already (kept by the block cache under this identity)
        footer = footers.get(path) if footers is not None else None
        if footer is None:
            footer = parquet_footer(path, identity["size"], retry, identity)
        if footers is not None:
            footers[path] = footer
        return file_entry(identity, footer)

    def index_unknown(self, path: str, retry: RetryPolicy | None, footers: dict[str, bytes]) -> dict | None:
        """An http(s) file's identity and footer from one suffix-range GET of its tail (``read_tail``) where our
        own options are the only ones (no user headers or auth: the standard library sends it), then its entry:
        a round trip less per file, and no wait for fsspec's HTTP stack on the way to the first sample."""
        if retry is None or not retry.own_http_options or not path.startswith(("http://", "https://")):
            return None

        def tail() -> tuple[dict, bytes] | None:
            return read_checked(f"data file {path!r} (its tail)", lambda: read_tail(path, FOOTER_TAIL_BYTES,
                                                                                  retry.timeout_s))
        try:
            got = retry.call(tail, f"data file {path!r}: reading its parquet footer", [path]) \
                if retry.applies(path) else tail()
        except (SourceError, StreamMismatchError):
            raise
        except FileNotFoundError:
            raise SourceError(f"data file {path!r}: not found") from None
        except Exception as e:
            raise SourceError(f"data file {path!r}: cannot read its metadata ({type(e).__name__}: {e})") from None
        if got is None:
            return None
        identity, data = got
        footer = parquet_footer(path, identity["size"], retry, identity, tail=data)
        footers[path] = footer
        return file_entry(identity, footer)

    def features(self, path: str, footer: bytes | None) -> dict:
        return features_of(footer if footer is not None else b"", path)

    def entry_problem(self, entry: dict) -> str | None:
        # every number at most an int64 (is_int), a footer and the row groups inside the file
        ok = (isinstance(entry.get("footer"), str) and is_int(entry.get("footer_bytes"), 0, entry["size"])
              and isinstance(entry.get("row_groups"), list)
              and all(isinstance(rg, list) and len(rg) == 3 and all(is_int(x) for x in rg)
                      and rg[1] <= rg[2] <= entry["size"] for rg in entry["row_groups"]))
        return None if ok else "malformed (path, size, footer, footer_bytes, row_groups [rows, start, end])"

    def local_check(self, path: str, identity: dict, retry: RetryPolicy | None, entry: dict) -> dict:
        # a local footer read costs no request: it catches a same-size, same-mtime rewrite
        try:
            return {"footer": footer_digest(parquet_footer(path, identity["size"], retry))}
        except SourceError as e:
            return {"footer": str(e)}

    def indexable(self, builder: Any) -> bool:
        """Parquet files read whole (no column selection or row filter in the builder config)."""
        return (getattr(builder.config, "columns", None) is None
                and getattr(builder.config, "filters", None) is None)

    def open_indexed(self, spec: SourceSpec, index: dict, retry: RetryPolicy,
                     footers: dict[str, bytes] | None = None) -> ParquetSource:
        return source_from_index(spec, index, retry, footers)


READER = ParquetReader()


class RowGroupShards(Sequence):
    """The shards of a columnar index (one per row group), made on demand: a ``ShardInfo`` per row group
    held by every rank would cost more than the index itself."""

    def __init__(self, files: FileTable):
        self.files = files
        self.rows = files.group_rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"shard {i} of {len(self)}")
        i %= len(self)
        file, group = self.files.group_of(i)
        return ShardInfo(i, self.files.path(file), group, int(self.rows[i]))

    def row_counts(self) -> RowCounts:
        return RowCounts(self.rows)


def source_from_index(spec: SourceSpec, index: dict, retry: RetryPolicy,
                      footers: dict[str, bytes] | None = None) -> ParquetSource:
    """The stream of an indexed parquet dataset: one shard per row group, read with pyarrow."""
    index = compact_index(index)
    files = index["files"]
    if isinstance(files, FileTable):
        shards = RowGroupShards(files)
    else:
        shards = [ShardInfo(0, f["path"], g, rg[0]) for f in files for g, rg in enumerate(f["row_groups"])]
        shards = [ShardInfo(i, s.file, s.part, s.num_rows) for i, s in enumerate(shards)]
    # a table's files: their count and digest (the fingerprint is part of every state_dict); a list's: listed
    identities = files if isinstance(files, FileTable) else [identity_of(f) for f in files]
    fingerprint = dataset_fingerprint(spec, index["builder"], identities, shards)
    return ParquetSource(shards, fingerprint, retry if retry.remote else None,
                         ParquetFiles(index, retry.storage_options, footers), index,
                         prefetch_blocks=prefetch_depth(spec.read, retry.remote),
                         prefetch_memory_mb=spec.read.prefetch_memory_mb)


class ParquetSource(FetchesAhead, RetriedSource):
    """An indexed parquet dataset, one shard per row group read with pyarrow
    (:class:`~resumable_stream.sources.parquet_rows.ParquetFiles`), fetched ahead in plan order."""

    exact_rows = True       # a row group's rows are its footer's count, checked when decoded (parquet_checks)

    def __init__(self, shards: list[ShardInfo], fingerprint: dict, retry: RetryPolicy | None,
                 parquet: ParquetFiles, index: dict, prefetch_blocks: int | None = 0,
                 prefetch_memory_mb: float | None = None):
        super().__init__(shards, fingerprint, retry)
        self._parquet = parquet
        self.index = index
        self.column_names = parquet.column_names
        files = index["files"]
        self._file_of = None if isinstance(files, FileTable) else {f["path"]: i for i, f in enumerate(files)}
        remote = retry is not None
        self._fetch_ahead(self._fetch_row_group, prefetch_blocks, prefetch_memory_mb, self._row_group_bytes,
                          remote=remote, rate=self._request_rate if remote else None,
                          run=self._fetch_row_groups if remote else None,
                          adjacent=self._adjacent_row_groups if remote else None)

    @property
    def footers(self) -> dict[str, bytes]:
        return self._parquet.footers

    def _row_group_bytes(self, shard: int) -> int:
        """The bytes one fetch of ``shard`` transfers (its row group's span in the index)."""
        _, _, start, end = self._span(shard)
        return end - start

    # ------------------------------------------------------------------ the request budget and coalescing
    def _request_rate(self) -> float | None:
        """Requests per second this process may send to the data's store (io/budget.py; None: unlimited)."""
        return request_budget.process_rate(self.shards[0].file) if len(self.shards) else None

    def _span(self, shard: int) -> tuple[int, int, int, int]:
        """(file, row group, first byte, end byte) of ``shard``."""
        if self._file_of is None:
            files = self.index["files"]
            file, group = files.group_of(shard)
            return (file, group, *files.group_span(shard))
        info = self.shards[shard]
        file = self._file_of[info.file]
        _, start, end = self.index["files"][file]["row_groups"][info.part]
        return file, info.part, start, end

    def _adjacent_row_groups(self, shard: int) -> tuple[int | None, int | None]:
        """The shards of the row groups just before and just after ``shard``'s in its file, each when no more than
        COALESCE_GAP bytes lie between them (one request may then carry both)."""
        file, _, start, end = self._span(shard)
        out: list[int | None] = []
        for other in (shard - 1, shard + 1):
            if 0 <= other < len(self.shards):
                o_file, _, o_start, o_end = self._span(other)
                gap = start - o_end if other < shard else o_start - end
                if o_file == file and 0 <= gap <= COALESCE_GAP:
                    out.append(other)
                    continue
            out.append(None)
        return out[0], out[1]

    def _fetch_row_groups(self, shards: list[int]) -> list[pa.Table]:
        """Adjacent row groups of one file (``shards``, in file order) in one ranged request, each decoded and
        checked on its own (ParquetFiles.row_groups)."""
        spans = [self._span(shard) for shard in shards]
        tables = self._parquet.row_groups(spans[0][0], [group for _, group, _, _ in spans])
        for table in tables:
            record_row_group(table.num_rows)
        record_coalesced(len(tables) - 1)
        return tables

    def _fetch_row_group(self, shard: int) -> pa.Table | GroupReading:
        """The row group's table; a large one (LARGE_GROUP_BYTES) as a GroupReading with the rows the hinted start
        and the batch after it decoded (a fetch ahead), the rest decoded as they are read."""
        file, group, start, end = self._span(shard)
        if end - start > LARGE_GROUP_BYTES:
            reading = self._parquet.group_reading(file, group)
            reading.decode_first(self._starts.get(shard, 0) + GROUP_BATCH_ROWS)
            record_row_group(reading.rows)
            return reading
        table = self._parquet.row_group(file, group)
        record_row_group(table.num_rows)
        return table

    def _tables_from(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        """One row group, from ``start_row``, in tables of READ_BATCH_ROWS counted from its first row (a large one:
        in its decoded batches)."""
        table = self._taken(shard)
        if isinstance(table, GroupReading) and table.at > start_row:
            table.close()          # (read past the row already: another reader's) read it afresh
            table = None
        if table is None:
            table = self._fetch_row_group(shard)
        if isinstance(table, GroupReading):
            yield from self._group_tables(table, start_row)
            return
        for lo in range(0, table.num_rows, READ_BATCH_ROWS):
            hi = min(lo + READ_BATCH_ROWS, table.num_rows)
            if hi > start_row:
                yield table.slice(max(lo, start_row), hi - max(lo, start_row))

    @staticmethod
    def _group_tables(reading: GroupReading, start_row: int) -> Iterator[pa.Table]:
        try:
            while True:
                lo = reading.at
                table = reading.next_table()
                if table is None:
                    return
                if lo + table.num_rows > start_row:
                    yield table.slice(max(0, start_row - lo))
        finally:
            reading.close()
