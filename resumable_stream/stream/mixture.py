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

A mixture's state (``kind: "mixture"`` in the sidecar) holds per partition a
:class:`~resumable_stream.state.mixture_state.MixturePartitionState`: ``epoch`` (mixture epoch), ``draws`` (draws
made in it), ``consumed`` (samples it yielded), per source ``source_epochs`` (the epoch being read) and
``ended`` (it ended during this mixture epoch), each source's state (that of
:meth:`ResumableStream.partition_state`) and the transform's carry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from ..cache.cached_source import with_block_cache
from ..config.stream_config import MixtureConfig, StreamConfig
from ..dataset.job_source import open_job_sources
from ..errors import ConfigError, SidecarError, SourceError, StreamMismatchError
from ..observe.progress import partition_progress, progress_summary
from ..plan import counter_hashes, derive_seed
from ..sources.base import Source
from ..state.mixture_state import MixturePartitionState
from ..state.relocation import describe_files
from .base import StreamBase, order_settings
from .datasets_draws import MODES as DATASETS_MODES
from .datasets_draws import DatasetsDraws
from .partition import MAX_EMPTY_EPOCHS
from .single import ResumableStream

TAG_MIXTURE = 101          # domain tag of the draw seeds (plan.py's tags are small integers)
DRAW_BLOCK = 4096          # draws computed at once


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
    draws: int = 0                    # draws made (= samples yielded) in this mixture epoch
    consumed: int = 0                 # samples yielded, all epochs
    iters: list = field(default_factory=list, repr=False)   # live source iterators (not state)


class MixtureSources:
    """``stream.source`` of a mixture: the columns every source has, the sources' cache statistics summed."""

    index = None          # no single dataset index (each source reads its own)

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

    @property
    def indexes(self) -> dict[str, dict]:
        """label -> dataset index of each indexed source (saved with checkpoints, one file per source)."""
        return {label: s.index for label, s in zip(self.labels, self.sources) if s.index is not None}

    def stats(self) -> dict[str, Any] | None:
        """Block cache counters summed over the sources (one cache directory: its size counted once); None
        when they are not behind a cache (``Source.stats``)."""
        each = [s.stats() for s in self.sources]
        if any(stats is None for stats in each):
            return None
        total: dict[str, Any] = {}
        for stats in each:
            for key, value in stats.items():
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


def source_counts(state: dict[str, Any]) -> dict[str, int]:
    """Samples each source contributed, summed over the partitions of a mixture state."""
    labels = state["fingerprint"]["mixture"]["labels"]
    return {label: sum(int(ps["sources"][i]["consumed"]) for ps in state["partitions"].values())
            for i, label in enumerate(labels)}


class MixtureStream(StreamBase):
    """A weighted mixture of several datasets with the interface of :class:`ResumableStream`.

    ``sources``: already opened sources, one per ``config.sources`` (tests and benchmarks share them).
    """

    kind = "mixture"
    state_type = MixturePartitionState

    def __init__(self, config: MixtureConfig, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, sources: list[Source] | None = None, index_from: str | None = None,
                 draws: str = "hash"):
        if not isinstance(config, MixtureConfig):
            raise ConfigError(f"config: got {type(config).__name__}; allowed: a MixtureConfig")
        if draws not in ("hash", *DATASETS_MODES):
            raise ConfigError(f"draws: got {draws!r}; allowed: hash, {', '.join(DATASETS_MODES)}")
        # draws: our counter-based hash, or datasets.interleave_datasets' sequence (datasets_draws.py)
        self.draws = draws
        self._datasets_draws = (DatasetsDraws(draws, config.weights, config.shuffle_seed) if draws != "hash"
                                else None)
        if sources is not None and len(sources) != len(config.sources):
            raise ConfigError(f"sources: got {len(sources)} opened sources for {len(config.sources)} in the config")
        super().__init__(config, rank, world_size, num_workers)
        # each source opened once per process (every partition's view reads it) and resolved once per job;
        # index_from: a checkpoint about to be resumed, whose saved indexes may be reused
        if sources is None:
            agree = {"data.sources.weights": list(config.weights), "data.stopping": config.stopping}
            for label, scfg in zip(config.labels, config.sources):
                agree.update(order_settings(scfg, f"data.sources[{label}]."))
            sources = open_job_sources([s.source_spec for s in config.sources], list(config.labels), self.rank,
                                       self.world_size, index_from or config.resume_state_path, agree)
        opened = [with_block_cache(src, scfg.cache_spec) for src, scfg in zip(sources, config.sources)]
        self.source = MixtureSources(opened, config.labels)
        self._probabilities = np.asarray(config.probabilities, dtype=np.float64)
        self._start()

    def _view(self, i: int, partition: int) -> ResumableStream:
        """Source i's partition ``partition`` alone: a stream of one of ``num_partitions`` consumers. Its
        epoch limit (``set_epoch``) concerns that partition only, so each mixture partition ends a source's
        epoch without reading into the next one."""
        scfg: StreamConfig = self.config.sources[i].replace(num_partitions=self.num_partitions)
        return ResumableStream(scfg, rank=partition, world_size=self.num_partitions, num_workers=0,
                               source=self.source.sources[i])

    def _build_readers(self) -> None:
        n = len(self.config.sources)
        self._views = [{p: self._view(i, p) for p in self.partitions} for i in range(n)]
        self._pos = {p: _Position([0] * n, [False] * n, iters=[None] * n) for p in self.partitions}

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
        if self.draws != "hash":        # only then: the fingerprints of hash mixtures stay as they were
            fp["mixture"]["draws"] = self.draws
        if self.transform_fingerprint is not None:
            fp["transform"] = self.transform_fingerprint
        return fp

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
                pos.epoch, pos.draws, pos.ended = epoch, 0, [False] * len(pos.ended)

    def partition_epoch(self, partition: int) -> int:
        """The mixture epoch of ``partition``; with ``stopping: never`` the epoch every source has reached."""
        pos = self._pos[partition]
        return min(pos.source_epochs) if self.config.stopping == "never" else pos.epoch

    # ------------------------------------------------------------------ data.growth
    def refresh_files(self) -> dict[str, int] | None:
        """Take in the files that appeared in each growing source (``data.growth: append``) while the job runs,
        each source on its own: its new files join from the epoch after the furthest one of that source any
        partition of the job has begun (a mixture partition reads each source's epochs at its own pace).
        Collective, as ``ResumableStream.refresh_files`` (every rank calls it at the same point, no DataLoader
        workers). Returns ``{label: epoch they join at}`` for the sources that grew, or None."""
        from ..dataset.growth import refresh
        from ..sources.open import open_source

        joins: dict[str, int] = {}
        for i, (scfg, label) in enumerate(zip(self.config.sources, self.config.labels)):
            if scfg.growth == "off":
                continue
            views = self._views[i]
            furthest = max((max(self._pos[p].source_epochs[i], views[p].partition_epoch(p)) for p in self.partitions),
                           default=0)
            try:
                index = refresh(scfg.source_spec, self.source.sources[i].index, furthest, self.rank, self.world_size,
                                self.num_workers)
            except StreamMismatchError as e:
                raise StreamMismatchError(f"data.sources[{i}] ({label!r}): {e}", e.differences) from e
            if index is None:
                continue
            # one source over the grown index for every partition's view (they share it, as at the start)
            source = with_block_cache(open_source(scfg.source_spec, index=index), scfg.cache_spec)
            for view in views.values():
                joins[label] = view.adopt_index(index, source)
            self.source.sources[i] = source
        return joins or None

    # ------------------------------------------------------------------ iteration
    def _samples(self, partition: int) -> Iterator[dict]:
        return map(itemgetter(1), self._draw(partition))

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, tuple[str, int]]]:
        """(sample, ("label/shard", row)) pairs of one partition: what the loader's workers read."""
        labels = self.config.labels
        for i, sample, (shard, row) in self._draw(partition):
            yield sample, (f"{labels[i]}/{shard}", row)

    def current_weights(self) -> dict[str, float]:
        """The target weights of the next draw, by source label (normalised to sum to 1)."""
        return {label: float(w) for label, w in zip(self.config.labels, self._probabilities)}

    def source_label(self, where: tuple[str, int]) -> str:
        """The label of the source a sample came from, given its ``where`` from :meth:`iter_partition`."""
        return where[0].split("/", 1)[0]

    def _draw(self, p: int) -> Iterator[tuple[int, dict, tuple[int, int]]]:
        """(source, sample, (shard, row)) of partition p, draw after draw."""
        pos, views = self._pos[p], [v[p] for v in self._views]
        n, stopping = len(views), self.config.stopping
        block: list[int] = []
        block_at = (-1, 0)        # the draws in ``block``: (epoch, first draw)
        empty, got = [0] * n, [False] * n
        while True:
            if self._epoch_limit is not None and pos.epoch > self._epoch_limit:
                return
            j = pos.draws - block_at[1]
            if block_at[0] != pos.epoch or not 0 <= j < len(block):
                if self._datasets_draws is not None:
                    first, block = self._datasets_draws.block(pos.epoch, p, pos.draws)
                    block_at, j = (pos.epoch, first), pos.draws - first
                else:
                    block = draw_sources(self._probabilities, self.config.shuffle_seed, pos.epoch, p, pos.draws,
                                         DRAW_BLOCK).tolist()
                    block_at, j = (pos.epoch, pos.draws), 0
            i = block[j]
            it = pos.iters[i]
            if it is None:    # read source i's current epoch only: its end must not consume the next epoch
                views[i].set_epoch(pos.source_epochs[i])
                it = pos.iters[i] = views[i].iter_partition(p)
                got[i] = False
            try:
                sample, where = next(it)
            except StreamMismatchError as e:     # e.g. a file changed under the run: say whose
                raise StreamMismatchError(f"data.sources[{i}] ({self.config.labels[i]!r}): {e}", e.differences) from e
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
                    pos.epoch, pos.draws = pos.epoch + 1, 0
                elif stopping == "all_exhausted":
                    pos.ended[i] = True
                    if all(pos.ended):
                        pos.epoch, pos.draws, pos.ended = pos.epoch + 1, 0, [False] * n
                continue
            got[i] = True
            pos.draws += 1
            pos.consumed += 1       # consumed once handed out: a save now resumes after it
            yield i, sample, where

    # ------------------------------------------------------------------ state
    def partition_state(self, partition: int) -> MixturePartitionState:
        """One partition's position after the last sample it yielded: its own and every source's."""
        sources = []
        for i, views in enumerate(self._views):
            try:
                sources.append(views[partition].partition_state(partition))
            except SourceError as e:      # e.g. a source with no rows: say which one
                raise SourceError(f"data.sources[{i}] ({self.config.labels[i]!r}): {e}") from e
        pos = self._pos[partition]
        return MixturePartitionState(pos.epoch, pos.draws, pos.consumed, list(pos.source_epochs), list(pos.ended),
                                     sources)

    def partition_position(self, partition: int) -> float | None:
        """The mean of the sources' positions in ``partition`` (see ``ResumableStream.partition_position``; any
        thread)."""
        known = [x for x in (views[partition].partition_position(partition) for views in self._views
                             if partition in views) if x is not None]
        return sum(known) / len(known) if known else None

    def _restore_partition(self, p: int, ps: MixturePartitionState, where: str, verify_next_sample: bool) -> None:
        """Continue partition ``p``: each source's view from its cursor, the draws from the saved position."""
        labels = self.config.labels
        if len(ps.sources) != len(labels):
            raise SidecarError(f"{where}: partition {p}: the state of {len(ps.sources)} sources; this mixture has "
                               f"{len(labels)} ({', '.join(labels)})")
        for i, label in enumerate(labels):
            view = self._views[i][p]
            view.set_endless()       # the source epoch to read is set again when the view is next iterated
            state = {**view.state_dict({p: ps.sources[i]}), "turn": 0}
            view.load_state_dict(state, where=f"{where}, source {label!r}", verify_next_sample=verify_next_sample)
        pos = self._pos[p]
        pos.epoch, pos.draws, pos.consumed = ps.epoch, ps.draws, ps.consumed
        pos.source_epochs, pos.ended = list(ps.source_epochs), list(ps.ended)
        pos.iters = [None] * len(labels)


def describe_state(state: dict[str, Any], full: bool = False) -> dict[str, Any]:
    """A mixture state for ``resumable-stream inspect``: per partition the mixture epoch, per source its
    settings, samples consumed and per partition its epoch and the fraction of it consumed."""
    fp = state["fingerprint"]
    mix = fp["mixture"]
    labels = mix["labels"]
    parts = sorted(state["partitions"].items())
    partitions = {}
    for p, ps in parts:
        m = ps["mixture"]
        partitions[str(p)] = {"mixture_epoch": m["epoch"], "draws_in_epoch": m["draws"],
                              "consumed_samples": m["consumed"],
                              "source_epochs": dict(zip(labels, m["source_epochs"])),
                              "ended_this_epoch": [label for label, b in zip(labels, m["ended"]) if b]}
    sources = {}
    for i, label in enumerate(labels):
        sfp = fp["sources"][label]
        ds = sfp.get("dataset", {})
        cursors = [(p, ps["sources"][i]) for p, ps in parts]
        per = {str(p): {**partition_progress(c), "consumed_samples": c["consumed"], "window": c["window"],
                        "offset_in_window": c["offset"], "next_sample_digest": c["next_sample_digest"]}
               for p, c in cursors}
        sources[label] = {"weight": sfp["weight"], "dataset": {k: v for k, v in ds.items() if k != "files"},
                          "files": describe_files(ds.get("files", []), full), "order": sfp.get("order"),
                          "consumed_samples": sum(c["consumed"] for _, c in cursors),
                          "progress": progress_summary([partition_progress(c) for _, c in cursors]),
                          "partitions": per}
    return {"format_version": state.get("file_format_version", state["format_version"]), "topology": state["topology"],
            "mixture": {"stopping": mix["stopping"], "seed": mix["seed"], "labels": labels},
            "partitions": partitions, "sources": sources}


def mixture_progress(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every rank's state of a checkpoint: samples consumed per source and each source's progress
    through its epochs (min / max / mean over partitions), for ``inspect``."""
    labels = states[0]["fingerprint"]["mixture"]["labels"]
    parts = [ps for st in states for ps in st["partitions"].values()]
    mixture_epochs = [ps["mixture"]["epoch"] for ps in parts]
    return {"partitions": len(parts),
            "mixture_epoch": {"min": min(mixture_epochs), "max": max(mixture_epochs)} if parts else None,
            "sources": {label: {"consumed_samples": sum(ps["sources"][i]["consumed"] for ps in parts),
                                **progress_summary([partition_progress(ps["sources"][i]) for ps in parts])}
                        for i, label in enumerate(labels)}}


def open_stream(config: StreamConfig | MixtureConfig, rank: int | None = None, world_size: int | None = None,
                num_workers: int = 0, index_from: str | None = None,
                mixture_draws: str = "hash") -> ResumableStream | MixtureStream:
    """The stream of a ``data:`` config: a :class:`MixtureStream` for one with ``sources``, else a
    :class:`ResumableStream`.

    Args:
        config: ``StreamConfig.from_yaml(...)``'s result.
        rank, world_size: this process among the job's (default: torch.distributed, else $RANK / $WORLD_SIZE).
        num_workers: the DataLoader workers the stream will be read with (0: the main process).
        index_from: a checkpoint about to be resumed, whose saved dataset indexes the stream reuses (nothing
            is resolved again); the position itself is restored by ``load_sidecar`` / a loader.
        mixture_draws: a mixture's draws: ``hash`` (ours), or ``datasets_cycle`` / ``datasets_choice``
            (``datasets.interleave_datasets``' sequence without / with probabilities; :mod:`.datasets_draws`).
    Returns:
        the stream, opened (the dataset resolved once per job) at its fresh position or at
        ``data.resume_state_path``'s.
    """
    if isinstance(config, MixtureConfig):
        return MixtureStream(config, rank=rank, world_size=world_size, num_workers=num_workers,
                             index_from=index_from, draws=mixture_draws)
    return ResumableStream(config, rank=rank, world_size=world_size, num_workers=num_workers,
                           index_from=index_from)
