"""Plan-driven prefetch: fetch and decode the row groups a partition will open next, ahead of time.

The plan says which shards a partition opens next, in order; the partition reader hints them here and
the source starts fetching them on a small thread pool (ranged reads run concurrently, decoding to Arrow
happens off the consumer's thread). A shard's table is handed over only when the reader opens that
shard, so rows and their order are the plan's, never arrival order. At most ``depth`` tables are fetched
or held per partition read by the process (the memory bound: ``depth`` decoded row groups each). A failed fetch is simply dropped:
the reader then fetches the shard itself under the usual retries.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa


def _shutdown(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


def _call(fetch: weakref.WeakMethod, shard: int) -> pa.Table:
    """Run a fetch whose owner may be gone (a queued fetch must not keep a dropped source alive)."""
    method = fetch()
    if method is None:
        raise RuntimeError("the source was closed")
    return method(shard)


class Prefetcher:
    """Futures of the next shards' tables, at most ``depth`` per partition (picklable: workers start empty)."""

    def __init__(self, fetch: Callable[[int], pa.Table], depth: int, threads: int | None = None):
        # held weakly: the source owns this prefetcher, and its threads must not keep the source alive
        self._fetch, self.depth = weakref.WeakMethod(fetch), depth
        self._threads = threads or max(1, min(depth, 8))
        self._reset()

    def _reset(self) -> None:
        self._pending: OrderedDict[int, tuple[int, Future]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"fetch": self._fetch(), "depth": self.depth, "threads": self._threads}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fetch"], state["depth"], state["threads"])

    def _ready(self) -> None:
        if self._pid != os.getpid():          # a forked DataLoader worker: the parent's threads are not here
            self._reset()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="rs-prefetch")
            weakref.finalize(self, _shutdown, self._pool)

    def hint(self, owner: int, shards: list[int]) -> None:
        """``owner`` (a partition) opens ``shards`` next, in this order: fetch the first ``depth`` of them;
        its earlier hints that are no longer among them are cancelled (a new epoch, a loaded cursor)."""
        if self.depth <= 0:
            return
        ahead = list(dict.fromkeys(shards))[: self.depth]
        with self._lock:
            self._ready()
            for shard, (who, fut) in list(self._pending.items()):
                if who == owner and shard not in ahead:
                    fut.cancel()
                    del self._pending[shard]
            for shard in ahead:
                if shard not in self._pending:
                    self._pending[shard] = (owner, self._pool.submit(_call, self._fetch, shard))

    def take(self, shard: int) -> Future | None:
        """The fetch of ``shard`` if one was started (it is handed over once)."""
        with self._lock:
            if self._pid != os.getpid():
                self._reset()
            entry = self._pending.pop(shard, None)
            return entry[1] if entry is not None else None

    def drop(self) -> None:
        """Forget every pending fetch (a new epoch / a loaded cursor: the hinted plan is no longer ahead)."""
        with self._lock:
            for _, fut in self._pending.values():
                fut.cancel()
            self._pending.clear()

    def close(self) -> None:
        """Cancel what has not started and wait for the fetches running (each bounded by data.timeout_s), so
        that no thread of ours is still reading or decoding when the interpreter shuts down."""
        self.drop()
        with self._lock:
            pool, self._pool = (self._pool if self._pid == os.getpid() else None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
