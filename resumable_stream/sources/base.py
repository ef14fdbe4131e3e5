"""What every reader is: a shard list, a fingerprint, ``read(shard, start_row)``; the optional parts declared
here with the values of a source that has none of them, so that callers call them instead of probing for them;
and the plumbing the indexed readers share (ranged fetches, fetching ahead, retried opens, file objects).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..config.specs import SourceSpec
from ..errors import ResumableStreamError, SourceError
from ..io.net import RetryPolicy, datasets_retries_off
from ..io.ranged import read_range
from .prefetch import Prefetcher

# Rows per Arrow table handed to the stream while reading a shard.
READ_BATCH_ROWS = 8192


@dataclass(frozen=True)
class ShardInfo:
    index: int
    file: str            # path or URL of the file the shard lives in ("" when unknown)
    part: int | None     # parquet row group or map-style slice; None for a whole file
    num_rows: int | None

    @property
    def name(self) -> str:
        base = os.path.basename(self.file.rstrip("/")) or f"shard{self.index}"
        return base if self.part is None else f"{base}#{self.part}"


def fetcher(path: str, retry: RetryPolicy | None, identity: dict, what: str = "") -> Callable[[int, int], bytes]:
    """``fetch(start, end)``: bytes of ``path`` (checked against ``identity`` on every answer) under ``retry``."""
    options = retry.storage_options if retry else {}

    def fetch(start: int, end: int) -> bytes:
        if retry is not None and retry.applies(path):
            return retry.call(lambda: read_range(path, start, end, options, identity),
                              f"data file {path!r}: reading bytes {start}-{end}{what and ' ' + what}", [path])
        return read_range(path, start, end, options, identity)

    return fetch


class SeekableFile(io.RawIOBase):
    """A read-only file object of ``size`` bytes at ``pos`` for pyarrow, tarfile and indexed_gzip to read through;
    a subclass gives ``read`` (or ``readinto``)."""

    size = pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def shards_of_runs(files: list[dict], runs: list[tuple[int, int, int]],
                   rows: Callable[[tuple[int, int, int]], int]) -> list[ShardInfo]:
    """One shard per run ``(file, first, end)`` of a file's parts, numbered inside its file; ``rows(run)``."""
    out, last, j = [], None, 0
    for i, run in enumerate(runs):
        j = j + 1 if run[0] == last else 0
        last = run[0]
        out.append(ShardInfo(i, files[run[0]]["path"], j, rows(run)))
    return out


class Source:
    """A dataset split cut into shards. Use :func:`resumable_stream.sources.open_source` to make one.

    Exact resume rests on three guarantees: ``shards`` is the same list (order, rows) for the same data and
    config in every process; ``read(shard, start_row)`` yields exactly the rows of that shard from
    ``start_row`` on, in the same order each time; ``fingerprint`` changes whenever the data does."""

    shards: list[ShardInfo]
    fingerprint: dict
    column_names: list[str] | None = None
    index: dict | None = None     # the dataset index it reads (saved with checkpoints, shared by rank 0)
    is_cached: bool = False       # behind the block cache already (not to be wrapped again)
    prefetch_depth: int = 0       # shards fetched ahead per partition (0: no prefetch)
    exact_rows: bool = False      # every shard's num_rows is exactly what read() yields (checked as it reads):
                                  # a window is then planned before any of it is read (stream/partition.py)

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        raise NotImplementedError

    @property
    def footers(self) -> dict[str, bytes]:
        """The raw file metadata this source read (path -> bytes: parquet footers), to share with other ranks."""
        return {}

    def prefetch(self, partition: int, shards: list[int], starts: dict[int, int] | None = None) -> None:
        """The plan says ``partition`` opens ``shards`` next, in this order (a hint; ignoring it is fine).
        ``starts``: shard -> the row a shard is reopened at (a resume inside it; absent: row 0). A fetch
        ahead may start there; a read from an earlier row must then not use it."""

    def prefetch_ahead(self, partition: int) -> int:
        """How many of ``partition``'s next shards are worth hinting now."""
        return 0

    def prefetch_stats(self) -> dict:
        """The prefetcher's depth, measurements and byte counters; {} without prefetch."""
        return {}

    def stats(self) -> dict[str, Any] | None:
        """The block cache's counters; None: not behind a cache."""
        return None

    def close(self) -> None:
        """Stop background work (fetches ahead) and wait for it; reading again starts it afresh."""


class FetchesAhead(Source):
    """A source that fetches whole shards ahead in plan order through a :class:`~.prefetch.Prefetcher`
    (``_fetch_ahead`` starts it); subclasses read a shard's fetch with ``_taken(shard)``."""

    _prefetch = None

    def _fetch_ahead(self, fetch, depth: int | None, memory_mb: float | None, bytes_of, remote: bool,
                     rate=None, run=None, adjacent=None, decoded=None, first_depth=None,
                     whole_call: bool = False) -> None:
        """Fetch ahead with ``fetch(shard)`` up to ``depth`` shards per partition (None: adaptive; 0: off) within
        ``memory_mb``; the other arguments are :class:`~.prefetch.Prefetcher`'s."""
        self._starts: dict[int, int] = {}     # shard -> the row its next fetch ahead starts at (a resume)
        if depth is not None and depth <= 0:
            return
        budget = None if memory_mb is None else int(memory_mb * 2**20)
        # local files: decoding is the work, so one thread per core (more only delay the shards needed first);
        # remote: the prefetcher's own count, for concurrent requests
        cores = os.cpu_count() or 1
        threads = None if remote else max(1, min(depth or cores, cores))
        self._prefetch = Prefetcher(fetch, depth, budget, bytes_of, threads, first_alone=not remote, rate=rate,
                                    run=run, adjacent=adjacent, decoded=decoded,
                                    first_depth=first_depth, whole_call=whole_call)

    def _taken(self, shard: int) -> pa.Table | None:
        """The table fetched ahead for ``shard``; None when there is none or its fetch met a network fault (the
        caller then reads it under the retries). Bytes that failed the checks twice raise: a third read is not due."""
        ahead = self._prefetch.take(shard) if self._prefetch is not None else None
        if ahead is None:
            return None
        try:
            return ahead.result()
        except ResumableStreamError:
            raise
        except Exception:
            return None

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()

    @property
    def prefetch_depth(self) -> int:
        return self._prefetch.depth if self._prefetch is not None else 0

    def prefetch(self, partition: int, shards: list[int], starts: dict[int, int] | None = None) -> None:
        """Fetch ``shards`` ahead; ``starts`` (a resume inside a shard) kept for ``fetch`` to start there."""
        if self._prefetch is not None:
            self._starts.update((s, (starts or {}).get(s, 0)) for s in shards)
            self._prefetch.hint(partition, shards)

    def _opened(self, shard: int, start_row: int, open_at: Callable[[int, int], Any]) -> Any:
        """``open_at(shard, start_row)`` under ``data.retries`` (a network fault opening it: tried again)."""
        info, retry = self.shards[shard], getattr(self, "_retry", None)
        label = f"data file {info.file!r} (shard {shard}, {info.name}): read at row {start_row}"
        try:
            if retry is not None and retry.applies(info.file):
                return retry.call(lambda: open_at(shard, start_row), label, [info.file])
            return open_at(shard, start_row)
        except ResumableStreamError:
            raise
        except Exception as e:
            raise SourceError(f"{label} failed ({type(e).__name__}: {e})") from None

    def prefetch_ahead(self, partition: int) -> int:
        """Its adaptive depth, and a margin (at most the prefetcher's cap)."""
        return min(self._prefetch.cap, self._prefetch.depth_for(partition) + 8) if self._prefetch is not None else 0

    def prefetch_stats(self) -> dict:
        return self._prefetch.stats() if self._prefetch is not None else {}


class RetriedSource(Source):
    """A source whose reads go over the network: a read that fails midway (reset, 5xx, truncated body,
    timeout) reopens the shard at the next row not yet yielded, under ``data.retries``, so the rows come out
    as without the fault. Subclasses give ``_tables_from(shard, start_row)``."""

    def __init__(self, shards: list[ShardInfo], fingerprint: dict, retry: RetryPolicy | None):
        self.shards = shards
        self.fingerprint = fingerprint
        self._retry = retry

    def _tables_from(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        raise NotImplementedError

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        """Errors from deep inside datasets / fsspec become one SourceError naming the file."""
        info = self.shards[shard]
        retry = self._retry if self._retry is not None and self._retry.applies(info.file) else None
        row, attempt, started = start_row, 0, time.monotonic()
        while True:
            tables = self._tables_from(shard, row)
            try:
                while True:
                    try:
                        with datasets_retries_off() if retry is not None else contextlib.nullcontext():
                            table = next(tables)
                    except StopIteration:
                        return
                    except Exception as e:
                        label = f"data file {info.file!r} (shard {shard}, {info.name}): read at row {row}"
                        if retry is None or not retry.failed(e, attempt, label, [info.file] if info.file else [],
                                                             started):
                            err = self._read_error(shard, e)
                            if err is e:
                                raise
                            raise err from e
                        attempt += 1
                        break        # reopen the shard at ``row``, the first row not yet yielded
                    # progress: a later fault gets the full number of retries and time again
                    attempt, started = 0, time.monotonic()
                    row += table.num_rows
                    yield table
            finally:
                tables.close()

    def _read_error(self, shard: int, e: Exception) -> ResumableStreamError:
        if isinstance(e, ResumableStreamError):
            return e                 # ours already names the file (a StreamMismatchError stays one)
        info = self.shards[shard]
        return SourceError(f"data file {info.file!r} (shard {shard}, {info.name}): read failed "
                           f"({type(e).__name__}: {e})")


class NotIndexable(SourceError):
    """A file a registered format turns out not to read (a ``.json`` file holding one JSON array): the dataset
    is read by ``datasets``' own reader instead."""


class IndexedReader:
    """A format we index and read ourselves (registered in :mod:`~resumable_stream.config.formats`): per file
    ``index_file`` gives its identity plus the layout that cuts it into shards; exact resume rests on
    ``open_indexed`` making the same shards from the same index in every process (docs/internals.md)."""

    layout_keys: tuple[str, ...] = ()    # entry keys that describe the layout, not the file's identity
    index_reads_files = False            # index_file reads every byte (JSON lines): files indexed one per core
    content_keys: tuple[str, ...] = ()   # identity keys only ``local_check`` gives (remote files: not re-read)

    def index_file(self, path: str, retry: RetryPolicy | None, identity: dict,
                   footers: dict[str, bytes] | None = None) -> dict:
        """One file's index entry: ``identity`` plus its layout. ``footers``: filled with path -> the raw
        metadata read that readers may reuse (checked against the entry when they do)."""
        raise NotImplementedError

    def index_unknown(self, path: str, retry: RetryPolicy | None, footers: dict[str, bytes]) -> dict | None:
        """``index_file`` of a file whose identity is not known yet, in fewer requests where the store allows it
        (parquet over http(s): one suffix-range GET); None (the default): identity first, then ``index_file``."""
        return None

    def index_complete(self, path: str, retry: RetryPolicy | None, identity: dict,
                       footers: dict[str, bytes] | None = None) -> dict:
        """``index_file`` for a growing dataset: IncompleteFileError for a file still being written."""
        return self.index_file(path, retry, identity, footers)

    def features(self, path: str, footer: bytes | None) -> dict:
        """The features of the data when ``datasets`` gives none (``Features.to_dict()`` form)."""
        raise SourceError(f"data file {path!r}: its features are unknown")

    def infer_features(self, spec: SourceSpec, entry: dict, footer: bytes | None, retry: RetryPolicy | None) -> Any:
        """The features when ``datasets`` gives none, from the first file's entry and raw metadata (default:
        :meth:`features`)."""
        return self.features(entry["path"], footer)

    def features_ahead(self, spec: SourceSpec, path: str, retry: RetryPolicy | None) -> Any:
        """A future of the features inferred from the first file while the files are indexed; None: not so."""
        return None

    def entry_problem(self, entry: dict) -> str | None:
        """What is wrong with an index entry read from disk (a forged or damaged index), None if nothing."""
        return None

    def local_check(self, path: str, identity: dict, retry: RetryPolicy | None, entry: dict) -> dict:
        """Identity fields beyond size and mtime a local file is checked on at resume (compared with ``entry``'s)."""
        return {}

    def indexable(self, builder: Any) -> bool:
        """Whether ``datasets``' builder (config) reads the files whole, as our reader would."""
        return True

    def reads_files(self, files: list[str]) -> bool:
        """Whether this reader reads every one of ``files`` (by their names: e.g. a compression it indexes)."""
        return True

    def open_indexed(self, spec: SourceSpec, index: dict, retry: RetryPolicy,
                     footers: dict[str, bytes] | None) -> Source:
        """The source of an index this reader built (the shard list a pure function of the index)."""
        raise NotImplementedError


class ScannedReader(IndexedReader):
    """A format indexed by one pass over each file: ``scan(path, retry, identity, whole)``, ``whole`` for a
    growing dataset (IncompleteFileError for a file still being written)."""

    scan: Callable[..., dict]

    def index_file(self, path: str, retry: RetryPolicy | None, identity: dict,
                   footers: dict[str, bytes] | None = None) -> dict:
        return self.scan(path, retry, identity)

    def index_complete(self, path: str, retry: RetryPolicy | None, identity: dict,
                       footers: dict[str, bytes] | None = None) -> dict:
        return self.scan(path, retry, identity, whole=True)
