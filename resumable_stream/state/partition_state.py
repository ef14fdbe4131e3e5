"""The saved position of one partition: its :class:`Cursor` and :class:`PartitionState` (made by the partition
reader, :mod:`resumable_stream.stream.partition`), a mixture partition's :class:`MixturePartitionState` that nests
its sources' (docs/internals.md, "Sidecar schema"), each with its own sidecar encoding and bounds, and the field
checks they and the sidecar envelope share: each failure a SidecarError naming the file, field, value and what
is allowed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import SidecarError
from ..io.safe_files import JSONRefused, parse_json
from ..limits import MAX_EPOCH, MAX_OPEN_SHARDS, is_int
from ..plan import Layout


def is_hex(v: Any, length: int) -> bool:
    return isinstance(v, str) and len(v) == length and all(c in "0123456789abcdef" for c in v)


def require(ok: bool, path: str, field: str, value: Any, allowed: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise SidecarError(f"sidecar {path!r}: corrupt field {field}: got {shown}; allowed: {allowed}")


def json_field(meta: dict[str, str], key: str, path: str, default: str | None = None) -> Any:
    text = meta.get(key, default)
    if text is None:
        raise SidecarError(f"sidecar {path!r}: corrupt or incomplete: metadata field {key} missing")
    try:
        return parse_json(text)
    except JSONRefused as e:
        raise SidecarError(f"sidecar {path!r}: corrupt field {key}: {e}") from None


def tensor(tensors: dict[str, np.ndarray], name: str, dtype: str, ndim: int, path: str) -> np.ndarray:
    t = tensors.get(name)
    if t is None:
        raise SidecarError(f"sidecar {path!r}: corrupt or incomplete: tensor {name} missing")
    require(t.dtype == np.dtype(dtype) and t.ndim == ndim, path, f"tensor {name}", f"{t.dtype} {t.shape}",
             f"{dtype} with {ndim} dimension(s)")
    return t


DIGEST_BYTES = 16
EMPTY_CHAIN = bytes(DIGEST_BYTES)


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    window: int = 0
    offset: int = 0              # rows of the current window already consumed
    next_shard: int = 0          # position in this epoch's shard list of the next shard to open
    block_slot: int = 0          # open slot the next block is taken from (blocks rotate over open shards)
    block_taken: int = 0         # rows of that block already taken
    consumed_before: int = 0     # samples consumed before the current window (all epochs)
    slots: tuple[tuple[int, int], ...] = ()   # open shards: (position in shard list, next raw row)
    chain: bytes = field(default=EMPTY_CHAIN)  # digest of the keys of every sample consumed before the window
    epoch_start: int | None = 0  # samples consumed before this epoch began (progress only; None: unknown)

    FIELDS = ("epoch", "window", "offset", "next_shard", "block_slot", "block_taken", "consumed_before")

    @property
    def consumed(self) -> int:
        return self.consumed_before + self.offset

    def next_epoch(self) -> Cursor:
        return Cursor(epoch=self.epoch + 1, consumed_before=self.consumed, chain=self.chain,
                      epoch_start=self.consumed)


@dataclass
class PartitionState:
    """Where one partition stands: the cursor at the start of its window, the samples of it consumed and the digests
    that check a resume. It owns its sidecar encoding (:meth:`to_arrays` / :meth:`from_arrays`) and bounds
    (:meth:`validate`): a new cursor field is a change here (and in :class:`Cursor`) only."""

    start: Cursor                    # offset 0: the window's start
    offset: int                      # samples of the window consumed
    consumed_digest: str             # the digest chain of every sample consumed (32 hex digits)
    next_sample_digest: str          # the content digest of the next sample (16 hex digits)
    epoch_rows: int | None = None    # rows of the current epoch (progress reports; None: unknown)

    @property
    def cursor(self) -> Cursor:
        return replace(self.start, offset=self.offset)

    @property
    def consumed(self) -> int:
        return self.start.consumed_before + self.offset

    @property
    def epoch(self) -> int:
        return self.start.epoch

    @property
    def epoch_start(self) -> int | None:
        return self.start.epoch_start

    # ---------------------------------------------------------------- the public form (state_dict)
    def to_dict(self) -> dict[str, Any]:
        """Plain values (ints, strings, lists): what a stream's ``state_dict()`` holds per partition, safe to
        store with ``torch.save`` and load with ``weights_only=True``."""
        c = self.start
        out = {f: self.offset if f == "offset" else getattr(c, f) for f in Cursor.FIELDS}
        out.update(slots=[list(s) for s in c.slots], chain=c.chain.hex(), consumed=self.consumed,
                   consumed_digest=self.consumed_digest, next_sample_digest=self.next_sample_digest,
                   epoch_start=c.epoch_start, epoch_rows=self.epoch_rows)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> PartitionState:
        """The state in ``to_dict``'s form (or a PartitionState itself); a malformed one is a SidecarError
        naming the field."""
        if isinstance(d, cls):
            return d

        def field_of(name: str, ok, allowed: str) -> Any:
            value = d.get(name) if isinstance(d, dict) else None
            if not ok(value):
                raise SidecarError(f"{where}: corrupt field {name}: got {value!r:.80}; allowed: {allowed}")
            return value

        if not isinstance(d, dict):
            raise SidecarError(f"{where}: got {type(d).__name__}; allowed: a partition state (a mapping)")
        fields = {f: field_of(f, is_int, "an integer >= 0") for f in Cursor.FIELDS}
        slots = field_of("slots", lambda v: isinstance(v, (list, tuple)) and all(
            isinstance(x, (list, tuple)) and len(x) == 2 and all(is_int(i) for i in x) for x in v),
            "a list of (position, row) pairs of integers >= 0")
        chain = field_of("chain", lambda v: is_hex(v, 2 * DIGEST_BYTES), f"{2 * DIGEST_BYTES} hex digits")
        consumed_digest = field_of("consumed_digest", lambda v: is_hex(v, 2 * DIGEST_BYTES),
                                   f"{2 * DIGEST_BYTES} hex digits")
        next_digest = field_of("next_sample_digest", lambda v: isinstance(v, str), "16 hex digits")
        epoch_start = field_of("epoch_start", lambda v: v is None or is_int(v), "null or an integer >= 0")
        epoch_rows = field_of("epoch_rows", lambda v: v is None or is_int(v), "null or an integer >= 0")
        offset = fields.pop("offset")
        start = Cursor(**fields, slots=tuple((int(a), int(b)) for a, b in slots), chain=bytes.fromhex(chain),
                       epoch_start=epoch_start)
        return cls(start, offset, consumed_digest, next_digest, epoch_rows)

    # ---------------------------------------------------------------- sidecar arrays
    @staticmethod
    def to_arrays(parts: list[int], states: list[PartitionState], prefix: str, tensors: dict, meta: dict) -> None:
        """``states`` (one per partition in ``parts``) as the tensors and metadata under ``prefix``."""
        k = len(parts)
        max_slots = max([len(ps.start.slots) for ps in states] + [1])
        cursors = np.zeros((k, len(Cursor.FIELDS)), dtype=np.int64)
        slots = np.full((k, max_slots, 2), -1, dtype=np.int64)
        chains = np.zeros((k, DIGEST_BYTES), dtype=np.uint8)
        digests, progress = {}, {}
        for i, (p, ps) in enumerate(zip(parts, states)):
            c = ps.start
            cursors[i] = [ps.offset if f == "offset" else getattr(c, f) for f in Cursor.FIELDS]
            for j, (pos, row) in enumerate(c.slots):
                slots[i, j] = (pos, row)
            chains[i] = np.frombuffer(c.chain, dtype=np.uint8)
            digests[str(p)] = {"next_sample": ps.next_sample_digest, "consumed": ps.consumed_digest,
                               "consumed_samples": ps.consumed}
            progress[str(p)] = {"epoch_start": c.epoch_start, "epoch_rows": ps.epoch_rows}
        tensors.update({f"{prefix}cursors": cursors, f"{prefix}slots": slots, f"{prefix}chains": chains})
        meta[f"{prefix}digests"] = json.dumps(digests, sort_keys=True)
        meta[f"{prefix}progress"] = json.dumps(progress, sort_keys=True)

    @classmethod
    def from_arrays(cls, ids: list[int], tensors: dict[str, np.ndarray], meta: dict[str, str], path: str,
                    prefix: str = "", blank_digest_ok: bool = False,
                    max_slots: int = MAX_OPEN_SHARDS) -> dict[int, PartitionState]:
        """The states under ``prefix`` (rows aligned with ``ids``), every field checked. Columns are taken by
        position (``Cursor.FIELDS``). ``max_slots``: open shards a cursor may have."""
        k = len(ids)
        cursors = tensor(tensors, f"{prefix}cursors", "int64", 2, path)
        slots_t = tensor(tensors, f"{prefix}slots", "int64", 3, path)
        chains = tensor(tensors, f"{prefix}chains", "uint8", 2, path)
        for name, t, shape in ((f"{prefix}cursors", cursors, (k, len(Cursor.FIELDS))),
                               (f"{prefix}chains", chains, (k, DIGEST_BYTES))):
            require(t.shape == shape, path, f"tensor {name}", t.shape, f"shape {shape}")
        require(slots_t.shape[0] == k and slots_t.shape[1] <= max_slots and slots_t.shape[2] == 2, path,
                f"tensor {prefix}slots", slots_t.shape,
                f"shape ({k}, open shards, 2) with at most {max_slots} open shards")
        digests = json_field(meta, f"{prefix}digests", path)
        progress = json_field(meta, f"{prefix}progress", path, "{}")
        for key, value in ((f"{prefix}digests", digests), (f"{prefix}progress", progress)):
            require(isinstance(value, dict), path, key, value, "a mapping by partition")
        out = {}
        for i, p in enumerate(ids):
            where = f"{prefix}digests[{p}]"
            d = digests.get(str(p))
            require(isinstance(d, dict), path, where, d, "a mapping with next_sample, consumed, consumed_samples")
            require(is_hex(d.get("next_sample"), 16) or (blank_digest_ok and d.get("next_sample") == ""), path,
                    f"{where}.next_sample", d.get("next_sample"), "16 hex digits")
            require(is_hex(d.get("consumed"), 32), path, f"{where}.consumed", d.get("consumed"), "32 hex digits")
            require(is_int(d.get("consumed_samples")), path, f"{where}.consumed_samples", d.get("consumed_samples"),
                    "an integer >= 0")
            fields = {f: int(v) for f, v in zip(Cursor.FIELDS, cursors[i].tolist())}
            for f in Cursor.FIELDS:
                require(fields[f] >= 0, path, f"{prefix}cursors[{p}].{f}", fields[f], "an integer >= 0")
            require(fields["consumed_before"] + fields["offset"] == d["consumed_samples"], path,
                    f"{where}.consumed_samples", d["consumed_samples"],
                    f"consumed_before + offset = {fields['consumed_before'] + fields['offset']}")
            pairs = [(int(a), int(b)) for a, b in slots_t[i].tolist()]
            for a, b in pairs:
                require((a >= 0 and b >= 0) or (a == b == -1), path, f"{prefix}slots[{p}]", (a, b),
                        "(position, row) pairs >= 0, or (-1, -1) for an unused slot")
            pr = progress.get(str(p), {})
            require(isinstance(pr, dict), path, f"{prefix}progress[{p}]", pr, "a mapping")
            for key in ("epoch_start", "epoch_rows"):
                require(pr.get(key) is None or is_int(pr.get(key)), path, f"{prefix}progress[{p}].{key}",
                        pr.get(key), "null or an integer >= 0")
            offset = fields.pop("offset")
            start = Cursor(**fields, slots=tuple((a, b) for a, b in pairs if a >= 0),
                           chain=bytes(chains[i].tolist()), epoch_start=pr.get("epoch_start"))
            out[p] = cls(start, offset, d["consumed"], d["next_sample"], pr.get("epoch_rows"))
        return out

    def validate(self, layout: Layout, partition: int, where: str) -> None:
        """The cursor points inside ``partition``'s data under ``layout`` (its shards of its epoch, their rows,
        one window): a corrupt or forged state is a SidecarError naming the field, not an IndexError later."""
        c, lay = self.start, layout

        def check(ok: bool, field: str, value: Any, allowed: str) -> None:
            if not ok:
                raise SidecarError(f"{where}: corrupt field partitions[{partition}].{field}: got {value!r:.80}; "
                                   f"allowed: {allowed}")

        check(0 <= c.epoch < MAX_EPOCH, "epoch", c.epoch, "an integer in [0, 2**31)")
        shards = lay.shards_for(c.epoch, partition)
        check(0 <= c.next_shard <= len(shards), "next_shard", c.next_shard,
              f"0 .. {len(shards)} (the partition's shards in epoch {c.epoch})")
        slots = list(c.slots)
        check(len(slots) <= lay.open_slots, "slots", slots, f"at most {lay.open_slots} open shards")
        for pos, row in slots:
            check(0 <= pos < c.next_shard and [q for q, _ in slots].count(pos) == 1, "slots", slots,
                  f"distinct shard positions below next_shard {c.next_shard}")
            count = lay.row_counts[shards[pos]]
            check(0 <= row and (count is None or row <= count), "slots", slots,
                  f"rows within their shard ({count} rows in shard {shards[pos]})")
        check(0 <= c.block_slot < max(1, len(slots)), "block_slot", c.block_slot, f"0 .. {max(1, len(slots)) - 1}")
        check(0 <= c.block_taken < lay.block, "block_taken", c.block_taken, f"0 .. {lay.block - 1}")
        check(0 <= self.offset <= lay.buffer_size, "offset", self.offset, f"0 .. {lay.buffer_size} (one window)")
        check(0 <= c.window and 0 <= c.consumed_before, "window", c.window, "an integer >= 0")


MIXTURE_POSITION = ("epoch", "draws", "consumed")   # columns of the tensor mixture/positions


def _changes_ok(changes: Any, consumed: int) -> bool:
    """Where a partition's weight history entries start: draw indexes, non-decreasing, none past consumed."""
    return (isinstance(changes, list) and all(is_int(c) for c in changes)
            and all(0 <= a <= b for a, b in zip([0, *changes], changes)) and (not changes or changes[-1] <= consumed))


@dataclass
class MixturePartitionState:
    """Where one mixture partition stands: its mixture epoch, draws, samples yielded, per source the epoch being read
    and whether it ended in this mixture epoch, ``changes`` (where each weight-history entry after the first starts
    for it), and each source's nested :class:`PartitionState`."""

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
