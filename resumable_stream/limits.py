"""Bounds on what saved state may say: every number read from a sidecar, a manifest or a dataset index is
checked against these before it sizes a loop or an allocation, so a damaged or forged file is an error in
bounded time and memory, never a hang. Each bound is far above any real run, and the ones a run could
reach are enforced when the state is written too (topology, config keys), so no state this library writes
is refused when read.
"""

from __future__ import annotations

import math
from typing import Any

# Ranks of a run: what the rank file names carry (rank-00000 .. rank-99999.safetensors); above the largest
# training jobs (~100k accelerators). A manifest of that many ranks is ~18 MB, under MAX_MANIFEST_BYTES.
MAX_WORLD_SIZE = 100_000
# Virtual partitions (data.num_partitions, or ranks x DataLoader workers by default): every rank plans the
# shards of all of them each epoch, so this bounds a rank's plan memory too.
MAX_PARTITIONS = 1_000_000
MAX_OPEN_SHARDS = 64         # data.interleave_shards: the open shards in a cursor
MAX_EPOCH = 2**31            # a cursor's epoch: a forged state cannot jump to any epoch
MAX_GENERATION = 10**9 - 1   # saves into one state directory: what its file names carry (.g1 .. .g999999999)
MAX_INT64 = 2**63 - 1        # sizes, offsets and row counts of data files (what parquet and filesystems express)

# Nesting of any JSON read from disk; the deepest we write is ~10 (a dataset's features nest 2 levels per
# list and 1 per struct of its schema), and recursive readers downstream (datasets' Features, fingerprint
# comparison) stay far from Python's recursion limit.
MAX_JSON_DEPTH = 64
MAX_SIDECAR_BYTES = 1 << 30    # far above any real state (cursors, digests, carried tokens)
MAX_HEADER_BYTES = 100_000_000  # a sidecar's safetensors header (its metadata): safetensors' own limit
MAX_MANIFEST_BYTES = 64 << 20
MAX_INDEX_BYTES = 1 << 30      # a dataset index: ~2 KB per file (row groups with byte spans); far above any real one


def is_int(v: Any, minimum: int = 0, maximum: int = MAX_INT64) -> bool:
    """An integer (not a bool) in [minimum, maximum]."""
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= maximum


def is_number(v: Any) -> bool:
    """A finite number (an int or a float, not a bool) that a float can hold: ``math.isfinite`` of an int of 400
    digits raises OverflowError, and such an int would as soon as anything converted it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
