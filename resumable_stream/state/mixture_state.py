"""The state of one mixture partition (``data.sources``): its mixture epoch, draws, samples yielded, per source the
epoch being read and whether it ended in this mixture epoch, ``changes`` (where each weight-history entry after
the first starts for it), and each source's nested
:class:`~resumable_stream.state.partition_state.PartitionState` (docs/internals.md, "Sidecar schema")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SidecarError
from ..limits import MAX_EPOCH, is_int
from .fields import require, tensor
from .partition_state import PartitionState

MIXTURE_POSITION = ("epoch", "draws", "consumed")   # columns of the tensor mixture/positions


def _changes_ok(changes: Any, consumed: int) -> bool:
    """Where a partition's weight history entries start: draw indexes, non-decreasing, none past consumed."""
    return (isinstance(changes, list) and all(is_int(c) for c in changes)
            and all(0 <= a <= b for a, b in zip([0, *changes], changes)) and (not changes or changes[-1] <= consumed))


@dataclass
class MixturePartitionState:
    """Where one mixture partition stands (module doc)."""

    epoch: int                        # mixture epoch
    draws: int                        # draws made (= samples yielded) in this mixture epoch
    consumed: int                     # samples yielded, all epochs
    source_epochs: list[int]          # per source: the epoch being read
    ended: list[bool]                 # per source: ended during this mixture epoch (all_exhausted)
    sources: list[PartitionState] = field(default_factory=list)
    changes: list[int] = field(default_factory=list)   # per weight history entry after the first: its first draw

    def to_dict(self) -> dict[str, Any]:
        """Plain values: ``{"mixture": position, "sources": [each source's PartitionState.to_dict()]}`` (what a
        mixture's ``state_dict()`` holds per partition)."""
        out: dict[str, Any] = {"mixture": {"epoch": self.epoch, "draws": self.draws, "consumed": self.consumed,
                                           "source_epochs": list(self.source_epochs), "ended": list(self.ended)},
                               "sources": [ps.to_dict() for ps in self.sources]}
        if self.changes:
            out["mixture"]["changes"] = list(self.changes)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> MixturePartitionState:
        """The state in ``to_dict``'s form (or a MixturePartitionState itself), every field checked."""
        if isinstance(d, cls):
            return d
        m = d.get("mixture") if isinstance(d, dict) else None
        sources = d.get("sources") if isinstance(d, dict) else None
        ok = (isinstance(m, dict) and isinstance(sources, list)
              and all(is_int(m.get(k)) for k in MIXTURE_POSITION) and m["epoch"] < MAX_EPOCH
              and isinstance(m.get("source_epochs"), list) and isinstance(m.get("ended"), list)
              and len(m["source_epochs"]) == len(m["ended"]) == len(sources)
              and all(is_int(e, 0, MAX_EPOCH - 1) for e in m["source_epochs"])
              and all(isinstance(b, bool) for b in m["ended"])
              and _changes_ok(m.get("changes", []), m["consumed"]))
        if not ok:
            raise SidecarError(f"{where}: corrupt mixture partition state: got {d!r:.80}; allowed: a mapping with "
                               "mixture (epoch, draws, consumed, source_epochs, ended, optional changes: draws "
                               "non-decreasing up to consumed) and a state per source")
        states = [PartitionState.from_dict(ps, f"{where}, source {i}") for i, ps in enumerate(sources)]
        return cls(m["epoch"], m["draws"], m["consumed"], list(m["source_epochs"]), list(m["ended"]), states,
                   list(m.get("changes", [])))

    # ---------------------------------------------------------------- sidecar arrays
    @staticmethod
    def to_arrays(parts: list[int], states: list[MixturePartitionState], prefix: str, tensors: dict,
                  meta: dict) -> None:
        n = len(states[0].sources) if states else 0
        tensors[f"{prefix}mixture/positions"] = np.asarray(
            [[getattr(ps, f) for f in MIXTURE_POSITION] for ps in states], dtype=np.int64
        ).reshape(len(parts), len(MIXTURE_POSITION))
        tensors[f"{prefix}mixture/source_epochs"] = np.asarray([ps.source_epochs for ps in states],
                                                               dtype=np.int64).reshape(len(parts), n)
        tensors[f"{prefix}mixture/ended"] = np.asarray([ps.ended for ps in states],
                                                       dtype=np.uint8).reshape(len(parts), n)
        m = len(states[0].changes) if states else 0
        if m:
            if any(len(ps.changes) != m for ps in states):
                raise SidecarError(f"mixture states with weight histories of {sorted({len(ps.changes) for ps in states})}"
                                   " changes; allowed: the same history in every partition")
            tensors[f"{prefix}mixture/changes"] = np.asarray([ps.changes for ps in states], dtype=np.int64)
        for i in range(n):
            PartitionState.to_arrays(parts, [ps.sources[i] for ps in states], f"{prefix}sources/{i}/", tensors, meta)

    @classmethod
    def from_arrays(cls, ids: list[int], tensors: dict[str, np.ndarray], meta: dict[str, str], path: str,
                    num_sources: int, prefix: str = "") -> dict[int, MixturePartitionState]:
        """A mixture's partitions from their tensors, every field checked."""
        k, n = len(ids), num_sources
        positions = tensor(tensors, f"{prefix}mixture/positions", "int64", 2, path)
        source_epochs = tensor(tensors, f"{prefix}mixture/source_epochs", "int64", 2, path)
        ended = tensor(tensors, f"{prefix}mixture/ended", "uint8", 2, path)
        for name, t, shape in (("mixture/positions", positions, (k, len(MIXTURE_POSITION))),
                               ("mixture/source_epochs", source_epochs, (k, n)), ("mixture/ended", ended, (k, n))):
            require(t.shape == shape, path, f"tensor {name}", t.shape, f"shape {shape} (partitions, "
                    f"{'fields' if name == 'mixture/positions' else 'sources'})")
        changes = None
        if f"{prefix}mixture/changes" in tensors:
            changes = tensor(tensors, f"{prefix}mixture/changes", "int64", 2, path)
            require(changes.shape[0] == k and changes.shape[1] >= 1, path, "tensor mixture/changes", changes.shape,
                    f"shape ({k}, changes) (partitions, weight history entries after the first)")
        sources = [PartitionState.from_arrays(ids, tensors, meta, path, prefix=f"{prefix}sources/{i}/")
                   for i in range(n)]
        out = {}
        for row, p in enumerate(ids):
            position = dict(zip(MIXTURE_POSITION, (int(v) for v in positions[row].tolist())))
            require(all(v >= 0 for v in position.values()) and position["draws"] <= position["consumed"]
                    and position["epoch"] < MAX_EPOCH, path, f"mixture/positions[{p}]", position,
                    "integers >= 0 with draws <= consumed and epoch < 2**31")
            epochs = [int(v) for v in source_epochs[row].tolist()]
            require(all(0 <= e < MAX_EPOCH for e in epochs), path, f"mixture/source_epochs[{p}]", epochs,
                    "integers in [0, 2**31)")
            flags = ended[row].tolist()
            require(all(f in (0, 1) for f in flags), path, f"mixture/ended[{p}]", flags, "0 or 1 per source")
            drawn = [] if changes is None else [int(v) for v in changes[row].tolist()]
            require(_changes_ok(drawn, position["consumed"]), path, f"mixture/changes[{p}]", drawn,
                    "draw indexes >= 0, non-decreasing, at most the partition's consumed")
            out[p] = cls(**position, source_epochs=epochs, ended=[bool(f) for f in flags],
                         sources=[sources[i][p] for i in range(n)], changes=drawn)
        return out
