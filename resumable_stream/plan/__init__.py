"""Pure functions that decide the order of data: no I/O, no state, no wall clock.

Every random choice comes from a counter-based generator keyed by integers such as
(seed, epoch, partition, window), so any position can be recomputed from its cursor
without replaying what came before it.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from ..errors import ConfigError
from ..limits import MAX_PARTITIONS

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

# Domain tags keep the seeds of different decisions independent of each other.
TAG_SHARDS = 1
TAG_WINDOW = 2


def derive_seed(*parts: int) -> int:
    """A 64-bit seed from a tuple of non-negative integers (stable across platforms and versions)."""
    packed = struct.pack(f"<{len(parts)}Q", *(p & 0xFFFFFFFFFFFFFFFF for p in parts))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def counter_hashes(seed: int, start: int, count: int) -> np.ndarray:
    """uint64 hashes of counters ``start .. start+count-1`` under ``seed``: a pure function of the three
    (splitmix64 of ``counter * golden + seed``, computed in place: 10M of them in a plan)."""
    z = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z *= _GOLDEN
        z += np.uint64((seed + int(_GOLDEN)) % 2**64)
        for shift, mult in ((30, _M1), (27, _M2)):
            z ^= z >> np.uint64(shift)
            z *= mult
        z ^= z >> np.uint64(31)
    return z


def stable_argsort_u64(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` of uint64 values, 3-4x faster on millions and 1.7x on a window of
    16,384: each value's low bits replaced by its index, one plain (SIMD) sort of the values, then the few runs
    whose remaining high bits tie put in (value, index) order. Below 4,096 values numpy's own is as fast."""
    n = len(values)
    bits = max(1, (n - 1).bit_length())
    if n < 1 << 12 or bits > 40:
        return np.argsort(values, kind="stable").astype(np.int64)
    low = np.uint64((1 << bits) - 1)
    keys = values & ~low
    keys |= np.arange(n, dtype=np.uint64)
    keys.sort()
    high = keys >> np.uint64(bits)
    tie = high[1:] == high[:-1]
    del high
    keys &= low
    order = keys.view(np.int64)
    if tie.any():               # ~n^2 / 2^(65 - bits) ties of the high bits: 57 of 10M hashes
        first = np.flatnonzero(tie)          # i: the high bits of i and i + 1 tie
        at = np.union1d(first, first + 1)
        run = np.cumsum(~np.isin(at - 1, first))   # runs of equal high bits, numbered
        idx = order[at]
        order[at] = idx[np.lexsort((idx, values[idx], run))]
    return order


def permutation(n: int, seed: int) -> np.ndarray:
    """A permutation of range(n) that depends only on (n, seed): sort by a hash of (seed, i)."""
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    return stable_argsort_u64(counter_hashes(seed, 0, n))


def window_permutation(n: int, seed: int, epoch: int, partition: int, window: int) -> np.ndarray:
    return permutation(n, derive_seed(TAG_WINDOW, seed, epoch, partition, window))


def epoch_shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    return permutation(num_shards, derive_seed(TAG_SHARDS, seed, epoch))


def deal_shards(order: np.ndarray, row_counts: list[int | None], num_partitions: int) -> list[list[int]]:
    """Deal shards (in ``order``) to partitions, each to the one with the fewest rows so far; unknown counts count as
    the mean of the known ones (no counts: round-robin)."""
    known = [c for c in row_counts if c is not None]
    fallback = (sum(known) / len(known)) if known else 1.0
    rows = row_counts if len(known) == len(row_counts) else [fallback if c is None else c for c in row_counts]
    heap = [(0.0, p) for p in range(num_partitions)]
    dealt: list[list[int]] = [[] for _ in range(num_partitions)]
    append = [d.append for d in dealt]
    replace = heapq.heapreplace       # pop the least loaded, push it back loaded: (load, partition) is unique
    for shard in order.tolist():
        load, p = heap[0]
        append[p](shard)
        replace(heap, (load + rows[shard], p))
    return dealt


# From this many shards on, deal_array uses the compiled deal when numba is installed (the `scale` extra):
# below it the Python deal takes < 0.2 s, less than numba's import.
COMPILED_DEAL_MIN = 200_000


def deal_array(order: np.ndarray, row_counts, num_partitions: int,
               rows_in_order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``deal_shards`` as one array of the shards, partition after partition, and each partition's bounds in
    it; compiled for large deals of known row counts where numba is installed (the same deal, ~50x faster).
    ``rows_in_order``: ``row_counts.array[order]``, when the caller has it."""
    compiled = _compiled_deal() if len(order) >= COMPILED_DEAL_MIN and isinstance(row_counts, RowCounts) else None
    if compiled is not None and int(row_counts.array.max(initial=0)) * len(order) < 2**50:
        order = np.ascontiguousarray(order, dtype=np.int64)
        rows = row_counts.array[order] if rows_in_order is None else rows_in_order
        return compiled(order, rows, num_partitions)
    rows = row_counts.array.tolist() if isinstance(row_counts, RowCounts) else list(row_counts)
    dealt = deal_shards(order, rows, num_partitions)
    bounds = np.zeros(num_partitions + 1, dtype=np.int64)
    np.cumsum([len(d) for d in dealt], out=bounds[1:])
    return np.fromiter(itertools.chain.from_iterable(dealt), dtype=np.int64, count=int(bounds[-1])), bounds


@lru_cache(maxsize=1)
def _compiled_deal():
    try:
        from .compiled_deal import deal
    except ImportError:         # numba not installed: the Python deal, the same shards
        return None
    return deal


class RowCounts(Sequence):
    """Rows per shard as one read-only int array (a parquet index's row groups: millions of them): hashed once,
    equal to the tuple of the same counts, so a Layout made from it plans exactly as one made from the tuple."""

    def __init__(self, rows: np.ndarray):
        self.array = np.asarray(rows)
        self._hash: int | None = None

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self.array[i].tolist())
        return int(self.array[i])

    def __iter__(self):
        return iter(self.array.tolist())

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(hashlib.blake2b(np.ascontiguousarray(self.array, dtype="<i8").tobytes(),
                                              digest_size=8).digest())
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowCounts):
            return other is self or (len(other) == len(self) and bool(np.array_equal(self.array, other.array)))
        return isinstance(other, tuple) and len(other) == len(self) and other == tuple(self)


def shard_rows(shards: Sequence) -> tuple[int | None, ...] | RowCounts:
    """The row counts of ``shards`` (a source's): their own compact form when they have one."""
    own = getattr(shards, "row_counts", None)
    return own() if own is not None else tuple(s.num_rows for s in shards)


@dataclass(frozen=True)
class Layout:
    """How one epoch's rows are split among ``num_partitions`` ordered partitions: whole shards each with at least as
    many shards as partitions, else every partition reads every shard and keeps ``row % num_partitions``'s rows."""

    num_shards: int
    row_counts: tuple[int | None, ...] | RowCounts
    num_partitions: int
    seed: int
    shuffle: bool
    buffer_size: int
    interleave: int
    block_rows: int
    # A growing dataset (data.growth): ((first epoch, the shards of that epoch on, in index order), ...) by
    # first epoch, the first from epoch 0; None: every shard in every epoch (and today's order, bit for bit).
    generations: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    # data.growth: follow: epoch e reads only the files the generation starting at e added (none: an empty epoch)
    follow: bool = False

    def shards_of_epoch(self, epoch: int) -> tuple[int, ...] | None:
        """The shards epoch ``epoch`` plans over (None: all): those of the last generation begun by then (in
        follow mode: those the generation that starts at ``epoch`` added, () if none starts there)."""
        if self.generations is None:
            return None
        if self.follow:
            before: set[int] = set()
            for first, shards in self.generations:
                if first == epoch:
                    return tuple(s for s in shards if s not in before)
                if first > epoch:
                    break
                before.update(shards)
            return ()
        chosen = self.generations[0][1]
        for first, shards in self.generations:
            if first > epoch:
                break
            chosen = shards
        return chosen

    @cached_property
    def usable_shards(self) -> int:
        """Shards not known to be empty (a 0-row parquet row group is left out of the plan)."""
        if isinstance(self.row_counts, RowCounts):
            return int(np.count_nonzero(self.row_counts.array))
        return sum(1 for c in self.row_counts if c != 0)

    @property
    def strided(self) -> bool:
        return self.strided_in(0)

    def strided_in(self, epoch: int) -> bool:
        active = self.shards_of_epoch(epoch)
        if active is None:
            return self.usable_shards < self.num_partitions
        return sum(1 for s in active if self.row_counts[s] != 0) < self.num_partitions

    @property
    def open_slots(self) -> int:
        """How many shards a partition reads at once (1 without shuffle: keep the natural order)."""
        return self.interleave if self.shuffle else 1

    @property
    def block(self) -> int:
        """Rows taken from one open shard before moving to the next, so a window mixes several shards."""
        return max(1, min(self.block_rows, -(-self.buffer_size // self.open_slots)))

    def shards_for(self, epoch: int, partition: int) -> tuple[int, ...]:
        return _shards_for(self, epoch)[partition]

    def stride(self, partition: int, epoch: int = 0) -> tuple[int, int]:
        """(step, phase) of the rows a partition keeps inside each shard (in ``epoch``: a growing dataset may
        have too few shards for the partitions in its first epochs only)."""
        return (self.num_partitions, partition) if self.strided_in(epoch) else (1, 0)

    def partition_rows(self, epoch: int, partition: int) -> int | None:
        """Rows ``partition`` reads in ``epoch``; None when a shard's row count is unknown."""
        step, phase = self.stride(partition, epoch)
        total = 0
        for shard in self.shards_for(epoch, partition):
            n = self.row_counts[shard]
            if n is None:
                return None
            total += len(range(phase, n, step))
        return total


class Deal:
    """One epoch's shards of every partition, held as one array (partition after partition; strided: one list
    that every partition reads); a partition's tuple is made when this process first asks for it, so a rank
    holds tuples for its own partitions only (a million-file index: 10M shards over 8 ... 4,096 partitions)."""

    def __init__(self, shards: np.ndarray, bounds: np.ndarray | None):
        self.shards, self.bounds = shards, bounds
        self._tuples: dict[int, tuple[int, ...]] = {}

    def __getitem__(self, partition: int) -> tuple[int, ...]:
        key = -1 if self.bounds is None else partition
        got = self._tuples.get(key)
        if got is None:
            part = self.shards if self.bounds is None else self.shards[self.bounds[partition]:self.bounds[partition + 1]]
            got = self._tuples[key] = tuple(part.tolist())
        return got


@lru_cache(maxsize=8)
def _shards_for(layout: Layout, epoch: int) -> Deal:
    active = layout.shards_of_epoch(epoch)
    if active is None:
        order = epoch_shard_order(layout.num_shards, layout.seed, epoch, layout.shuffle)
    else:       # the epoch's generation, permuted as a dataset of just those shards would be
        order = np.asarray(active, dtype=np.int64)[epoch_shard_order(len(active), layout.seed, epoch, layout.shuffle)]
    counts = layout.row_counts
    in_order = None             # the rows of the shards in deal order (one gather of millions, done once)
    if isinstance(counts, RowCounts):
        in_order = counts.array[order]
        if not in_order.all():
            kept = in_order != 0
            order, in_order = order[kept], in_order[kept]
    else:
        order = np.asarray([s for s in order.tolist() if counts[s] != 0], dtype=np.int64)
    dtype = np.int32 if layout.num_shards < 2**31 else np.int64
    if layout.strided_in(epoch):
        return Deal(order.astype(dtype), None)
    shards, bounds = deal_array(order, counts, layout.num_partitions, in_order)
    return Deal(shards.astype(dtype), bounds)


# ------------------------------------------------------------------ who reads which partition
def check_consumers(num_partitions: int, world_size: int, slots: int, key: str = "data.num_partitions") -> None:
    """Every consumer (rank, DataLoader worker) needs at least one virtual partition, and a state describes at
    most MAX_PARTITIONS of them."""
    consumers = world_size * slots
    if num_partitions > MAX_PARTITIONS:
        raise ConfigError(f"{key}: got {num_partitions} virtual partitions ({world_size} ranks x {slots} DataLoader "
                          f"worker(s)); allowed: at most {MAX_PARTITIONS} (by default ranks x workers)")
    if num_partitions < consumers:
        raise ConfigError(
            f"{key}: got {num_partitions} virtual partitions for {consumers} consumers ({world_size} ranks x "
            f"{slots} DataLoader worker(s)); allowed: at least ranks x workers = {consumers}. A run can only grow "
            "up to num_partitions consumers: start runs that may change size with a data.num_partitions that "
            "every planned ranks x workers divides (e.g. 24 or 60)")


def partition_owner(partition: int, num_partitions: int, world_size: int) -> int:
    """The rank that reads ``partition``: ranks own contiguous, balanced blocks of partitions."""
    return partition * world_size // num_partitions


def partition_lanes(num_partitions: int, world_size: int, slots: int, rank: int) -> list[list[int]]:
    """The virtual partitions of ``rank`` in ``slots`` lanes (lane w: DataLoader worker w, or the main process); the
    one place that decides which consumer reads which partition. Ranks get contiguous blocks
    (:func:`partition_owner`); lane w takes every ``slots``-th from the w-th (default: worker w of rank r reads
    partition ``r * slots + w``)."""
    check_consumers(num_partitions, world_size, slots)
    # partition_owner(p) == rank  <=>  rank * N / W <= p < (rank + 1) * N / W
    mine = list(range(-(-rank * num_partitions // world_size), -(-(rank + 1) * num_partitions // world_size)))
    return [mine[w::slots] for w in range(slots)]


# ------------------------------------------------------------------ the same global batches on any topology
# data.elastic_determinism (docs/elastic.md): a rank hands out its micro-batches in rounds, one from each of its
# partitions per round (in partition order); an optimizer step that accumulates whole rounds on every rank takes
# the same number of micro-batches from every partition, so what it takes is the partitions' next micro-batches
# whatever the ranks and DataLoader workers. The rule: num_partitions a multiple of the ranks, and the global
# batch in micro-batches (ranks x gradient accumulation) a multiple of num_partitions.
ELASTIC_KEYS = {"switch": "data.elastic_determinism", "partitions": "data.num_partitions",
                "accumulation": "gradient_accumulation_steps", "batch": "per_device_train_batch_size",
                "workers": "dataloader_num_workers", "world": "world size (ranks)"}


def divisors(n: int, limit: int = 12) -> list[int]:
    """The first ``limit`` divisors of ``n`` (what an error lists as allowed)."""
    return [d for d in range(1, n + 1) if n % d == 0][:limit]


def check_partitions_per_rank(num_partitions: int, world_size: int, keys: dict[str, str] | None = None) -> None:
    """With ``data.elastic_determinism`` every rank reads the same number of partitions (a round is the same
    number of micro-batches on every rank): ``num_partitions`` a multiple of ``world_size``."""
    k = {**ELASTIC_KEYS, **(keys or {})}
    if num_partitions % world_size:
        raise ConfigError(
            f"{k['partitions']}: got {num_partitions} virtual partitions on {world_size} ranks; allowed with "
            f"{k['switch']} (on by default when num_partitions is set): a multiple of the number of ranks, so that "
            f"every optimizer step takes one micro-batch from each partition on any topology ({num_partitions} "
            f"partitions allow {', '.join(map(str, divisors(num_partitions)))} ranks); or set {k['switch']}: false "
            "(any ranks x workers, but the global batches then depend on them)")


def check_global_batch(num_partitions: int, world_size: int, accumulation: int, batch_size: int | None = None,
                       workers: int | None = None, keys: dict[str, str] | None = None) -> None:
    """``data.elastic_determinism``: an optimizer step of ``world_size`` x ``accumulation`` micro-batches takes
    the same number from every partition (the global batch a multiple of ``num_partitions``), else a
    ConfigError naming the keys (``keys``: the caller's names of them, over :data:`ELASTIC_KEYS`)."""
    k = {**ELASTIC_KEYS, **(keys or {})}
    check_partitions_per_rank(num_partitions, world_size, keys)
    per_round = num_partitions // world_size     # micro-batches a rank hands out per round
    if isinstance(accumulation, int) and accumulation >= 1 and accumulation % per_round == 0:
        return
    batch = f" of {k['batch']} {batch_size}" if batch_size is not None else ""
    shape = f"{world_size} rank(s)" + (f" x {k['workers']} {workers}" if workers is not None else "")
    raise ConfigError(
        f"{k['accumulation']}: got {accumulation!r} on {shape} with {k['partitions']} {num_partitions}: an optimizer "
        f"step of {world_size} x {accumulation!r} micro-batches{batch} would not take one from each of the "
        f"{num_partitions} partitions, so its samples would depend on the number of ranks and workers; allowed with "
        f"{k['switch']} (on by default when num_partitions is set): a multiple of num_partitions / ranks = "
        f"{per_round} (each step then takes the same micro-batches on any ranks x workers: a global batch of "
        f"{k['batch']} x {num_partitions} x a whole number), or a {k['partitions']} that divides ranks x "
        f"{k['accumulation']} for a new run; or set {k['switch']}: false (the global batches then depend on ranks x "
        "workers)")
