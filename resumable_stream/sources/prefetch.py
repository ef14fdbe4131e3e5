"""Plan-driven prefetch: fetch and decode the row groups a partition will open next, ahead of time.

The plan says which shards a partition opens next, in order; the partition reader hints them here and
the source starts fetching them on a small thread pool (ranged reads run concurrently, decoding to Arrow
happens off the consumer's thread). A shard's table is handed over only when the reader opens that
shard, so rows and their order are the plan's, never arrival order. A failed fetch is simply dropped:
the reader then fetches the shard itself under the usual retries.

**How far ahead** (the depth) adapts, per partition, to what is measured (Little's law): a fetch takes
``fetch_s`` (request latency + transfer + decoding, an average over the last fetches) and the consumer
spends ``busy_s`` per row group when it does not wait for one (the interval between two hand-overs less
the time it waited); keeping ``ceil(fetch_s / busy_s)`` fetches ahead then hides the latency. Higher
latency or smaller row groups: deeper. Each hand-over starts the next fetch of the hinted plan at once
(the pipeline stays full between two windows). Before anything was measured the depth is
``FIRST_DEPTH`` until the partition's reader takes its first row group (the first window's requests go out
alone: its first sample waits for its own row groups, not for a burst of others), then ``INITIAL_DEPTH``. A
source of large shards gives ``first_depth`` instead (JSON lines: ``interleave_shards``, the pieces of 16 MiB a
window opens): that many fetches in all, the one the reader waits on included, until that one has arrived, so
the first window's pieces share the link with nobody else's and the next ones go out with its first sample.
``cap`` bounds the depth (``data.prefetch_blocks``). ``fetch_s`` is the fetch's requests' time (its decoding is
CPU the consumer shares), or with ``whole_call`` its whole call: a local JSON-lines piece reads in ~2 ms and inflates
for ~50-100 ms on the fetch thread, and timed by its read the depth fell to 1 and the reader waited on each inflate.

``busy_s`` is measured per window, not per hand-over: a partition hints its plan each time it builds a
window, so the time between two hints (less the waits) over the row groups taken in between is one sample,
and ``busy_s`` is the mean of the last ``_WINDOWS`` samples, each at most ``_OUTLIER`` times their median.
A window takes its row groups in a burst and then consumes them, so single hand-over intervals are bursty;
and a pause of the consumer (a garbage collection, an evaluation, a checkpoint save) is one outlying window
that counts as a slow one, where a running mean of the intervals took its whole length for consumer time
and cut the depth, leaving the consumer to wait on every fetch for the next few dozen row groups.

**Memory** is bounded by ``budget`` bytes (``data.prefetch_memory_mb``) for the whole process: a fetch
starts only when its reservation (its compressed bytes, plus their decoded size: what the source says where
it knows it, ``decoded(shard)``, a JSON-lines piece's text; else at the largest ratio seen so far,
``INITIAL_RATIO`` before the first decode) fits beside what is already in flight or held; a
decoded table then counts its real ``nbytes`` until the reader takes it. A table that turns out larger
than its reservation and would overflow the budget is dropped (the reader fetches it itself), so what the
prefetcher holds never exceeds the budget (``stats()["peak_bytes"]``). A row group that alone exceeds
the budget is not fetched ahead. ``stats()["held_for_memory"]``: the hinted shards that waited for room. A
source that holds bytes ahead on its own (a JSON-lines shard's next pieces, sources/jsonl.py) counts them with
``reserve`` / ``release`` in the same budget, and does without them when they do not fit (``stats()["declined"]``).

**The request budget** (``data.max_requests_per_s``, io/budget.py) paces every request of the process; the
prefetcher need not run further ahead than that pace can serve. With ``rate`` (requests per second this
process may send, None: unlimited) the depth of each of its partitions is at most its part of
``ceil(rate x fetch_s) + 1``: the requests the pace keeps on the network, and one waiting for its turn. More
would only queue threads and memory behind the bucket.

**Coalescing.** Where requests are counted (the process's requests are paced: ``rate()`` is a number), with
``run`` (a source that can fetch several row groups of one file in one ranged request) and ``adjacent`` (the
shards of the row groups just before and after a shard's in its file, when their bytes touch), a fetch takes
along the row groups next to its own that partitions of this process hinted, as far as their caps allow: one
request, each row group still decoded and checked on its own and handed over when its partition opens it
(:meth:`_coalesce`). A failed coalesced fetch fails each of its row groups' fetches (their readers read them on
their own). Unpaced, each row group is a request of its own: it arrives soonest, not after its neighbours'
bytes.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from ..io.ranged import request_seconds
from ..observe.metrics import record_prefetch_take

FIRST_DEPTH = 8             # fetches ahead per partition until the reader takes its first row group: the first
                            # window's own requests go out alone (24 at once cost its first sample ~0.2 s over S3)
INITIAL_DEPTH = 24          # ... then until a fetch and 2 windows were measured: a fast consumer needs ~20 at
                            # 100 ms and 5,000-row row groups, and with 8 it waited through its first ~0.3 s (a
                            # slow one settles lower after 2 windows; the budget bounds it)
DEFAULT_CAP = 64            # the most fetches ahead per partition when data.prefetch_blocks is null
MAX_THREADS = 64            # fetch threads per process (a fetch in flight holds one: it waits on its request)
INITIAL_RATIO = 8.0         # decoded bytes per fetched byte assumed before the first decode
_NET = 32                   # fetches whose network time the depth is taken from
_NET_QUANTILE = 0.25        # ... which of them: a low one, the link's latency rather than its queueing (the
                            # requests a deeper prefetch adds slow down a busy server: that must not deepen it)
_WINDOWS = 9                # windows whose consumer time per row group busy_s averages (outliers clipped)
WARMUP = 2                  # windows measured before the consumer's rate is trusted
_OUTLIER = 2.0              # a window's consumer time counts at most this many times the median window's
_DEPTHS = 4096              # hand-overs whose depth stats() summarises
ASSUMED_FETCH_S = 0.1       # a fetch's network time before one was measured (for the rate's bound on the depth)
COALESCE_MAX = 16           # row groups in one coalesced request, at most
COALESCE_MAX_BYTES = 32 << 20   # ... and their bytes (a larger row group is fetched alone)


class Dropped(Exception):
    """A fetch ahead that was given up (over the budget, or no longer ahead): the reader reads the shard."""


def _weak(fn):
    """A bound method held weakly (the source owns the prefetcher); anything else as it is."""
    return weakref.WeakMethod(fn) if fn is not None and hasattr(fn, "__self__") else fn


def _strong(held):
    return held() if isinstance(held, weakref.WeakMethod) else held


def _run(owner: weakref.ref, shard: int, entry: _Entry) -> None:
    """A queued fetch holds its prefetcher (and so the source) weakly: a dropped source is not kept alive."""
    if not entry.future.set_running_or_notify_cancel():
        return
    me = owner()
    if me is None:
        entry.future.set_exception(RuntimeError("the source was closed"))
        return
    me.run_fetch(shard, entry)


def _run_many(owner: weakref.ref, shards: list[int], entries: list[_Entry]) -> None:
    """A coalesced fetch: the row groups of ``shards`` in one request (see the module docstring)."""
    if not entries[0].future.set_running_or_notify_cancel():
        for entry in entries[1:]:
            entry.future.cancel()
        return
    for entry in entries[1:]:
        entry.future.set_running_or_notify_cancel()
    me = owner()
    if me is None:
        for entry in entries:
            entry.future.set_exception(RuntimeError("the source was closed"))
        return
    me.run_fetches(shards, entries)


def _shutdown(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Entry:
    owner: int
    future: Future
    reserved: int               # bytes counted against the budget for this fetch (its real size once decoded)
    done_at: float | None = None
    state: str = "pending"      # "taken" by the reader (its bytes are the reader's now), or "dropped"


@dataclass
class _Owner:
    """One partition's hinted plan and its consumption measurements (see the module docstring)."""

    queue: list[int] = field(default_factory=list)     # hinted shards not yet started, in plan order
    window_start: float | None = None                  # when the window being measured was hinted
    window_takes: int = 0                              # row groups taken in it so far
    window_wait: float = 0.0                           # seconds the reader waited for them
    window_clean: bool = True                          # False: the reader read a shard itself (network time)
    samples: deque = field(default_factory=lambda: deque(maxlen=_WINDOWS))   # seconds per row group
    started: int = 0                                   # fetches of its started
    fetched: bool = False                              # a fetch of its finished
    received: bool = False                             # a fetch its reader took has arrived (its first sample's)

    def new_window(self, now: float) -> None:
        """A window was hinted: the one before it is a sample, if a row group was taken in it."""
        if self.window_start is not None and self.window_takes == 0:
            return                                     # nothing taken yet: the sample spans the next one too
        if self.window_start is not None and self.window_clean:
            busy = max(0.0, now - self.window_start - self.window_wait)
            self.samples.append(busy / self.window_takes)
        self.window_start, self.window_takes, self.window_wait, self.window_clean = now, 0, 0.0, True

    @property
    def busy_s(self) -> float | None:
        """Consumer time per row group: the mean over the last ``_WINDOWS`` windows, each at most ``_OUTLIER``
        times their median (the rate is an average, Little's law wants the mean; a pause is one window far
        above the median and counts as a slow window, not as its length), None until ``WARMUP`` windows were
        measured."""
        if len(self.samples) < WARMUP:
            return None
        ordered = sorted(self.samples)
        ceiling = _OUTLIER * ordered[(len(ordered) - 1) // 2]
        return sum(min(x, ceiling) for x in ordered) / len(ordered)


class Prefetcher:
    """Futures of the next shards' tables (picklable: a DataLoader worker's copy starts empty).

    ``fetch(shard)`` makes the table; ``size(shard)`` says how many bytes the fetch transfers (the row
    group's byte span; None: unknown, then only ``cap`` bounds it)."""

    def __init__(self, fetch: Callable[[int], pa.Table], cap: int | None = None, budget: int | None = None,
                 size: Callable[[int], int | None] | None = None, threads: int | None = None,
                 first_alone: bool = False, rate: Callable[[], float | None] | None = None,
                 run: Callable[[list[int]], list[pa.Table]] | None = None,
                 adjacent: Callable[[int], tuple[int | None, int | None]] | None = None,
                 decoded: Callable[[int], int | None] | None = None, first_depth: int | None = None,
                 whole_call: bool = False):
        # held weakly: the source owns this prefetcher, and its threads must not keep the source alive
        self._fetch = weakref.WeakMethod(fetch)
        self._size = _weak(size)
        self._rate = _weak(rate)          # requests per second this process may send (io/budget.py)
        self._run = _weak(run)            # several row groups of one file in one request ...
        self._adjacent = _weak(adjacent)  # ... the row groups next to a shard's
        self._decoded = _weak(decoded)    # what a fetch holds once decoded, where the source knows it
        self.cap = DEFAULT_CAP if cap is None else int(cap)
        self.budget = budget
        self._threads = threads or max(1, min(self.cap, MAX_THREADS))
        # local files: a partition's first fetch runs alone until it is done (decoding is CPU: the row groups
        # fetched beside it would share the cores its first sample waits for)
        self.first_alone = first_alone
        # fetches per partition until the first its reader took has arrived, that one included (None: FIRST_DEPTH
        # ahead until the reader takes one): a source of large shards (JSON-lines pieces of 16 MiB) gives the
        # shards a window opens, so that its first window's requests do not share the link with the next
        # windows' before its first sample
        self.first_depth = first_depth
        # a fetch's time is its whole call, decoding included, not only its requests: a source whose fetch decodes
        # off the consumer's thread on a core the consumer does not use (a compressed JSON-lines piece inflates for
        # ~50-100 ms, its local read takes ~2 ms: timed by its read, the depth stayed at 1-2 and the reader waited)
        self.whole_call = whole_call
        self._reset()

    def _reset(self) -> None:
        self._pending: OrderedDict[int, _Entry] = OrderedDict()
        self._owners: dict[int, _Owner] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fetch_s: float | None = None        # one fetch's requests (a low quantile of the last _NET fetches)
        self._net: list[float] = []
        self._depths: list[int] = []              # the depth at the last _DEPTHS hand-overs
        self._ratio: float | None = None          # largest decoded / fetched bytes seen
        self._bytes = 0                           # reserved (in flight) + held (decoded, not taken)
        self._counts = {"started": 0, "taken": 0, "wasted": 0, "failed": 0, "over_budget": 0,
                        "peak_bytes": 0, "peak_in_flight": 0,
                        "waited": 0, "wait_s": 0.0, "coalesced": 0, "held_for_memory": 0,
                        "reserved": 0, "declined": 0}
        self._held: set[int] = set()             # hinted shards whose fetch had to wait for the budget
        self._running = 0

    def __getstate__(self) -> dict:
        return {"fetch": self._fetch(), "cap": self.cap, "budget": self.budget, "size": _strong(self._size),
                "threads": self._threads, "first_alone": self.first_alone, "rate": _strong(self._rate),
                "run": _strong(self._run), "adjacent": _strong(self._adjacent), "decoded": _strong(self._decoded),
                "first_depth": self.first_depth, "whole_call": self.whole_call}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fetch"], state["cap"], state["budget"], state["size"], state["threads"],
                      state.get("first_alone", False), state.get("rate"), state.get("run"), state.get("adjacent"),
                      state.get("decoded"), state.get("first_depth"),
                      state.get("whole_call", False))

    @property
    def depth(self) -> int:
        """The most fetches ahead per partition (the cap; ``depth_for`` says what is used now)."""
        return self.cap

    def _here(self) -> threading.Lock:
        """This process's lock: a forked DataLoader worker starts afresh first. Its copy of the parent's lock
        may have been taken by one of the parent's fetch threads at the fork, and no thread here would ever
        release it."""
        if self._pid != os.getpid():
            self._reset()
        return self._lock

    def _ready(self) -> None:
        if self._pid != os.getpid():          # a forked DataLoader worker: the parent's threads are not here
            self._reset()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="rs-prefetch")
            weakref.finalize(self, _shutdown, self._pool)

    # ------------------------------------------------------------------ the depth
    def depth_for(self, owner: int) -> int:
        """Fetches to keep ahead for ``owner`` now: enough to cover one fetch's time at its consumption
        rate (Little's law), at most the cap."""
        if self.cap <= 0:
            return 0
        state = self._owners.get(owner)
        busy = state.busy_s if state is not None else None
        if self._fetch_s is None or busy is None:
            if self.first_depth is None:       # a row group taken
                started = state is not None and (state.window_takes > 0 or len(state.samples) > 0)
                first = FIRST_DEPTH
            else:                              # the first taken one arrived (the reader takes at once, then waits)
                started = state is not None and (state.received or len(state.samples) > 0)
                # in flight in all, the one the reader waits on included
                first = max(1, self.first_depth - (state.window_takes if state is not None else 0))
            return min(self.cap, INITIAL_DEPTH if started else first, self._paced_depth())
        # no fetch more for jitter: rounding up leaves up to one consumer interval spare, and each fetch ahead
        # beyond what the rate needs is a request in flight that buys no rows (+ 1 cost ~5% of the rate's share
        # of depth x rows / latency at 100 ms, and no measurable rate)
        need = math.ceil(self._fetch_s / max(busy, 1e-4))
        return max(1, min(self.cap, need, self._paced_depth()))

    def _paced_depth(self) -> int:
        """The most fetches ahead per partition the request budget can serve (see the module docstring): a
        partition's part of ``ceil(rate x fetch_s) + 1``; the cap when the process's requests are not paced."""
        rate_of = _strong(self._rate)
        rate = rate_of() if rate_of is not None else None
        if rate is None:
            return self.cap
        fetch_s = self._fetch_s if self._fetch_s is not None else ASSUMED_FETCH_S
        owners = max(1, sum(1 for state in self._owners.values() if state.queue or state.started))
        return max(1, math.ceil((math.ceil(rate * fetch_s) + 1) / owners))

    def _reservation(self, shard: int) -> int:
        size = _strong(self._size)
        n = size(shard) if size is not None else None
        if n is None:
            return 0
        known = _strong(self._decoded)
        d = known(shard) if known is not None else None
        if d is not None:       # the source knows it (a JSON-lines piece's text): no ratio guessed
            return n + d
        return int(n * (1.0 + (self._ratio if self._ratio is not None else INITIAL_RATIO)))

    # ------------------------------------------------------------------ hints and hand-overs
    def hint(self, owner: int, shards: list[int]) -> None:
        """``owner`` (a partition) opens ``shards`` next, in this order: fetch the first of them ahead; its
        earlier hints that are no longer among them are cancelled (a new epoch, a loaded cursor)."""
        if self.cap <= 0:
            return
        order = list(dict.fromkeys(shards))
        with self._here():
            self._ready()
            state = self._owners.setdefault(owner, _Owner())
            state.new_window(time.monotonic())
            wanted = set(order)
            for shard, entry in list(self._pending.items()):
                if entry.owner == owner and shard not in wanted:
                    self._forget(shard, entry, wasted=True)
            state.queue = [s for s in order if s not in self._pending]
            self._top_up()

    def _top_up(self) -> None:
        """Start the next hinted fetches of every partition while its depth and the budget allow (lock held)."""
        mine: dict[int, int] = {}
        for entry in self._pending.values():
            mine[entry.owner] = mine.get(entry.owner, 0) + 1
        progress = True
        while progress:                        # round robin over the partitions: one fetch each per turn
            progress = False
            for owner, state in self._owners.items():
                if not state.queue or mine.get(owner, 0) >= self.depth_for(owner):
                    continue
                if self.first_alone and state.started and not state.fetched:
                    continue                   # its first fetch runs alone (taken or not)
                shard = state.queue[0]
                if shard in self._pending:     # hinted by another partition too (it takes it first)
                    state.queue.pop(0)
                    progress = True
                    continue
                reserved = self._reservation(shard)
                if self.budget is not None and (reserved > self.budget or self._bytes + reserved > self.budget):
                    if reserved > self.budget:     # never fits: the reader fetches this one itself
                        state.queue.pop(0)
                        progress = True
                    elif shard not in self._held:
                        self._held.add(shard)
                        self._counts["held_for_memory"] += 1
                    continue
                state.queue.pop(0)
                run = self._coalesce(shard, owner, reserved, mine)
                entries = []
                for other, other_owner, other_reserved in run:
                    entry = _Entry(other_owner, Future(), other_reserved)
                    entries.append(entry)
                    self._pending[other] = entry
                    self._bytes += other_reserved
                    self._counts["started"] += 1
                    self._owners[other_owner].started += 1
                    mine[other_owner] = mine.get(other_owner, 0) + 1
                self._counts["peak_bytes"] = max(self._counts["peak_bytes"], self._bytes)
                if len(run) == 1:
                    self._pool.submit(_run, weakref.ref(self), shard, entries[0])
                else:
                    self._counts["coalesced"] += len(run) - 1
                    self._pool.submit(_run_many, weakref.ref(self), [r[0] for r in run], entries)
                progress = True

    def _coalesce(self, shard: int, owner: int, reserved: int, mine: dict[int, int]) -> list[tuple[int, int, int]]:
        """``shard`` (``owner``'s, off its queue already) and the row groups next to it in its file that partitions
        of this process hinted, as far as their caps and the memory budget allow, in file order: ``(shard,
        partition, reservation)`` each; those taken along leave their queues (lock held; ``mine``: each
        partition's fetches pending)."""
        run = [(shard, owner, reserved)]
        adjacent, size, rate = _strong(self._adjacent), _strong(self._size), _strong(self._rate)
        if _strong(self._run) is None or adjacent is None or size is None or rate is None or rate() is None:
            return run                               # requests are not counted: each row group alone, soonest
        # a row group a partition hinted rides along while that partition stays within its cap (data.prefetch_blocks:
        # the most row groups ahead), even past the depth it keeps in flight: it costs no request, only memory
        # (and that within the budget)
        room = {o: self.cap - mine.get(o, 0) - (o == owner) for o in self._owners}
        wanted = {s: o for o, st in self._owners.items() for s in st.queue[:max(0, room[o])]
                  if s not in self._pending}
        total = size(shard)
        left = None if self.budget is None else self.budget - self._bytes - reserved
        for direction in (1, 0):                     # the row groups after it, then those before it
            cur = shard
            while len(run) < COALESCE_MAX and total is not None:
                nxt = adjacent(cur)[direction]
                o = wanted.pop(nxt, None) if nxt is not None else None
                if o is None or room[o] <= 0:
                    break
                n, r = size(nxt), self._reservation(nxt)
                if n is None or total + n > COALESCE_MAX_BYTES or (left is not None and r > left):
                    break
                total += n
                left = None if left is None else left - r
                room[o] -= 1
                self._owners[o].queue.remove(nxt)
                run.insert(len(run) if direction == 1 else 0, (nxt, o, r))
                cur = nxt
        return run

    def run_fetch(self, shard: int, entry: _Entry) -> None:
        """One fetch, on a pool thread (see ``_run``): the table, or the error the reader then meets."""
        method = self._fetch()
        if method is None:
            with self._lock:
                self._release(shard, entry)
            entry.future.set_exception(RuntimeError("the source was closed"))
            return
        with self._lock:
            self._running += 1
            self._counts["peak_in_flight"] = max(self._counts["peak_in_flight"], self._running)
        t0, net0 = time.monotonic(), request_seconds()
        try:
            table = method(shard)
        except BaseException as e:              # handed to the reader, which reads the shard itself
            self._finished(shard, entry, None, t0, 0.0)
            entry.future.set_exception(e)
            return
        del method
        net = request_seconds() - net0
        if self._finished(shard, entry, table, t0, net):
            entry.future.set_result(table)
        else:
            entry.future.set_exception(Dropped(f"the fetch ahead of shard {shard} was dropped"))

    def run_fetches(self, shards: list[int], entries: list[_Entry]) -> None:
        """A coalesced fetch, on a pool thread (see ``_run_many``): each row group's table, or the error their
        readers then meet."""
        method = _strong(self._run)
        if method is None:
            with self._lock:
                for shard, entry in zip(shards, entries):
                    self._release(shard, entry)
            for entry in entries:
                entry.future.set_exception(RuntimeError("the source was closed"))
            return
        with self._lock:
            self._running += len(entries)
            self._counts["peak_in_flight"] = max(self._counts["peak_in_flight"], self._running)
        t0, net0 = time.monotonic(), request_seconds()
        try:
            tables = method(shards)
        except BaseException as e:              # handed to the readers, which read their shards themselves
            for shard, entry in zip(shards, entries):
                self._finished(shard, entry, None, t0, 0.0)
                entry.future.set_exception(e)
            return
        del method
        net = request_seconds() - net0
        for shard, entry, table in zip(shards, entries, tables):
            if self._finished(shard, entry, table, t0, net):
                entry.future.set_result(table)
            else:
                entry.future.set_exception(Dropped(f"the fetch ahead of shard {shard} was dropped"))

    def _finished(self, shard: int, entry: _Entry, table: pa.Table | None, t0: float, net: float) -> bool:
        """Account a finished fetch; False when its table does not fit the budget (then it is dropped)."""
        now = time.monotonic()
        with self._lock:
            self._running -= 1
            entry.done_at = now
            owner = self._owners.get(entry.owner)
            if owner is not None and not owner.fetched:
                owner.fetched = True
                if self.first_alone and self._pool is not None:
                    self._top_up()             # the fetches held back behind the first one
            if table is None:
                self._counts["failed"] += 1
                self._release(shard, entry)
                return False
            # its requests' time (decoding is the consumer side's CPU), or its whole call (``whole_call``)
            took = net if net > 0 and not self.whole_call else now - t0
            self._net.append(took)
            del self._net[:-_NET]
            self._fetch_s = sorted(self._net)[int(len(self._net) * _NET_QUANTILE)]
            size = _strong(self._size)
            fetched = size(shard) if size is not None else None
            if fetched:
                ratio = table.nbytes / fetched
                self._ratio = ratio if self._ratio is None else max(self._ratio, ratio)
            if entry.state == "taken":         # the reader waits for it: its bytes are the reader's now
                return True
            if entry.state != "pending":       # cancelled meanwhile: nobody takes it
                return False
            held = table.nbytes
            if self.budget is not None and self._bytes - entry.reserved + held > self.budget:
                self._counts["over_budget"] += 1
                self._release(shard, entry)
                return False
            self._bytes += held - entry.reserved
            entry.reserved = held
            self._counts["peak_bytes"] = max(self._counts["peak_bytes"], self._bytes)
            self._top_up()
            return True

    def _release(self, shard: int, entry: _Entry) -> None:
        if self._pending.get(shard) is entry:
            entry.state = "dropped"
            del self._pending[shard]
            self._bytes -= entry.reserved
            if self._pool is not None:
                self._top_up()

    def _forget(self, shard: int, entry: _Entry, wasted: bool) -> None:
        entry.future.cancel()
        entry.state = "dropped"
        del self._pending[shard]
        self._bytes -= entry.reserved
        if wasted:
            self._counts["wasted"] += 1

    def take(self, shard: int) -> Future | None:
        """The fetch of ``shard`` if one was started (it is handed over once); the next hinted fetch starts."""
        now = time.monotonic()
        with self._here():
            entry = self._pending.pop(shard, None)
            if entry is None:
                for state in self._owners.values():       # read by the reader itself: no longer ahead
                    if shard in state.queue:
                        state.queue.remove(shard)
                        state.window_clean = False        # its own fetch is no consumer time
                return None
            entry.state = "taken"
            self._bytes -= entry.reserved
            self._counts["taken"] += 1
            state = self._owners.get(entry.owner)
            if state is not None:
                state.window_takes += 1
                depth = self.depth_for(entry.owner)
                self._depths.append(depth)
                del self._depths[:-_DEPTHS]
                record_prefetch_take(depth, waited=entry.done_at is None)
                if entry.done_at is None:          # the reader waits for it: that wait is no consumer time
                    self._counts["waited"] += 1
                    entry.future.add_done_callback(lambda _f, s=state, t=now: self._waited(s, t))
                else:
                    state.received = True
            if self._pool is not None:
                self._top_up()
            return entry.future

    def _waited(self, state: _Owner, since: float) -> None:
        wait = max(0.0, time.monotonic() - since)
        state.window_wait += wait
        self._counts["wait_s"] += wait
        if not state.received and self.first_depth is not None:
            with self._lock:                   # (the future's callback: the lock is free)
                state.received = True
                if self._pool is not None:
                    self._top_up()

    # ------------------------------------------------------------------ memory a source holds ahead on its own
    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` a source fetches ahead on its own (a JSON-lines shard's next pieces' compressed bytes)
        against the budget, beside the fetches'; False when they do not fit (the source then does without).
        A True is given back with :meth:`release` once those bytes are the reader's or dropped."""
        with self._here():
            if self.budget is not None and self._bytes + nbytes > self.budget:
                self._counts["declined"] += 1
                return False
            self._bytes += nbytes
            self._counts["reserved"] += 1
            self._counts["peak_bytes"] = max(self._counts["peak_bytes"], self._bytes)
            return True

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` counted; the fetches it held back may start."""
        with self._here():
            self._bytes = max(0, self._bytes - nbytes)
            if self._pool is not None:
                self._top_up()

    def stats(self) -> dict:
        """Measurements and counters: the depth per partition now, the average fetch time, bytes held or in
        flight now and at most so far (never above ``budget``), fetches started / taken / wasted / failed /
        dropped over the budget / taken along in another's request (coalesced), the most fetches running at
        once."""
        with self._here():
            return {"cap": self.cap, "budget": self.budget, "fetch_s": self._fetch_s, "ratio": self._ratio,
                    "depth": {o: self.depth_for(o) for o in self._owners},
                    "depth_median": sorted(self._depths)[len(self._depths) // 2] if self._depths else None,
                    "busy_s": {o: s.busy_s for o, s in self._owners.items()},
                    "bytes": self._bytes, "in_flight": self._running, "pending": len(self._pending),
                    **self._counts}

    def drop(self) -> None:
        """Forget every pending fetch (a new epoch / a loaded cursor: the hinted plan is no longer ahead)."""
        with self._here():
            for shard, entry in list(self._pending.items()):
                self._forget(shard, entry, wasted=False)
            for state in self._owners.values():
                state.queue = []

    def close(self) -> None:
        """Cancel what has not started and wait for the fetches running (each bounded by data.timeout_s), so
        that no thread of ours is still reading or decoding when the interpreter shuts down."""
        self.drop()
        with self._here():
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
