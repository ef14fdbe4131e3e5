"""Reading sidecars of format version 1 (resumable-stream up to 0.x of 2026-11).

Version 1 stored every state as flat single-stream cursor entries. A mixture (``data.sources``) squeezed
into them: for partition p, entry p held the mixture's own position (its epoch in ``epoch``, draws in
``offset``, per source (epoch being read, ended) in ``slots``, a zero chain and no next-sample digest),
and entry ``p + (i + 1) * 2**32`` held source i's cursor. The cursor columns had older names in the same
order. This module turns such entries into the current form (see :mod:`resumable_stream.stream.mixture`).
"""

from __future__ import annotations

from typing import Any

from ..errors import SidecarError
from ..limits import MAX_EPOCH
from .mixture_state import MixturePartitionState
from .partition_state import PartitionState

V1_CURSOR_FIELDS = ("epoch", "window", "offset", "next_pos", "rr", "rr_taken", "consumed_before")
V1_SOURCE_STRIDE = 2**32     # entry of source i of mixture partition p: p + (i + 1) * V1_SOURCE_STRIDE


def check_v1_partition_ids(ids: list[int], num_partitions: int, path: str) -> None:
    if len(set(ids)) != len(ids) or not all(p >= 0 and p % V1_SOURCE_STRIDE < num_partitions for p in ids):
        raise SidecarError(f"sidecar {path!r}: corrupt field tensor partition_ids: got {ids!r:.80}; allowed: distinct "
                           f"partitions in [0, {num_partitions}) (plus multiples of 2**32 in a mixture)")


def mixture_from_v1(entries: dict[int, PartitionState], num_sources: int,
                    path: str) -> dict[int, MixturePartitionState]:
    """A version 1 mixture's flat entries -> a MixturePartitionState per partition (the caller adds each
    partition's transform carry)."""
    grouped: dict[int, dict[str, Any]] = {}
    for entry_id, ps in entries.items():
        p, slot = entry_id % V1_SOURCE_STRIDE, entry_id // V1_SOURCE_STRIDE
        if slot > num_sources:
            raise SidecarError(f"sidecar {path!r}: has an entry for source {slot - 1} of partition {p}; the mixture "
                               f"has {num_sources} sources")
        part = grouped.setdefault(p, {"own": None, "sources": [None] * num_sources})
        if slot == 0:
            part["own"] = ps
        else:
            part["sources"][slot - 1] = ps
    out = {}
    for p, part in grouped.items():
        own = part["own"]
        slots = own.start.slots if own is not None else ()
        if own is None or any(s is None for s in part["sources"]) or len(slots) != num_sources \
                or any(ended not in (0, 1) or epoch >= MAX_EPOCH for epoch, ended in slots) \
                or own.epoch >= MAX_EPOCH:
            raise SidecarError(f"sidecar {path!r}: partition {p} is not a complete mixture state for {num_sources} "
                               "sources")
        out[p] = MixturePartitionState(own.epoch, own.offset, own.consumed, [epoch for epoch, _ in slots],
                                       [bool(ended) for _, ended in slots], part["sources"])
    return out
