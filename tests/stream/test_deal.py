"""The plan's fast paths give the very plan of the plain ones: the compiled deal (numba, the `scale` extra) is
``plan.deal_shards``'s deal, the packed sort is a stable argsort, the in-place hashes are splitmix64's."""

import numpy as np
import pytest

from resumable_stream import plan
from resumable_stream.plan.compiled_deal import deal as compiled_deal

GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK = 2**64 - 1


def splitmix_counter(seed: int, i: int) -> int:
    """splitmix64 of counter * golden + seed, in Python integers (the definition the order is pinned to)."""
    z = (i * GOLDEN + seed + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 5, MASK, plan.derive_seed(1, 42, 3)])
def test_counter_hashes_are_splitmix64_of_the_counters(seed):
    for start in (0, 7, 2**40):
        got = plan.counter_hashes(seed, start, 50).tolist()
        assert got == [splitmix_counter(seed, start + i) for i in range(50)]


def _grouped(shards, bounds):
    return [shards[bounds[p]:bounds[p + 1]].tolist() for p in range(len(bounds) - 1)]


def _layouts(rng, n):
    yield "one size", np.full(n, 1000)
    yield "one size, last of each file smaller", np.where(np.arange(n) % 10 == 9, 337, 1000)
    yield "random sizes", rng.integers(1, 5000, n)
    yield "few sizes, many ties", rng.integers(1, 4, n) * 100


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 64, 513, 4096])
def test_the_compiled_deal_is_the_python_deal(parts):
    rng = np.random.default_rng(parts)
    order = plan.permutation(20_000, parts)
    for name, rows in _layouts(rng, 20_000):
        python = plan.deal_shards(order, rows.tolist(), parts)
        shards, bounds = compiled_deal(order, rows[order].astype(np.int64), parts)
        assert _grouped(shards, bounds) == python, name


def test_unknown_row_counts_are_dealt_as_the_mean_by_the_python_deal(monkeypatch):
    rng = np.random.default_rng(5)
    counts = [None if i % 7 == 0 else int(c) for i, c in enumerate(rng.integers(1, 3000, 5000))]
    order = plan.permutation(5000, 11)
    monkeypatch.setattr(plan, "COMPILED_DEAL_MIN", 1)
    dealt = _grouped(*plan.deal_array(order, counts, 24))
    assert dealt == plan.deal_shards(order, counts, 24)
    mean = sum(c for c in counts if c is not None) / sum(c is not None for c in counts)
    assert dealt == plan.deal_shards(order, [mean if c is None else c for c in counts], 24)


def test_large_plans_take_the_compiled_deal_and_plan_as_before(monkeypatch):
    """A Layout over more shards than COMPILED_DEAL_MIN plans each partition's shards as the Python deal does."""
    counts = plan.RowCounts(np.where(np.arange(30_000) % 10 == 9, 337, 1000).astype(np.uint32))
    kw = dict(num_shards=30_000, row_counts=counts, num_partitions=96, seed=3, shuffle=True, buffer_size=64,
              interleave=4, block_rows=8)
    used = []
    real = plan._compiled_deal()
    monkeypatch.setattr(plan, "_compiled_deal", lambda: (lambda *a: used.append(1) or real(*a)))
    monkeypatch.setattr(plan, "COMPILED_DEAL_MIN", 10_000)
    fast = [plan.Layout(**kw).shards_for(2, p) for p in range(96)]
    assert used
    order = plan.epoch_shard_order(30_000, 3, 2, True)
    assert fast == [tuple(d) for d in plan.deal_shards(order, counts.array.tolist(), 96)]


@pytest.mark.parametrize("n", [4_096, 10_000, 16_384, 100_000, 200_000])   # windows' sizes and a plan's
def test_the_packed_sort_is_a_stable_argsort(n):
    rng = np.random.default_rng(n)
    hashes = plan.counter_hashes(plan.derive_seed(1, 7, 0), 0, n)
    assert np.array_equal(plan.stable_argsort_u64(hashes), np.argsort(hashes, kind="stable"))
    for distinct_high in (1, 3, 1000):      # many values sharing their high bits, and exact duplicates
        values = (rng.integers(0, distinct_high, n).astype(np.uint64) << np.uint64(40)) | \
            rng.integers(0, 4, n).astype(np.uint64)
        assert np.array_equal(plan.stable_argsort_u64(values), np.argsort(values, kind="stable"))
