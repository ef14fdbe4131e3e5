"""Data-path counters (requests, bytes, response-time buckets, retries, row groups, prefetch, request budget):
one integer set per rank in shared memory, recorded at most once per request or row group, never per sample;
:func:`delta` and :func:`figures` turn two readings into the figures of the steps in between (docs/training.md)."""

from __future__ import annotations

import bisect
import contextlib
import math
import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

# why a request or a read was tried again (RetryPolicy.failed, read_checked, the HTTP request retries)
RETRY_CAUSES = ("timeout", "connection", "http_429", "http_5xx", "http_other", "short_read", "wrong_bytes",
                "other")
RESPONSE_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)
_BOUNDS = (*RESPONSE_BUCKETS_MS, math.inf)
_BUCKET_NAMES = (*(f"response_le_{b}" for b in RESPONSE_BUCKETS_MS), "response_le_inf")
_SOURCE = ("requests", "request_errors", "bytes_read", "response_us", "row_groups", "rows_decoded",
           "prefetch_takes", "prefetch_depth_sum", "prefetch_waits", "retries",
           # the request budget (io/budget.py): requests that waited for their turn, and how long; rate-limit
           # answers (429, 503 SlowDown), and how long requests waited for the reset they named; row groups
           # fetched in a request another row group of the same file opened (coalesced)
           "budget_waits", "budget_wait_us", "rate_limited", "rate_limit_wait_us", "coalesced")
SOURCE_COUNTERS = (*_SOURCE, *(f"retry_{c}" for c in RETRY_CAUSES), *_BUCKET_NAMES)


class SharedCounters:
    """Integer counters in shared memory (a ``RawArray``: nothing to clean up, whatever ends the process).

    The lock has no name: a named one is registered with the resource tracker, which reports a SIGKILLed
    process's as "leaked". Spawned workers cannot open an unnamed lock, so the first gets a named one and this
    process then takes both (forked and spawned workers alive at once in one rank could lose an addition)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._index = {name: i for i, name in enumerate(names)}
        self._spawn_lock = None
        try:
            self._arr = multiprocessing.RawArray("q", len(names))
            self._fork_lock = multiprocessing.get_context("fork").Lock()
        except (OSError, ImportError, ValueError):     # no shared memory (or no fork): this process only
            self._arr, self._fork_lock = [0] * len(names), None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # the process-shared locks, always in this order; a private list of counters: this process's lock
        locks = [lock for lock in (self._fork_lock, self._spawn_lock) if lock is not None] or [self._lock]
        for lock in locks:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(locks):
                lock.release()

    def add(self, **deltas: int) -> None:
        with self._locked():
            for name, d in deltas.items():
                self._arr[self._index[name]] += d

    def snapshot(self) -> dict[str, int]:
        with self._locked():
            values = self._arr[:]
        return dict(zip(self.names, values))

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        if not isinstance(self._arr, list) and get_spawning_popen() is not None:   # to a worker being started
            with self._lock:
                if self._spawn_lock is None:
                    self._spawn_lock = multiprocessing.get_context("spawn").Lock()
            return {"names": self.names, "arr": self._arr, "lock": self._spawn_lock}
        # pickled for anything else (a copy of the stream): start a private set of counters
        return {"names": self.names, "arr": None, "lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.names = state["names"]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._arr, self._fork_lock, self._spawn_lock = state["arr"], None, state["lock"]
        if self._arr is None:
            self._arr = [0] * len(self.names)
        self._lock = threading.Lock()


_counters: SharedCounters | None = None
_counters_lock = threading.Lock()


def source_counters() -> SharedCounters:
    """This rank's data-path counters (made on first use; a DataLoader worker has its parent's)."""
    global _counters
    if _counters is None:
        with _counters_lock:
            if _counters is None:
                _counters = SharedCounters(SOURCE_COUNTERS)
    return _counters


def adopt(counters: SharedCounters | None) -> None:
    """Record into ``counters`` from now on: a spawned DataLoader worker takes its parent's."""
    global _counters
    if counters is not None:
        _counters = counters


def _bucket(ms: float) -> str:
    return _BUCKET_NAMES[bisect.bisect_left(RESPONSE_BUCKETS_MS, ms)]    # the first bound >= ms


def record_request(seconds: float, nbytes: int, ok: bool = True) -> None:
    """One request to a remote store answered (``ok``) or failed after ``seconds``."""
    ms = seconds * 1000.0
    source_counters().add(requests=1, request_errors=int(not ok), bytes_read=nbytes if ok else 0,
                          response_us=int(ms * 1000), **{_bucket(ms): 1})


def record_retry(cause: str) -> None:
    """A request or a read is tried again, because of ``cause`` (one of RETRY_CAUSES)."""
    source_counters().add(retries=1, **{f"retry_{cause if cause in RETRY_CAUSES else 'other'}": 1})


def record_budget_wait(paced_s: float, paused_s: float) -> None:
    """A request waited ``paced_s`` for its turn under the request budget and ``paused_s`` for a store's reset."""
    source_counters().add(budget_waits=int(paced_s > 0), budget_wait_us=int(paced_s * 1e6),
                          rate_limit_wait_us=int(paused_s * 1e6))


def record_rate_limited() -> None:
    """A store answered that we ask too often (HTTP 429, an S3 503 SlowDown)."""
    source_counters().add(rate_limited=1)


def record_coalesced(row_groups: int) -> None:
    """``row_groups`` row groups came in the request of another row group of their file."""
    source_counters().add(coalesced=row_groups)


def record_row_group(rows: int) -> None:
    source_counters().add(row_groups=1, rows_decoded=rows)


def record_prefetch_take(depth: int, waited: bool) -> None:
    """A row group handed over by the prefetcher, whose depth for that partition was ``depth``."""
    source_counters().add(prefetch_takes=1, prefetch_depth_sum=depth, prefetch_waits=int(waited))


def retry_cause(e: BaseException | None) -> str:
    """Which of RETRY_CAUSES ``e`` (or its chain) is: a timeout, a connection error, an HTTP status, ..."""
    import asyncio

    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return "timeout"
        if "Payload" in type(e).__name__ or "ContentLength" in type(e).__name__:
            return "short_read"       # aiohttp: the body ended before its Content-Length
        status = getattr(e, "status", None)
        response = getattr(e, "response", None)
        if status is None and isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int) and 100 <= status < 600:
            return "http_429" if status == 429 else "http_5xx" if status >= 500 else "http_other"
        if isinstance(e, ConnectionError) or "Connect" in type(e).__name__ or "Disconnect" in type(e).__name__:
            return "connection"
        if isinstance(e, OSError) and "short read" in str(e):
            return "short_read"
        e, seen = e.__cause__ or e.__context__, seen + 1
    return "other"


def snapshot() -> dict[str, int]:
    """The rank's data-path counters now (since the process started)."""
    return source_counters().snapshot()


def percentile_ms(buckets: dict[str, float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of the response times counted in ``buckets`` (``response_le_*`` deltas),
    interpolated inside its bucket; None without any."""
    return _quantiles([max(0, buckets.get(name, 0)) for name in _BUCKET_NAMES], (q,))[0]


def _quantiles(counts: list[float], qs: tuple[float, ...]) -> list[float | None]:
    total = sum(counts)
    if total == 0:
        return [None] * len(qs)
    out = []
    for q in qs:
        rank, seen, low, value = q * total, 0, 0.0, float(RESPONSE_BUCKETS_MS[-1])
        for bound, n in zip(_BOUNDS, counts):
            if n and seen + n >= rank:
                high = bound if bound != math.inf else low * 2 or 1.0
                value = round(low + (high - low) * max(0.0, rank - seen) / n, 3)
                break
            seen += n
            low = bound
        out.append(value)
    return out


class LoaderCounters:
    """What the training loop saw of one loader, in the main process: batches, the seconds it waited for
    them, samples and tokens; of a mixture, samples and tokens per source too (``observe.mixture_counts``)."""

    def __init__(self):
        self.batches = 0
        self.wait_s = 0.0
        self.samples = 0
        self.tokens = 0
        self.source_samples: tuple[int, ...] = ()     # per source of a mixture (empty: none counted yet)
        self.source_tokens: tuple[int, ...] = ()

    def batch(self, waited_s: float, samples: int, tokens: int, source_samples: list[int] | None = None,
              source_tokens: list[int] | None = None) -> None:
        self.batches += 1
        self.wait_s += waited_s
        self.samples += samples
        self.tokens += tokens
        # new tuples, never changed in place: another thread (a Prometheus scrape) reads them whole
        if source_samples is not None:
            self.source_samples = _added(self.source_samples, source_samples)
        if source_tokens is not None:
            self.source_tokens = _added(self.source_tokens, source_tokens)

    def per_source(self) -> dict[str, tuple[int, ...]]:
        """``{"samples": per source, "tokens": per source}`` since this loader was made (empty before a
        mixture's first batch)."""
        return {"samples": self.source_samples, "tokens": self.source_tokens}

    def snapshot(self) -> dict[str, float]:
        return {"batches": self.batches, "wait_s": self.wait_s, "samples": self.samples, "tokens": self.tokens}


def _added(total: tuple[int, ...], more: list[int]) -> tuple[int, ...]:
    return tuple(more) if not total else tuple(a + int(b) for a, b in zip(total, more))


LOADER_FIELDS = ("loader_batches", "loader_wait_s", "loader_samples", "loader_tokens")
CACHE_FIELDS = ("cache_hits", "cache_misses", "cache_bytes_read")
# the fields of a reading, in a fixed order: every rank's reading gathers into one tensor
READING_FIELDS = ("time", *SOURCE_COUNTERS, *LOADER_FIELDS, *CACHE_FIELDS)


def cache_stats(source: Any) -> dict | None:
    """A source's block cache counters (``CachedSource.stats()``); None without a cache, or when they cannot be
    read now (a metrics reading must never break training)."""
    try:
        return source.stats()      # Source.stats: None when not behind a cache
    except Exception:
        return None


def reading(loader_counters: LoaderCounters | None = None, cache: dict | None = None) -> dict[str, float]:
    """One reading of everything :func:`figures` reports: the time, the data-path counters, the loader's and
    the block cache's (``CachedSource.stats()``)."""
    out: dict[str, float] = dict.fromkeys(READING_FIELDS, 0)
    out["time"] = time.monotonic()
    out.update(snapshot())
    if loader_counters is not None:
        out.update({f"loader_{k}": v for k, v in loader_counters.snapshot().items()})
    if cache:
        out.update(cache_hits=cache.get("hits", 0), cache_misses=cache.get("misses", 0),
                   cache_bytes_read=cache.get("bytes_read", 0))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What happened between two readings of one rank (``time``: the seconds in between)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in READING_FIELDS}


def figures(d: dict[str, float]) -> dict[str, Any]:
    """The figures of one interval (a :func:`delta`, or several ranks' summed)."""
    seconds = max(1e-9, d["time"])
    requests = int(d["requests"])
    p50, p90, p99 = _quantiles([max(0, d[name]) for name in _BUCKET_NAMES], (0.5, 0.9, 0.99))
    takes = d["prefetch_takes"]
    hits, misses = int(d["cache_hits"]), int(d["cache_misses"])
    return {
        "step_s": round(seconds, 6),
        "wait_s": round(d["loader_wait_s"], 6),
        "wait_share": round(min(1.0, max(0.0, d["loader_wait_s"] / seconds)), 6),
        "batches": int(d["loader_batches"]),
        "samples_per_s": round(d["loader_samples"] / seconds, 3),
        "tokens_per_s": round(d["loader_tokens"] / seconds, 3),
        "requests": requests,
        "request_errors": int(d["request_errors"]),
        "bytes_read": int(d["bytes_read"]),
        "retries": int(d["retries"]),
        "rate_limited": int(d["rate_limited"]),
        "rate_limit_wait_s": round(d["rate_limit_wait_us"] / 1e6, 6),
        "budget_waits": int(d["budget_waits"]),
        "budget_wait_s": round(d["budget_wait_us"] / 1e6, 6),
        "coalesced_row_groups": int(d["coalesced"]),
        "retry_causes": {c: int(d[f"retry_{c}"]) for c in RETRY_CAUSES if d[f"retry_{c}"]},
        "response_ms_mean": round(d["response_us"] / 1000 / requests, 3) if requests else None,
        "response_ms_p50": p50, "response_ms_p90": p90, "response_ms_p99": p99,
        "row_groups": int(d["row_groups"]),
        "rows_decoded": int(d["rows_decoded"]),
        "prefetch_depth": round(d["prefetch_depth_sum"] / takes, 3) if takes else None,
        "cache_hits": hits, "cache_misses": misses,
        "cache_hit_rate": round(hits / (hits + misses), 6) if hits + misses else None,
        "cache_bytes_read": int(d["cache_bytes_read"]),
    }


def combined(deltas: list[dict[str, float]], per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The figures of several ranks' intervals together: counts and rates summed, response times from the
    merged histogram, the interval the longest of theirs, the wait (and its share) the worst rank's: a
    step waits for its slowest rank. ``per_rank``: their :func:`figures`, when already made."""
    if not deltas:
        return {}
    if len(deltas) == 1:
        return dict(per_rank[0]) if per_rank else figures(deltas[0])
    per_rank = per_rank or [figures(d) for d in deltas]
    total = {k: sum(d[k] for d in deltas) for k in READING_FIELDS}
    total["time"] = max(d["time"] for d in deltas)
    out = figures(total)
    # rates: each rank's own, summed (their intervals differ by the time the gathering took)
    for name in ("samples_per_s", "tokens_per_s"):
        out[name] = round(sum(f[name] for f in per_rank), 3)
    worst = max(per_rank, key=lambda f: f["wait_share"])
    out["wait_s"], out["wait_share"] = worst["wait_s"], worst["wait_share"]
    return out
