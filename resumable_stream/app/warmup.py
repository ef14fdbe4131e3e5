"""Cache warmup: fetch exactly the blocks some ranks will read in their next N samples, planned by running the
real stream over row numbers only (nothing downloaded), then fetched in parallel (docs/cache-and-warmup.md)."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..cache.cached_source import CachedSource
from ..config.stream_config import MixtureConfig, StreamConfig
from ..dataset.job_source import open_job_sources
from ..errors import ConfigError
from ..sources.base import Source
from ..sources.open import open_source
from ..state.checkpoint import (
    SavedIndexes,
    find_state_dir,
    read_manifest,
    read_state_file,
    resolve_rank_state,
)
from ..stream.mixture import MixtureSources, MixtureStream
from ..stream.single import ResumableStream

log = logging.getLogger(__name__)


READ_AHEAD_TABLES = 4     # tables an unknown-length shard's reader thread may be ahead of the planner


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _pump(tables: Iterator[pa.Table], q: queue.Queue, stop: threading.Event) -> None:
    """The read-ahead thread (holds no reference to its _ReadAhead, so that one can be collected)."""
    try:
        for table in tables:
            if not _put(q, stop, ("rows", table.num_rows)):
                return
        _put(q, stop, ("end", None))
    except BaseException as e:   # handed to the caller, which raises it
        _put(q, stop, ("error", e))
    finally:
        close = getattr(tables, "close", None)
        if close is not None:
            close()


class _ReadAhead:
    """The row counts of ``tables``, read by a thread up to ``depth`` tables ahead, so that the shards a partition
    interleaves download in parallel. ``close()`` stops it; a read error is raised in the caller."""

    def __init__(self, tables: Iterator[pa.Table], depth: int = READ_AHEAD_TABLES):
        self._q, self._stop, self._done = queue.Queue(maxsize=depth), threading.Event(), False
        self._thread = threading.Thread(target=_pump, args=(tables, self._q, self._stop),
                                        name="rs-warmup-read-ahead", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self._done:
            raise StopIteration
        kind, value = self._q.get()
        if kind == "rows":
            return value
        self.close()
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join()

    __del__ = close


class _PlanningSource(Source):
    """Row numbers instead of data, block by block; records the blocks the reader pulls."""

    is_cached = True      # the stream must not wrap it in another cache

    def __init__(self, cached: CachedSource):
        self.cached = cached
        self.shards = cached.shards
        self.fingerprint = cached.fingerprint
        self.column_names = ["row"]
        self.exact_rows = cached.exact_rows   # windows planned (and so read) as the cached stream's are
        self.need: dict[tuple[int, int], tuple[int, int]] = {}   # (shard, block) -> (sample index, rank)
        self.clock = (0, 0)

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        if self.shards[shard].num_rows is None:   # unknown length: read through the cache (fills it)
            return self._read_through(shard, start_row, _ReadAhead(self.cached.read(shard, start_row)))
        return self._row_numbers(shard, start_row)

    @staticmethod
    def _read_through(shard: int, start_row: int, counts: _ReadAhead) -> Iterator[pa.Table]:
        row = start_row
        try:
            for rows in counts:
                yield pa.table({"row": np.arange(row, row + rows, dtype=np.int64)})
                row += rows
        finally:
            counts.close()

    def _row_numbers(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        n = self.shards[shard].num_rows
        if start_row >= n:         # as CachedSource.read: nothing to look up
            return
        R = self.cached.block_rows
        block = start_row // R
        while block * R < n:       # the same blocks, pulled at the same moments, as CachedSource.read
            self.need.setdefault((shard, block), self.clock)
            lo, hi = max(start_row, block * R), min(n, (block + 1) * R)
            yield pa.table({"row": np.arange(lo, hi, dtype=np.int64)})
            block += 1


@dataclass
class WarmupPlan:
    """What a warmup will fetch."""

    cached: CachedSource
    ranks: list[int]
    world_size: int
    num_workers: int
    samples: int
    blocks: list[tuple[int, int]]                 # (shard, block) the ranks read, in the order first needed
    missing: list[tuple[int, int]]                # of those, not in the cache yet (same order)
    read_through_blocks: int = 0                  # blocks of unknown-length shards cached while planning
    seconds: float = 0.0

    def jobs(self) -> list[tuple[int, int, int]]:
        """(shard, first block, last block) runs of consecutive missing blocks, in the order needed."""
        order = {b: i for i, b in enumerate(self.missing)}
        runs = []
        for shard, group in itertools.groupby(sorted(self.missing), key=lambda b: b[0]):
            # consecutive blocks keep block - position constant
            for _, run in itertools.groupby(enumerate(b for _, b in group), key=lambda ib: ib[1] - ib[0]):
                blocks = [b for _, b in run]
                runs.append((min(order[(shard, b)] for b in blocks), shard, blocks[0], blocks[-1]))
        runs.sort()
        return [(shard, a, b) for _, shard, a, b in runs]


@dataclass
class WarmupResult:
    planned_blocks: int
    already_cached: int
    fetched_blocks: int
    fetched_bytes: int
    read_through_blocks: int
    plan_seconds: float
    fetch_seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    not_cached: int = 0             # planned blocks not in the cache after the warmup
    why: str | None = None          # the cache's last failure, when some are missing

    def summary(self) -> str:
        missing = (f"; {self.not_cached} of {self.planned_blocks} blocks could NOT be cached"
                   + (f" ({self.why})" if self.why else "") if self.not_cached else "")
        return (f"{self.planned_blocks} blocks needed, {self.already_cached} already cached, "
                f"{self.fetched_blocks} fetched ({self.fetched_bytes / 1e6:.1f} MB) in {self.fetch_seconds:.1f} s "
                f"(planning {self.plan_seconds:.1f} s"
                + (f", {self.read_through_blocks} blocks of unknown-length shards read while planning"
                   if self.read_through_blocks else "") + ")" + missing)


def checkpoint_topology(state_path: str) -> tuple[int, int, list[int]]:
    """(world size, DataLoader workers, ranks present) of a sidecar file, stream_state dir or checkpoint dir."""
    if os.path.isfile(state_path):     # one rank's file, or a job's (every rank's partitions)
        topo = read_state_file(state_path)["stream"]["topology"]
        world = int(topo["world_size"])
        return world, int(topo["num_workers"]), list(range(world)) if topo["rank"] is None else [int(topo["rank"])]
    state_dir = find_state_dir(state_path)
    world = int(read_manifest(state_dir)["world_size"])
    topo = resolve_rank_state(state_path, 0)[0]["stream"]["topology"]
    return world, int(topo["num_workers"]), list(range(world))


def _open_cached(config: StreamConfig, source: Source | None, block_rows: int | None) -> CachedSource:
    if not config.cache_dir:
        raise ConfigError("data.cache_dir: got null; warmup fills the block cache, set data.cache_dir to a "
                          "local directory")
    if isinstance(source, CachedSource):
        return source
    return CachedSource(source if source is not None else open_source(config.source_spec), config.cache_spec,
                        block_rows=block_rows)


def plan_warmup(config: StreamConfig, samples: int, *, world_size: int | None = None,
                ranks: list[int] | None = None, num_workers: int | None = None, state_path: str | None = None,
                source: Source | None = None, block_rows: int | None = None) -> WarmupPlan:
    """The blocks ranks ``ranks`` of ``world_size`` read in their next ``samples`` samples each.

    The cursors are fresh, or loaded from ``state_path`` (default ``config.resume_state_path``), whose topology
    gives the defaults of ``world_size`` / ``num_workers`` / ``ranks``. The window after the last sample is
    included when the Nth sample ends a window (saving a checkpoint there reads it)."""
    return _plans(config, samples, world_size, ranks, num_workers, state_path, [source], block_rows)[0]


def _plans(config: StreamConfig | MixtureConfig, samples: int, world_size: int | None, ranks: list[int] | None,
           num_workers: int | None, state_path: str | None, sources: list[Source | None] | None,
           block_rows: int | None) -> list[WarmupPlan]:
    """:func:`plan_warmup`, one plan per source: a mixture's traced with the real mixture draws, its ``sources``
    (None: opened as the job opens them, each source's saved or given index reused)."""
    t0 = time.perf_counter()
    state_path, world_size, num_workers, ranks = _topology(config, samples, world_size, ranks, num_workers, state_path)
    mixture = isinstance(config, MixtureConfig)
    configs = config.sources if mixture else [config]
    if not config.cache_dir:
        _open_cached(configs[0], None, block_rows)       # the error naming data.cache_dir
    if sources is None:     # a mixture's (a single dataset's is given, or [None]: opened with the cache)
        sources = open_job_sources([s.source_spec for s in configs], list(config.labels),
                                   saved=SavedIndexes(state_path) if state_path else None)
    cached = [_open_cached(c, src, block_rows) for c, src in zip(configs, sources)]
    planners = [_PlanningSource(c) for c in cached]
    written_before = [c.store.stats()["blocks_written"] for c in cached]
    plain = config.replace(resume_state_path=None)
    stream_cls, reads = (MixtureStream, {"sources": planners}) if mixture else (ResumableStream, {"source": planners[0]})
    _trace(lambda rank: stream_cls(plain, rank=rank, world_size=world_size, num_workers=num_workers, **reads),
           planners, ranks, samples, state_path)
    return [_plan_of(p, w, ranks, world_size, num_workers, samples, t0) for p, w in zip(planners, written_before)]


def _topology(config: Any, samples: int, world_size: int | None, ranks: list[int] | None, num_workers: int | None,
              state_path: str | None) -> tuple[str | None, int, int, list[int]]:
    """(state path, world size, workers, ranks) of a warmup: as given, else the checkpoint's, else 1 rank."""
    if not (isinstance(samples, int) and samples >= 0):
        raise ConfigError(f"samples: got {samples!r}; allowed: an integer >= 0")
    state_path = state_path or config.resume_state_path
    ck_world = ck_workers = None
    ck_ranks: list[int] | None = None
    if state_path:
        ck_world, ck_workers, ck_ranks = checkpoint_topology(os.fspath(state_path))
    world_size = world_size or ck_world or 1
    num_workers = num_workers if num_workers is not None else (ck_workers or 0)
    if ranks is None:
        ranks = ck_ranks if ck_ranks is not None and ck_world == world_size else list(range(world_size))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise ConfigError(f"ranks: got {ranks!r}; allowed: ranks in 0 .. {world_size - 1}")
    return state_path, world_size, num_workers, ranks


def _trace(make_stream, planners: list[_PlanningSource], ranks: list[int], samples: int,
           state_path: str | None) -> None:
    """Run each rank's stream (``make_stream(rank)``, over ``planners``) for ``samples`` samples, from
    ``state_path``'s cursors when given, stamping what each sample pulls with (sample index, rank)."""
    for rank in ranks:
        stream = make_stream(rank)
        if state_path:   # this rank's partitions, gathered from the old ranks' files after a topology change
            state, where = stream.read_sidecar(state_path)
            stream.load_state_dict(state["stream"], where, verify_next_sample=False)   # row numbers, not the samples
        it = iter(stream)
        for i in range(samples):
            for planner in planners:
                planner.clock = (i, rank)
            next(it)
        for planner in planners:
            planner.clock = (samples, rank)
        stream.state_dict()          # a checkpoint right after the Nth sample reads the next window


def _plan_of(planner: _PlanningSource, written_before: int, ranks: list[int], world_size: int, num_workers: int,
             samples: int, t0: float) -> WarmupPlan:
    cached = planner.cached
    cached.flush()                   # blocks of unknown-length shards read while planning
    blocks = [b for b, _ in sorted(planner.need.items(), key=lambda kv: (kv[1], kv[0]))]
    missing = [b for b in blocks if not cached.store.contains(*b)]
    return WarmupPlan(cached=cached, ranks=list(ranks), world_size=world_size, num_workers=num_workers,
                      samples=samples, blocks=blocks, missing=missing,
                      read_through_blocks=cached.store.stats()["blocks_written"] - written_before,
                      seconds=time.perf_counter() - t0)


def fetch(plan: WarmupPlan, jobs: int = 8, progress: bool = True) -> tuple[int, int, float]:
    """Fetch the plan's missing blocks with ``jobs`` threads; (blocks written, bytes, seconds)."""
    from tqdm.auto import tqdm

    if not (isinstance(jobs, int) and jobs >= 1):
        raise ConfigError(f"jobs: got {jobs!r}; allowed: an integer >= 1")
    t0 = time.perf_counter()
    runs = plan.jobs()
    if not runs:
        return 0, 0, 0.0
    lock = threading.Lock()
    done = {"blocks": 0, "bytes": 0}
    bar = tqdm(total=len(plan.missing), unit="block", desc="warmup", disable=not progress, dynamic_ncols=True)

    def on_block(nbytes: int) -> None:
        with lock:
            done["blocks"] += 1
            done["bytes"] += nbytes
            elapsed = max(1e-9, time.perf_counter() - t0)
            bar.set_postfix_str(f"{done['bytes'] / 1e6:,.1f} MB, {done['bytes'] / 1e6 / elapsed:,.1f} MB/s",
                                refresh=False)
            bar.update(1)

    cached = plan.cached
    written = nbytes = 0
    try:
        with ThreadPoolExecutor(max_workers=min(jobs, len(runs)), thread_name_prefix="rs-warmup") as pool:
            futures = [pool.submit(cached.fetch_blocks, shard, a, b, on_block) for shard, a, b in runs]
            finished, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in itertools.chain(finished, pending):
                if f.cancelled():
                    continue
                w, n = f.result()          # re-raises the first failure
                written, nbytes = written + w, nbytes + n
    finally:
        bar.close()
    if nbytes > cached.store.size_limit_bytes:
        log.warning("warmup wrote %.1f GB into a cache limited to %.1f GB: the blocks needed first may already "
                    "have been evicted; warm fewer samples or raise data.cache_size_limit_gb",
                    nbytes / 2**30, cached.store.size_limit_bytes / 2**30)
    return written, nbytes, time.perf_counter() - t0


def run_warmup(config: StreamConfig | MixtureConfig, samples: int, *, world_size: int | None = None,
               ranks: list[int] | None = None, num_workers: int | None = None, state_path: str | None = None,
               jobs: int = 8, progress: bool = True, source: Source | None = None,
               block_rows: int | None = None) -> WarmupResult:
    """Plan (:func:`plan_warmup`) and fetch, ``jobs`` fetches at once; a warm cache
    fetches nothing, a mixture's result sums its sources'. ``source``: an opened source (default: opened as the
    job opens it). The result names the blocks still not cached after the fetch and why (``not_cached`` / ``why``)."""
    plans = _plans(config, samples, world_size, ranks, num_workers, state_path,
                   None if isinstance(config, MixtureConfig) else [source], block_rows)
    fetched = [fetch(plan, jobs=jobs, progress=progress) for plan in plans]
    planned = sum(len(p.blocks) for p in plans)
    not_cached, why = 0, None
    for plan, (_, nbytes, _) in zip(plans, fetched):
        store = plan.cached.store
        missed = sum(not store.contains(*b) for b in plan.blocks)   # written, and still there (not evicted)
        not_cached += missed
        if missed:
            why = why or store.last_failure
            if why is None and nbytes > store.size_limit_bytes:
                why = (f"evicted: the plan is larger than data.cache_size_limit_gb "
                       f"({store.size_limit_bytes / 2**30:g} GB)")
    if len(plans) == 1:
        stats = plans[0].cached.stats()
    else:
        stats = MixtureSources([p.cached for p in plans], config.labels).stats()
    return WarmupResult(planned_blocks=planned, already_cached=planned - sum(len(p.missing) for p in plans),
                        fetched_blocks=sum(f[0] for f in fetched), fetched_bytes=sum(f[1] for f in fetched),
                        read_through_blocks=sum(p.read_through_blocks for p in plans),
                        plan_seconds=max(p.seconds for p in plans), fetch_seconds=sum(f[2] for f in fetched),
                        stats=stats, not_cached=not_cached, why=why if not_cached else None)
