"""Weighted mixtures of datasets (``data.sources``) that resume exactly.

Every source is cut into the same ``num_partitions`` virtual partitions, and partition *p* of the
mixture reads partition *p* of each source: a mixture partition moves between ranks (elastic
resume) exactly like a single stream's. Its *k*-th draw of mixture epoch *e* takes the next sample
of the source picked by a counter-based hash of (seed, e, p, k) against the cumulative weights. The
sampler therefore has no state to save but (e, k); a partition's state is that, per source the
epoch of it being read and whether it ended during this mixture epoch, and each source's own cursor.

A source *ends* when its partition *p* has yielded all of its current epoch. ``stopping`` says what
happens then:

* ``first_exhausted`` (default): the draw that finds a source ended yields nothing and ends the
  mixture epoch (as ``datasets.interleave_datasets``). The other sources keep their positions: the
  next mixture epoch continues each where it was, the ended one with its next, reshuffled, epoch.
  Nothing is skipped.
* ``all_exhausted``: the ended source restarts at once with its next epoch (the draw takes its first
  sample); the mixture epoch ends at the draw that finds the last source that had not yet ended
  during it ended too. Small sources are oversampled, as with ``interleave_datasets``.
* ``never``: sources restart as with ``all_exhausted`` and the mixture has no epochs.

Without ``set_epoch`` a mixture is endless in every mode (mixture epoch e+1 follows e) and every
draw picks source i with probability weight_i. ``set_epoch(e)`` yields mixture epoch e only (not
with ``never``). Sample keys name the source: ``("label/shard", row)``.

Sidecars store flat per-partition integer cursors; a mixture writes, for each of its partitions p:

* entry ``p``: the mixture's own position: ``epoch`` (mixture epoch), ``offset`` (draws in it),
  ``consumed`` (samples it yielded), ``epoch_start``, ``slots`` = per source (the source epoch being
  read, 1 if the source ended during this mixture epoch), and the transform's carry (``extra``);
* entry ``p + (i + 1) * 2**32``: source i's own state of partition p (``ResumableStream.partition_state``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import torch.utils.data

from .checks import check_fingerprint, check_topology
from .config import MixtureConfig, StreamConfig
from .errors import ConfigError, SidecarError, SourceError, StreamMismatchError
from .plan import check_consumers, counter_hashes, derive_seed, partition_lanes
from .relocation import describe_files
from .sidecar import (
    CURSOR_FIELDS,
    ENTRY_STRIDE,
    FORMAT_VERSION,
    partition_progress,
    progress_summary,
)
from .source import Source, open_source
from .stream import ResumableStream, SidecarMixin, resolve_topology, round_robin

TAG_MIXTURE = 101          # domain tag of the draw seeds (plan.py's tags are small integers)
SOURCE_STRIDE = ENTRY_STRIDE    # sidecar entry of source i, partition p: p + (i + 1) * SOURCE_STRIDE
DRAW_BLOCK = 4096          # draws computed at once
MAX_EMPTY_EPOCHS = 16      # a source partition that yields nothing this many epochs in a row is an error


def draw_sources(probabilities: np.ndarray, seed: int, epoch: int, partition: int, start: int,
                 count: int) -> np.ndarray:
    """The sources of draws ``start .. start+count-1`` of (partition, epoch): a pure function of its arguments."""
    key = derive_seed(TAG_MIXTURE, seed, epoch, partition)
    bits = counter_hashes(key, start, count)
    uniform = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    picks = np.searchsorted(np.cumsum(probabilities), uniform, side="right")
    return np.minimum(picks, len(probabilities) - 1)


@dataclass
class _Position:
    """Where one mixture partition stands, apart from the sources' own cursors."""

    source_epochs: list[int]          # per source: the epoch being read
    ended: list[bool]                 # per source: ended during this mixture epoch (all_exhausted)
    epoch: int = 0                    # mixture epoch
    k: int = 0                        # draws made (= samples yielded) in this mixture epoch
    consumed: int = 0                 # samples yielded, all epochs
    iters: list = field(default_factory=list, repr=False)   # live source iterators (not state)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "k": self.k, "consumed": self.consumed,
                "source_epochs": list(self.source_epochs), "ended": list(self.ended)}


class MixtureSources:
    """``stream.source`` of a mixture: the columns every source has, the sources' cache statistics summed."""

    def __init__(self, sources: list[Source], labels: tuple[str, ...]):
        self.sources, self.labels = sources, labels

    @property
    def column_names(self) -> list[str] | None:
        """The columns of the first source that every source has (None if a source's are unknown)."""
        names = [s.column_names for s in self.sources]
        if any(n is None for n in names):
            return None
        return [c for c in names[0] if all(c in n for n in names[1:])]

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {label: s.fingerprint for label, s in zip(self.labels, self.sources)}

    def stats(self) -> dict[str, Any]:
        """Block cache counters summed over the sources (one cache directory: its size counted once)."""
        total: dict[str, Any] = {}
        for s in self.sources:
            for key, value in s.stats().items():
                if key in ("hit_rate",) or value is None:
                    continue
                if key in ("cache_bytes", "size_limit_bytes"):
                    total[key] = max(total.get(key) or 0, value)
                else:
                    total[key] = total.get(key, 0) + value
        lookups = total.get("hits", 0) + total.get("misses", 0)
        total["hit_rate"] = round(total["hits"] / lookups, 4) if lookups else None
        total.setdefault("cache_bytes", None)
        return total


def _digest(values: list) -> str:
    return hashlib.blake2b(json.dumps(values).encode(), digest_size=16).hexdigest()


def source_entry(partition: int, source: int) -> int:
    """Sidecar entry id of ``source``'s state of mixture partition ``partition``."""
    return partition + (source + 1) * SOURCE_STRIDE


def split_state(partitions: dict, num_sources: int, where: str) -> dict[int, dict[str, Any]]:
    """A mixture's flat sidecar entries -> {p: {"entry": mixture entry, "sources": [source states]}}."""
    out: dict[int, dict[str, Any]] = {}
    for fid, ps in partitions.items():
        fid = int(fid)
        p, slot = fid % SOURCE_STRIDE, fid // SOURCE_STRIDE
        if slot > num_sources:
            raise StreamMismatchError(f"{where}: has an entry for source {slot - 1} of partition {p}; this mixture "
                                      f"has {num_sources} sources")
        part = out.setdefault(p, {"entry": None, "sources": [None] * num_sources})
        if slot == 0:
            part["entry"] = ps
        else:
            part["sources"][slot - 1] = ps
    for p, part in out.items():
        if part["entry"] is None or any(s is None for s in part["sources"]) \
                or len(part["entry"]["slots"]) != num_sources:
            raise SidecarError(f"{where}: partition {p} is not a complete mixture state for {num_sources} sources")
    return out


def source_counts(state: dict[str, Any]) -> dict[str, int]:
    """Samples each source contributed, summed over the partitions of a mixture state (sidecar form)."""
    labels = state["fingerprint"]["mixture"]["labels"]
    counts = dict.fromkeys(labels, 0)
    for fid, ps in state["partitions"].items():
        slot = int(fid) // SOURCE_STRIDE
        if slot:
            counts[labels[slot - 1]] += int(ps["consumed"])
    return counts


class MixtureStream(SidecarMixin, torch.utils.data.IterableDataset):
    """A weighted mixture of several datasets with the interface of :class:`ResumableStream`.

    ``sources``: already opened sources, one per ``config.sources`` (tests and benchmarks share them).
    """

    def __init__(self, config: MixtureConfig, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, sources: list[Source] | None = None):
        super().__init__()
        self._track_worker_reads()
        if not isinstance(config, MixtureConfig):
            raise ConfigError(f"config: got {type(config).__name__}; allowed: a MixtureConfig")
        rank, world_size = resolve_topology(rank, world_size, num_workers)
        if sources is not None and len(sources) != len(config.sources):
            raise ConfigError(f"sources: got {len(sources)} opened sources for {len(config.sources)} in the config")
        self.config, self.rank, self.world_size, self.num_workers = config, rank, world_size, num_workers
        opened = []
        for i, scfg in enumerate(config.sources):
            src = sources[i] if sources is not None else open_source(scfg)
            if scfg.cache_dir and not getattr(src, "is_cached", False):
                from .cache import CachedSource

                src = CachedSource(src, scfg)
            opened.append(src)
        self.source = MixtureSources(opened, config.labels)
        self._probabilities = np.asarray(config.probabilities, dtype=np.float64)
        self._epoch_limit: int | None = None
        self.transform_fingerprint: dict | None = None   # set by the loader when a transform follows
        self._set_partitions(config.num_partitions or world_size * max(1, num_workers))
        if config.resume_state_path:
            self.load_sidecar(config.resume_state_path)

    def _view(self, i: int, partition: int, num_partitions: int) -> ResumableStream:
        """Source i's partition ``partition`` alone: a stream of one of ``num_partitions`` consumers. Its
        epoch limit (``set_epoch``) concerns that partition only, so each mixture partition ends a source's
        epoch without reading into the next one."""
        scfg: StreamConfig = self.config.sources[i].replace(num_partitions=num_partitions)
        return ResumableStream(scfg, rank=partition, world_size=num_partitions, num_workers=0,
                               source=self.source.sources[i])

    def _set_partitions(self, num_partitions: int, key: str = "data.num_partitions") -> None:
        slots = max(1, self.num_workers)
        check_consumers(num_partitions, self.world_size, slots, key)
        self.num_partitions = num_partitions
        self.lanes = partition_lanes(num_partitions, self.world_size, slots, self.rank)
        self.partitions = sorted(p for lane in self.lanes for p in lane)
        n = len(self.config.sources)
        self._views = [{p: self._view(i, p, num_partitions) for p in self.partitions} for i in range(n)]
        self._pos = {p: _Position([0] * n, [False] * n, iters=[None] * n) for p in self.partitions}
        self._turn = 0

    def close(self) -> None:
        """Close every source's open shards (see ResumableStream.close)."""
        for views in self._views:
            for view in views.values():
                view.close()

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        c = self.config
        fp: dict[str, Any] = {
            "mixture": {"labels": list(c.labels), "stopping": c.stopping, "seed": c.shuffle_seed},
            "sources": {label: {"weight": w, **next(iter(views.values())).fingerprint()}
                        for label, w, views in zip(c.labels, c.probabilities, self._views)},
        }
        if self.transform_fingerprint is not None:
            fp["transform"] = self.transform_fingerprint
        return fp

    def topology(self) -> dict[str, int]:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers,
                "num_partitions": self.num_partitions}

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Iterate mixture epoch ``epoch`` only: continue it where a partition is inside it, else start it
        (the sources continue where they are)."""
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ConfigError(f"epoch: got {epoch!r}; allowed: an integer >= 0")
        if self.config.stopping == "never":
            raise ConfigError("set_epoch: data.stopping is 'never', an endless mixture without epochs; use "
                              "first_exhausted or all_exhausted to iterate mixture epochs")
        self._epoch_limit = epoch
        for pos in self._pos.values():
            if pos.epoch < epoch:
                pos.epoch, pos.k, pos.ended = epoch, 0, [False] * len(pos.ended)

    def partition_epoch(self, partition: int) -> int:
        """The mixture epoch of ``partition``; with ``stopping: never`` the epoch every source has reached."""
        pos = self._pos[partition]
        return min(pos.source_epochs) if self.config.stopping == "never" else pos.epoch

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict]:
        self._note_worker_read()
        info = torch.utils.data.get_worker_info()
        if info is None:
            parts = self.partitions
        else:
            if info.num_workers != max(1, self.num_workers) or self.num_workers == 0:
                raise ConfigError(
                    f"num_workers: the stream was created for {self.num_workers} DataLoader workers but is read by "
                    f"{info.num_workers}; create it with num_workers={info.num_workers}")
            parts = self.lanes[info.id]
        if len(parts) == 1:
            return map(itemgetter(1), self._draw(parts[0]))
        return self._iter_round_robin(parts, saved_turn=info is None)

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, tuple[str, int]]]:
        """(sample, ("label/shard", row)) pairs of one partition: what the loader's workers read."""
        labels = self.config.labels
        for i, sample, (shard, row) in self._draw(partition):
            yield sample, (f"{labels[i]}/{shard}", row)

    @staticmethod
    def source_label(where: tuple[str, int]) -> str:
        """The label of the source a sample came from, given its ``where`` from :meth:`iter_partition`."""
        return where[0].split("/", 1)[0]

    def _draw(self, p: int) -> Iterator[tuple[int, dict, tuple[int, int]]]:
        """(source, sample, (shard, row)) of partition p, draw after draw."""
        pos, views = self._pos[p], [v[p] for v in self._views]
        n, stopping = len(views), self.config.stopping
        block: list[int] = []
        block_at = (-1, 0)        # the draws in ``block``: (epoch, from k)
        empty, got = [0] * n, [False] * n
        while True:
            if self._epoch_limit is not None and pos.epoch > self._epoch_limit:
                return
            j = pos.k - block_at[1]
            if block_at[0] != pos.epoch or not 0 <= j < len(block):
                block = draw_sources(self._probabilities, self.config.shuffle_seed, pos.epoch, p, pos.k,
                                     DRAW_BLOCK).tolist()
                block_at, j = (pos.epoch, pos.k), 0
            i = block[j]
            it = pos.iters[i]
            if it is None:    # read source i's current epoch only: its end must not consume the next epoch
                views[i].set_epoch(pos.source_epochs[i])
                it = pos.iters[i] = views[i].iter_partition(p)
                got[i] = False
            try:
                sample, where = next(it)
            except StopIteration:     # source i ended its epoch in this partition
                pos.iters[i] = None
                empty[i] = 0 if got[i] else empty[i] + 1
                if empty[i] >= MAX_EMPTY_EPOCHS:
                    raise SourceError(
                        f"data.sources[{i}] ({self.config.labels[i]!r}): partition {p} of {self.num_partitions} got "
                        f"no rows in {empty[i]} epochs in a row; the source has too few rows or shards for this "
                        "many partitions, or its files are empty") from None
                pos.source_epochs[i] += 1
                if stopping == "first_exhausted":
                    pos.epoch, pos.k = pos.epoch + 1, 0
                elif stopping == "all_exhausted":
                    pos.ended[i] = True
                    if all(pos.ended):
                        pos.epoch, pos.k, pos.ended = pos.epoch + 1, 0, [False] * n
                continue
            got[i] = True
            pos.k += 1
            pos.consumed += 1       # consumed once handed out: a save now resumes after it
            yield i, sample, where

    def _iter_round_robin(self, parts: list[int], saved_turn: bool) -> Iterator[dict]:
        """Sample by sample over ``parts``; in the main process the turn is part of the saved state."""
        live = {p: (item[1] for item in self._draw(p)) for p in parts}
        return round_robin(self, live, parts, saved_turn)

    # ------------------------------------------------------------------ state
    def partition_state(self, partition: int) -> dict[str, Any]:
        """One partition's position after the last sample it yielded: its own and every source's."""
        sources = []
        for i, views in enumerate(self._views):
            try:
                sources.append(views[partition].partition_state(partition))
            except SourceError as e:      # e.g. a source with no rows: say which one
                raise SourceError(f"data.sources[{i}] ({self.config.labels[i]!r}): {e}") from e
        return {"mixture": self._pos[partition].to_dict(), "sources": sources}

    def state_dict(self, partitions: dict[int, dict] | None = None) -> dict[str, Any]:
        """The position after the last sample this stream yielded, as flat sidecar entries (module doc).

        ``partitions`` replaces the per-partition states (the loader passes what training consumed)."""
        if partitions is None:
            self._check_not_read_by_workers()
        flat: dict[int, dict] = {}
        for p in self.partitions:
            ps = (partitions or {}).get(p) or self.partition_state(p)
            flat[p] = _mixture_entry(ps)
            for i, sps in enumerate(ps["sources"]):
                flat[source_entry(p, i)] = sps
        return {"format_version": FORMAT_VERSION, "fingerprint": self.fingerprint(), "topology": self.topology(),
                "turn": self._turn, "partitions": flat}

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None:
        """Continue every partition of this rank from its saved position (after an elastic change of
        ranks or workers, from the state :meth:`read_sidecar` gathered)."""
        if state.get("format_version") != FORMAT_VERSION:
            raise StreamMismatchError(f"{where}: format version {state.get('format_version')!r}, expected "
                                      f"{FORMAT_VERSION}")
        self._read_by_workers.value = 0   # the position is the loaded one again
        self._check_saved_fingerprint(state, where)
        same = self._adopt_topology(state["topology"], where)
        labels = self.config.labels
        parts = split_state(state["partitions"], len(labels), where)
        if same and sorted(parts) != self.partitions:
            raise StreamMismatchError(f"{where}: holds partitions {sorted(parts)}, this rank owns {self.partitions}")
        missing = [p for p in self.partitions if p not in parts]
        if missing:
            raise StreamMismatchError(f"{where}: holds partitions {sorted(parts)}, this rank reads {self.partitions} "
                                      "after the topology change; load a stream_state or checkpoint directory so "
                                      "they are gathered from every rank's file")
        for p in self.partitions:
            for i, label in enumerate(labels):
                view = self._views[i][p]
                view.set_endless()       # the source epoch to read is set again when the view is next iterated
                view.load_state_dict({"format_version": FORMAT_VERSION, "fingerprint": view.fingerprint(),
                                      "topology": view.topology(), "turn": 0,
                                      "partitions": {p: parts[p]["sources"][i]}}, where=f"{where}, source {label!r}")
            entry, pos = parts[p]["entry"], self._pos[p]
            pos.epoch, pos.k, pos.consumed = int(entry["epoch"]), int(entry["offset"]), int(entry["consumed"])
            pos.source_epochs = [int(a) for a, _ in entry["slots"]]
            pos.ended = [bool(b) for _, b in entry["slots"]]
            pos.iters = [None] * len(labels)
        self._turn = int(state.get("turn", 0)) if same else 0
        if self._epoch_limit is not None:     # set_epoch before the load: apply it to the loaded positions
            self.set_epoch(self._epoch_limit)

    def _check_saved_fingerprint(self, state: dict[str, Any], where: str) -> None:
        saved = state["fingerprint"]
        if "mixture" not in saved:
            raise StreamMismatchError(
                f"{where}: the saved state is a single dataset's; this stream is a mixture of "
                f"{', '.join(self.config.labels)} (data.sources). Resume with the data section it was written for",
                [("data.sources", None, list(self.config.labels))])
        if self.transform_fingerprint is None and "transform" in saved:
            saved = {k: v for k, v in saved.items() if k != "transform"}   # a bare stream (peek) reads raw samples
        check_fingerprint(saved, self.fingerprint(), where)

    def _adopt_topology(self, saved: dict[str, Any], where: str) -> bool:
        """As ``ResumableStream``: check the saved topology, take its num_partitions when data.num_partitions
        is null; True when ranks and workers are unchanged."""
        configured = self.config.num_partitions is not None
        same = check_topology(saved, self.topology(), where, elastic=self.config.elastic,
                              compare_partitions=configured)
        saved_n = int(saved["num_partitions"])
        if saved_n != self.num_partitions:
            self._set_partitions(saved_n, key=f"{where}: num_partitions (taken from the saved state because "
                                              "data.num_partitions is null)")
        return same

    def _entry_partition(self, entry: int) -> int:
        return entry % SOURCE_STRIDE     # source i's entry of partition p is p + (i + 1) * SOURCE_STRIDE


def _mixture_entry(ps: dict[str, Any]) -> dict[str, Any]:
    """A partition's own position as a sidecar entry (see the module doc)."""
    m = ps["mixture"]
    start = m["consumed"] - m["k"]
    entry: dict[str, Any] = dict.fromkeys(CURSOR_FIELDS, 0)
    entry.update(epoch=m["epoch"], offset=m["k"], consumed_before=start)
    entry.update(slots=[(e, int(d)) for e, d in zip(m["source_epochs"], m["ended"])], chain=bytes(16).hex(),
                 consumed=m["consumed"], consumed_digest=_digest([s["consumed_digest"] for s in ps["sources"]]),
                 next_sample_digest="", epoch_start=start, epoch_rows=None)
    if ps.get("extra") is not None:
        entry["extra"] = ps["extra"]
    return entry


def describe_state(state: dict[str, Any], full: bool = False) -> dict[str, Any]:
    """A mixture state (sidecar form) for ``resumable-stream inspect``: per partition the mixture epoch,
    per source its settings, samples consumed and per partition its epoch and the fraction of it consumed."""
    fp = state["fingerprint"]
    mix = fp["mixture"]
    labels = mix["labels"]
    parts = split_state(state["partitions"], len(labels), "stream state")
    partitions = {}
    for p, part in sorted(parts.items()):
        e = part["entry"]
        partitions[str(p)] = {"mixture_epoch": e["epoch"], "draws_in_epoch": e["offset"],
                              "consumed_samples": e["consumed"],
                              "source_epochs": {label: a for label, (a, _) in zip(labels, e["slots"])},
                              "ended_this_epoch": [label for label, (_, b) in zip(labels, e["slots"]) if b]}
    sources = {}
    for i, label in enumerate(labels):
        sfp = fp["sources"][label]
        ds = sfp.get("dataset", {})
        per = {str(p): {**partition_progress(part["sources"][i]), "consumed_samples": part["sources"][i]["consumed"],
                        "window": part["sources"][i]["window"], "offset_in_window": part["sources"][i]["offset"],
                        "next_sample_digest": part["sources"][i]["next_sample_digest"]}
               for p, part in sorted(parts.items())}
        sources[label] = {"weight": sfp["weight"], "dataset": {k: v for k, v in ds.items() if k != "files"},
                          "files": describe_files(ds.get("files", []), full), "order": sfp.get("order"),
                          "consumed_samples": sum(part["sources"][i]["consumed"] for part in parts.values()),
                          "progress": progress_summary([partition_progress(part["sources"][i])
                                                        for part in parts.values()]),
                          "partitions": per}
    return {"format_version": state["format_version"], "topology": state["topology"],
            "mixture": {"stopping": mix["stopping"], "seed": mix["seed"], "labels": labels},
            "partitions": partitions, "sources": sources}


def mixture_progress(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every rank's state of a checkpoint: samples consumed per source and each source's progress
    through its epochs (min / max / mean over partitions), for ``inspect``."""
    labels = states[0]["fingerprint"]["mixture"]["labels"]
    per_source: dict[int, list[dict]] = {i: [] for i in range(len(labels))}
    mixture_epochs = []
    for st in states:
        for part in split_state(st["partitions"], len(labels), "stream state").values():
            mixture_epochs.append(part["entry"]["epoch"])
            for i, ps in enumerate(part["sources"]):
                per_source[i].append(ps)
    return {"partitions": len(mixture_epochs),
            "mixture_epoch": {"min": min(mixture_epochs), "max": max(mixture_epochs)} if mixture_epochs else None,
            "sources": {label: {"consumed_samples": sum(ps["consumed"] for ps in per_source[i]),
                                **progress_summary([partition_progress(ps) for ps in per_source[i]])}
                        for i, label in enumerate(labels)}}


def open_stream(config: StreamConfig | MixtureConfig, rank: int | None = None, world_size: int | None = None,
                num_workers: int = 0, index_from: str | None = None) -> ResumableStream | MixtureStream:
    """A :class:`MixtureStream` for a config with ``sources``, else a :class:`ResumableStream`.
    ``index_from``: a checkpoint to be resumed whose saved dataset index a single stream reuses."""
    if isinstance(config, MixtureConfig):
        return MixtureStream(config, rank=rank, world_size=world_size, num_workers=num_workers)
    return ResumableStream(config, rank=rank, world_size=world_size, num_workers=num_workers,
                           index_from=index_from)
