"""``plan.deal_shards`` compiled with numba (the ``scale`` extra): the very same deal, for the plans of corpora
with millions of row groups (10M shards: ~0.1-0.3 s here, ~12 s as a Python loop). Imported only when numba
is installed and a deal is large (``plan.COMPILED_DEAL_MIN``): numba's import alone costs ~0.4 s."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def deal(order: np.ndarray, rows: np.ndarray, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Each shard of ``order`` to the partition with the fewest rows so far, ties to the lowest partition, as
    ``plan.deal_shards`` does for known row counts; ``rows``: the rows of each shard *in deal order* (integers)
    (their total under 2**50). Returns the shards partition after partition, in the order dealt, and the
    bounds of each partition."""
    n = num_partitions
    bits = 1
    while (1 << bits) < n:
        bits += 1
    size = 1 << bits
    # A tournament tree over the partitions: key[node] is the least (load, partition) below the node packed
    # in one int64 (load << bits | partition: compared as Python compares the tuples), padding leaves never
    # win. A deal step adds the shard's rows to the winner's leaf and replays its path to the root, one
    # `min` a level with no branch (the comparisons are coin flips a branch predictor would miss).
    key = np.full(2 * size, np.iinfo(np.int64).max, np.int64)
    for p in range(n):
        key[size + p] = p
    for node in range(size - 1, 0, -1):
        key[node] = min(key[2 * node], key[2 * node + 1])
    mask = size - 1
    assign = np.empty(len(order), np.int64)
    counts = np.zeros(n, np.int64)
    for i in range(len(order)):
        k = key[1]
        p = k & mask
        assign[i] = p
        counts[p] += 1
        k += np.int64(rows[i]) << bits
        node = size + p
        key[node] = k
        while node > 1:
            k = min(k, key[node ^ 1])
            node >>= 1
            key[node] = k
    bounds = np.zeros(n + 1, np.int64)
    bounds[1:] = np.cumsum(counts)
    fill = bounds[:-1].copy()
    shards = np.empty(len(order), np.int64)
    for i in range(len(order)):
        p = assign[i]
        shards[fill[p]] = order[i]
        fill[p] += 1
    return shards, bounds
