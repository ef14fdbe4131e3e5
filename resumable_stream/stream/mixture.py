"""Weighted mixtures of datasets (``data.sources``) that resume exactly (docs/mixtures.md).

Mixture partition *p* reads partition *p* of every source, so it moves between ranks like a single stream's.
Its *k*-th draw of mixture epoch *e* takes the next sample of the source picked by a counter-based hash of
(seed, e, p, k) against the cumulative weights (or datasets' draws, :class:`.weights.DatasetsDraws`): the sampler has no
state but (e, k). ``stopping`` (``first_exhausted``, ``all_exhausted``, ``never``) says what a source's end does.
A partition's state is a :class:`~resumable_stream.state.partition_state.MixturePartitionState` that nests each
source's own state."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from operator import add, itemgetter
from typing import Any

from ..cache.cached_source import with_block_cache
from ..config.stream_config import MixtureConfig, StreamConfig, not_a_config
from ..config.weight_schedule import check_weights
from ..dataset.growth import refresh
from ..dataset.growth import resume as growth_after_resume
from ..dataset.job_source import open_job_sources
from ..errors import ConfigError, SidecarError, SourceError, StreamMismatchError
from ..observe.progress import partition_progress, progress_summary
from ..runtime.collectives import broadcast_bytes, shared_over_dist
from ..runtime.threads import OwnerThread
from ..sources.base import Source
from ..sources.index import check_resolution, decode_index
from ..sources.open import open_source
from ..state.checkpoint import SavedIndexes
from ..state.checks import check_fingerprint, fingerprint_diff
from ..state.partition_state import MixturePartitionState
from ..state.relocation import describe_files
from .base import StreamBase, order_settings
from .partition import MAX_EMPTY_EPOCHS
from .single import ResumableStream
from .weights import DATASETS_MODES, DatasetsDraws, Segment, WeightPlan, history_from_json, history_unit

DRAW_BLOCK = 4096          # draws computed at once


@dataclass
class _Position:
    """Where one mixture partition stands, apart from the sources' own cursors."""

    source_epochs: list[int]          # per source: the epoch being read
    ended: list[bool]                 # per source: ended during this mixture epoch (all_exhausted)
    epoch: int = 0                    # mixture epoch
    draws: int = 0                    # draws made (= samples yielded) in this mixture epoch
    consumed: int = 0                 # samples yielded, all epochs
    changes: list[int] = field(default_factory=list)    # where each weight history entry after the first starts
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
                if key != "hit_rate" and value is not None:     # the cache's sizes once, the counters summed
                    merge = max if key in ("cache_bytes", "size_limit_bytes") else add
                    total[key] = merge(total.get(key, 0), value)
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
            raise not_a_config(config, "a MixtureConfig")
        if draws not in ("hash", *DATASETS_MODES):
            raise ConfigError(f"draws: got {draws!r}; allowed: hash, {', '.join(DATASETS_MODES)}")
        # draws: our counter-based hash, or datasets.interleave_datasets' sequence (weights.DatasetsDraws)
        self.draws = draws
        if draws != "hash" and not all(isinstance(w, (int, float)) for w in config.weights):
            raise ConfigError(f"draws {draws!r} (datasets.interleave_datasets' own sequence) take fixed weights; got "
                              f"{list(config.weights)!r}; allowed: numbers, or schedules with draws 'hash'")
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
            resumed = index_from or config.resume_state_path
            sources = open_job_sources([s.source_spec for s in config.sources], list(config.labels), self.rank,
                                       self.world_size, SavedIndexes(resumed) if resumed else None, agree)
        opened = [with_block_cache(src, scfg.cache_spec) for src, scfg in zip(sources, config.sources)]
        self.source = MixtureSources(opened, config.labels)
        # the weight history (stream/weights.py): the configured weights from draw 0, then each change
        self._history: list[Segment] = [Segment(config.labels, config.weights)]
        self._history_version = 0           # bumped by every change: live draw blocks are recomputed
        self._plan: tuple[tuple, WeightPlan] | None = None
        self._samples_per_step: int | None = None
        self._retired: dict[str, dict] = {}   # label -> saved fingerprint of a source a change removed
        self._events: list[dict] = []        # changes of weights not yet logged (train_log.jsonl)
        self._owner = OwnerThread()          # the thread iterating: only it may call set_weights
        self._start()

    def _view(self, i: int, partition: int, num_partitions: int | None = None) -> ResumableStream:
        """Source i's partition ``partition`` alone (of ``num_partitions``, default this mixture's), whose epoch limit
        concerns that partition only (each mixture partition ends a source's epoch without reading into the next)."""
        n = num_partitions or self.num_partitions
        scfg: StreamConfig = self.config.sources[i].replace(num_partitions=n)
        return ResumableStream(scfg, rank=partition, world_size=n, num_workers=0, source=self.source.sources[i])

    def _build_readers(self) -> None:
        n = len(self.config.sources)
        self._views = [{p: self._view(i, p) for p in self.partitions} for i in range(n)]
        self._pos = {p: _Position([0] * n, [False] * n, changes=[0] * (len(self._history) - 1), iters=[None] * n)
                     for p in self.partitions}
        self._kept: dict[int, list] = {p: [] for p in self.partitions}   # per partition: removed sources' columns

    def close(self) -> None:
        """Close every source's open shards (see ResumableStream.close)."""
        for views in self._views:
            for view in views.values():
                view.close()

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        """Labels, stopping, seed, per source its weight (normalised when every weight is fixed, else as
        written), dataset and order; with a weight history that is more than the configured weights, the
        history (and samples_per_step for schedules in steps), and the sources a change removed."""
        c = self.config
        fixed = not any(isinstance(w, dict) for w in c.weights)
        weights = c.probabilities if fixed else c.weights
        fp: dict[str, Any] = {
            "mixture": {"labels": list(c.labels), "stopping": c.stopping, "seed": c.shuffle_seed},
            "sources": {label: {"weight": w, **next(iter(views.values())).fingerprint()}
                        for label, w, views in zip(c.labels, weights, self._views)},
        }
        if self.draws != "hash":        # only then: the fingerprints of hash mixtures stay as they were
            fp["mixture"]["draws"] = self.draws
        if self._history != [Segment(c.labels, c.weights)]:
            fp["mixture"]["history"] = [s.to_state() for s in self._history]
        if self._samples_per_step is not None and history_unit(self._history) == "steps":
            fp["mixture"]["samples_per_step"] = self._samples_per_step
        if self._retired:
            fp["mixture"]["retired"] = list(self._retired)
            fp["sources"].update(self._retired)
        if self.transform_fingerprint is not None:
            fp["transform"] = self.transform_fingerprint
        return fp

    # ------------------------------------------------------------------ weights
    def _weight_plan(self) -> WeightPlan:
        key = (self._history_version, self.num_partitions, self._samples_per_step)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, WeightPlan(self._history, self.config.labels, self.num_partitions,
                                          self._samples_per_step))
        return self._plan[1]

    def _refuse_changes_in_datasets_draws(self) -> None:
        """Before a change of weights: datasets' own sequences are of fixed probabilities (weights.DatasetsDraws)."""
        if self._datasets_draws is not None:
            raise ConfigError(f"mixture draws {self.draws!r} (datasets.interleave_datasets' own sequence, read in "
                              "file order: LLaMA-Factory's buffer_size 1) take fixed weights; got a change of "
                              "weights; allowed: changes of weights with shuffled reading (buffer_size > 1)")

    def _changed(self) -> None:
        self._history_version += 1
        self._fingerprint = None

    def set_samples_per_step(self, samples: int) -> None:
        """Samples of the whole job per optimizer step (batch x gradient accumulation x ranks): how schedules in
        steps map to draws (stream/weights.py). Fixed when the run starts; a resumed run keeps the saved one."""
        if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
            raise ConfigError(f"samples_per_step: got {samples!r}; allowed: an integer >= 1")
        if self._samples_per_step is None:
            self._samples_per_step = samples
            self._changed()

    def current_weights(self, partition: int | None = None,
                        state: MixturePartitionState | None = None) -> dict[str, float]:
        """label -> target weight (normalised) of the next draw of ``partition`` (default: this rank's first),
        from where its reader is, or from ``state`` (its state after what training consumed: the loader's)."""
        p = self.partitions[0] if partition is None else partition
        pos = state if state is not None else self._pos[p]
        got = self._weight_plan().weights_now(pos.consumed, pos.changes)
        return {label: got.get(label, 0.0) for label in self.config.labels}

    @property
    def weight_history(self) -> list[dict[str, Any]]:
        """The weight history entries (from, weights, step) in order (plain values)."""
        return [s.to_json() for s in self._history]

    def pop_weight_events(self) -> list[dict[str, Any]]:
        """Changes of weights made in this process since the last call (for train_log.jsonl)."""
        events, self._events = self._events, []
        return events

    def set_weights(self, weights: dict[str, Any], consumed: dict[int, MixturePartitionState] | None = None,
                    step: int | None = None) -> dict[int, MixturePartitionState]:
        """Draw with ``weights`` (label -> number or schedule) from each partition's next draw on, recorded in the
        weight history. ``consumed``: partition -> its state after what training consumed (the loader's), where the
        change starts instead (the others' starts where their reader is). Returns those states with the change
        recorded, for the loader to hold. Collective (rank 0's apply); only from the iterating thread."""
        self._owner.check("MixtureStream.set_weights", "stream")
        self._refuse_changes_in_datasets_draws()
        labels = self.config.labels
        if not isinstance(weights, dict) or sorted(weights) != sorted(labels):
            raise ConfigError(f"set_weights: got weights for {sorted(weights) if isinstance(weights, dict) else weights!r}; "
                              f"allowed: a mapping with a weight for every source: {', '.join(labels)}")
        values = check_weights([weights[label] for label in labels], list(labels),
                               lambda i: f"set_weights: weights[{labels[i]!r}]", allow_zero=True)
        if shared_over_dist(self.rank, self.world_size):     # one history on every rank
            mine = json.dumps(list(values)).encode() if self.rank == 0 else None
            values = tuple(json.loads(broadcast_bytes(mine)))
        self._history.append(Segment(labels, values, "set_weights", step))
        consumed = consumed or {}
        for p in self.partitions:
            pos = self._pos[p]
            pos.changes.append(consumed[p].consumed if p in consumed else pos.consumed)
        self._changed()
        self._events.append({"from": "set_weights", **({"step": step} if step is not None else {}),
                             "weights": dict(zip(labels, values))})
        return {p: replace(ps, changes=[*ps.changes, ps.consumed]) for p, ps in consumed.items()}

    def __iter__(self) -> Iterator[dict]:
        self._owner.claim()
        return super().__iter__()

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Iterate mixture epoch ``epoch`` only: continue it where a partition is inside it, else start it
        (the sources continue where they are; with datasets' draws they start from their first rows)."""
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ConfigError(f"epoch: got {epoch!r}; allowed: an integer >= 0")
        if self.config.stopping == "never":
            raise ConfigError("set_epoch: data.stopping is 'never', an endless mixture without epochs; use "
                              "first_exhausted or all_exhausted to iterate mixture epochs")
        self._epoch_limit = epoch
        for p, pos in self._pos.items():
            if pos.epoch < epoch:
                if self._restarts_epochs():     # datasets' epochs start every source from its first row
                    self._start_next_epoch(p)
                pos.epoch, pos.draws, pos.ended = epoch, 0, [False] * len(pos.ended)

    def partition_epoch(self, partition: int) -> int:
        """The mixture epoch of ``partition``; with ``stopping: never`` the epoch every source has reached."""
        pos = self._pos[partition]
        return min(pos.source_epochs) if self.config.stopping == "never" else pos.epoch

    # ------------------------------------------------------------------ data.growth
    def growing_indexes(self) -> dict[str | None, dict]:
        return {label: self.source.sources[i].index for i, (scfg, label) in enumerate(zip(self.config.sources,
                                                                                          self.config.labels))
                if scfg.growth != "off" and self.source.sources[i].index is not None}

    def adopt_saved_indexes(self, indexes: dict[str | None, bytes], state: dict[str, Any], where: str) -> None:
        """As ``ResumableStream.adopt_saved_indexes``, per growing source: each from the epoch after the furthest
        one of that source any partition of the state has begun."""
        saved_labels = list(state.get("fingerprint", {}).get("mixture", {}).get("labels") or [])
        for i, (scfg, label) in enumerate(zip(self.config.sources, self.config.labels)):
            if scfg.growth == "off" or label not in indexes:
                continue
            at = f"{where} (the dataset index of source {label!r} it carries)"
            saved = decode_index(indexes[label], at)
            check_resolution(saved, scfg.source_spec.data, at)
            j = saved_labels.index(label) if label in saved_labels else None
            furthest = max((max(int(ps["mixture"]["source_epochs"][j]), int(ps["sources"][j]["epoch"]))
                            for ps in state["partitions"].values()), default=0) if j is not None else 0
            self._adopt_index(i, growth_after_resume(scfg.source_spec, saved, furthest, self.rank, self.world_size, at))

    def _adopt_index(self, i: int, index: dict) -> int:
        """Source i over a grown ``index``: one source for every partition's view (they share it, as at the start);
        the epoch its new files join at."""
        scfg = self.config.sources[i]
        self.source.sources[i] = source = with_block_cache(open_source(scfg.source_spec, index=index), scfg.cache_spec)
        return min(view.adopt_index(index, source) for view in self._views[i].values())

    def refresh_files(self) -> dict[str, int] | None:
        """``ResumableStream.refresh_files`` per growing source (each joins after the furthest epoch of that source any
        partition began). Collective. Returns ``{label: epoch they join at}`` of the sources that grew, or None."""
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
            if index is not None:
                joins[label] = self._adopt_index(i, index)
        return joins or None

    # ------------------------------------------------------------------ iteration
    def _samples(self, partition: int) -> Iterator[dict]:
        return map(itemgetter(1), self._draw(partition))

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, tuple[str, int]]]:
        """(sample, ("label/shard", row)) pairs of one partition: what the loader's workers read."""
        labels = self.config.labels
        for i, sample, (shard, row) in self._draw(partition):
            yield sample, (f"{labels[i]}/{shard}", row)

    def source_label(self, where: tuple[str, int]) -> str:
        """The label of the source a sample came from, given its ``where`` from :meth:`iter_partition`."""
        return where[0].split("/", 1)[0]

    def _draw(self, p: int) -> Iterator[tuple[int, dict, tuple[int, int]]]:
        """(source, sample, (shard, row)) of partition p, draw after draw."""
        pos, views = self._pos[p], [v[p] for v in self._views]
        n, stopping = len(views), self.config.stopping
        block: list[int] = []
        block_at = (-1, 0)        # the draws in ``block``: (epoch, first draw)
        version = -1              # of the weight history the block was drawn with
        empty, got = [0] * n, [False] * n
        lookahead = self._restarts_epochs()
        ended_since = lookahead       # a source ended since the last look (or the state was just loaded)
        while True:
            if ended_since:           # the epoch ends after the last row of the source that ends it, as datasets'
                ended_since = False
                if self._epoch_over(pos):
                    self._start_next_epoch(p)
            if self._epoch_limit is not None and pos.epoch > self._epoch_limit:
                return
            j = pos.draws - block_at[1]
            if self._datasets_draws is not None:      # datasets' own sequence: fixed weights (checked)
                if block_at[0] != pos.epoch or not 0 <= j < len(block):
                    first, block = self._datasets_draws.block(pos.epoch, p, pos.draws)
                    block_at, j = (pos.epoch, first), pos.draws - first
            elif block_at[0] != pos.epoch or not 0 <= j < len(block) or version != self._history_version:
                plan, version = self._weight_plan(), self._history_version
                block = plan.picks(self.config.shuffle_seed, pos.epoch, p, pos.draws, pos.consumed, pos.changes,
                                   DRAW_BLOCK)
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
                if lookahead:        # (an epoch without rows) the loop's top ends the mixture epoch if it is over
                    pos.ended[i] = ended_since = True
                elif stopping == "first_exhausted":
                    pos.epoch, pos.draws = pos.epoch + 1, 0
                elif stopping == "all_exhausted":
                    pos.ended[i] = True
                    if self._epoch_over(pos):
                        pos.epoch, pos.draws, pos.ended = pos.epoch + 1, 0, [False] * n
                continue
            got[i] = True
            if lookahead and views[i].epoch_ended(p):     # that was its epoch's last row: datasets' look-ahead
                pos.iters[i] = None
                pos.source_epochs[i] += 1     # read from its first row when next drawn (all_exhausted)
                pos.ended[i] = ended_since = True
            pos.draws += 1
            pos.consumed += 1       # consumed once handed out: a save now resumes after it
            yield i, sample, where

    def _restarts_epochs(self) -> bool:
        """datasets' epochs (``datasets_*`` draws, not ``never``): the next mixture epoch starts every source from its
        first row (:meth:`_start_next_epoch`)."""
        return self._datasets_draws is not None and self.config.stopping != "never"

    def _epoch_over(self, pos: _Position) -> bool:
        """The sources that ended during the mixture epoch end it: one (first_exhausted) or all of them
        (all_exhausted; a source of weight 0 now is not drawn: the epoch does not wait for it)."""
        if self.config.stopping == "first_exhausted":
            return any(pos.ended)
        now = self._weight_plan().weights_now(pos.consumed, pos.changes)
        return all(e or now.get(label, 0.0) == 0 for e, label in zip(pos.ended, self.config.labels))

    def _start_next_epoch(self, p: int) -> None:
        """Start mixture epoch + 1 of partition ``p`` as datasets does: every source that read rows moves to its next
        epoch's start; new draws."""
        pos = self._pos[p]
        pos.epoch, pos.draws, pos.ended = pos.epoch + 1, 0, [False] * len(pos.ended)
        for i, views in enumerate(self._views):
            view = views[p]
            if view.partition_epoch(p) == pos.source_epochs[i] and view.epoch_begun(p):
                pos.source_epochs[i] += 1
                pos.iters[i] = None
                view.set_epoch(pos.source_epochs[i])    # its state now says so (nothing of the old epoch is read)

    # ------------------------------------------------------------------ state
    def partition_state(self, partition: int) -> MixturePartitionState:
        """One partition's position after the last sample it yielded: its own and every source's."""
        sources = []
        for i, views in enumerate(self._views):
            try:
                sources.append(views[partition].partition_state(partition))
            except SourceError as e:      # e.g. a source with no rows: say which one
                raise SourceError(f"data.sources[{i}] ({self.config.labels[i]!r}): {e}") from e
        pos, kept = self._pos[partition], self._kept[partition]
        return MixturePartitionState(pos.epoch, pos.draws, pos.consumed, list(pos.source_epochs) + [k[0] for k in kept],
                                     list(pos.ended) + [k[1] for k in kept], sources + [k[2] for k in kept],
                                     changes=list(pos.changes))

    def partition_position(self, partition: int) -> float | None:
        """The mean of the sources' positions in ``partition`` (see ``ResumableStream.partition_position``; any
        thread)."""
        known = [x for x in (views[partition].partition_position(partition) for views in self._views
                             if partition in views) if x is not None]
        return sum(known) / len(known) if known else None

    # ------------------------------------------------------------------ a resume across a change of mixture
    def _compare(self, saved_fp: dict[str, Any], where: str) -> tuple[bool, list[str], list[str]]:
        """(whether the saved mixture has other weights or sources than this one, its labels, those a change removed).
        Any other difference, or that one without ``data.mixture_change: allow``, is a StreamMismatchError naming it."""
        mix, mine, labels = saved_fp["mixture"], self.state_fingerprint(), list(self.config.labels)
        saved_labels = list(mix["labels"]) if isinstance(mix.get("labels"), list) else []
        retired = mix.get("retired", [])
        if not isinstance(retired, list):
            raise SidecarError(f"{where}: corrupt fingerprint.mixture.retired {retired!r:.80}")
        changed = bool(fingerprint_diff(_core(saved_fp, saved_labels), _core(mine, labels)))
        if changed and self.config.mixture_change != "allow":
            try:
                check_fingerprint(_core(saved_fp, saved_labels), _core(mine, labels), where)
            except StreamMismatchError as e:
                raise StreamMismatchError(
                    f"{e}\nTo resume with other weights or sources on purpose (they apply from the resume point, "
                    "the samples before it stay as they were), set data.mixture_change: allow", e.differences) from None
        if changed:     # only the weights and the set of sources may differ
            kept = [label for label in labels if label in saved_labels + retired]
            check_fingerprint(_core(saved_fp, kept, weights=False), _core(mine, kept, weights=False), where)
        return changed, saved_labels, list(retired)

    def check_saved_identity(self, state: dict[str, Any], where: str) -> None:
        """As ``StreamBase.check_saved_identity``, with the mixture compared by :meth:`_compare`."""
        if _is_mixture_state(state):
            self._compare(state["fingerprint"], where)
            state = {**state, "fingerprint": self._ours_with_transform_of(state["fingerprint"])}
        super().check_saved_identity(state, where)

    def _ours_with_transform_of(self, saved_fp: dict[str, Any]) -> dict[str, Any]:
        """This mixture's fingerprint (compared by :meth:`_compare`) with the saved transform's, which
        ``StreamBase.check_saved_identity`` then checks."""
        fp = {k: v for k, v in self.state_fingerprint().items() if k != "transform"}
        return {**fp, "transform": saved_fp["transform"]} if "transform" in saved_fp else fp

    def _in_own_form(self, state: dict[str, Any], where: str) -> dict[str, Any]:
        """A saved mixture state in this mixture's form, its weight history taken over (docs/mixtures.md, "Changes on
        resume"). One rule for a source added, removed or reweighted: each partition keeps the saved columns of the
        sources it has (this mixture's order, then the removed ones, kept for their return), an added one starts
        fresh, and the new weights apply from its next draw (a history entry starting there)."""
        if not _is_mixture_state(state):
            return state
        saved_fp = state["fingerprint"]
        mix, labels = saved_fp["mixture"], list(self.config.labels)
        changed, saved_labels, retired = self._compare(saved_fp, where)
        if changed:
            self._refuse_changes_in_datasets_draws()
        if "history" in mix:
            history = history_from_json(mix["history"], f"{where}: fingerprint.mixture.history")
        elif changed:     # no history saved: the saved configured weights (normalised) from draw 0
            weights = [saved_fp["sources"][label]["weight"] for label in saved_labels]
            history = [Segment(tuple(saved_labels), tuple(w if isinstance(w, dict) else float(w) for w in weights))]
        else:
            history = [Segment(self.config.labels, self.config.weights)]
        sps = mix.get("samples_per_step")
        if sps is not None and not (isinstance(sps, int) and sps >= 1):
            raise SidecarError(f"{where}: corrupt fingerprint.mixture.samples_per_step {sps!r}")
        every = saved_labels + retired       # the saved columns of each partition
        order = labels + [label for label in every if label not in labels]
        num_partitions = (state.get("topology") or {}).get("num_partitions", self.num_partitions)
        partitions = {}
        for p, saved in state["partitions"].items():
            ps = MixturePartitionState.from_dict(saved, f"{where}: partition {p}")
            if len(ps.sources) != len(every) or len(ps.changes) != len(history) - 1:
                raise SidecarError(f"{where}: partition {p}: the state of {len(ps.sources)} sources and "
                                   f"{len(ps.changes)} weight changes; its fingerprint lists {len(every)} sources "
                                   f"({', '.join(every)}) and {len(history) - 1} changes")
            if changed:
                columns = [(ps.source_epochs[every.index(label)], ps.ended[every.index(label)],
                            ps.sources[every.index(label)]) if label in every
                           else (0, False, self._view(labels.index(label), int(p), num_partitions).partition_state(int(p)))
                           for label in order]
                epochs, ended, sources = (list(c) for c in zip(*columns))
                ps = replace(ps, source_epochs=epochs, ended=ended, sources=sources, changes=[*ps.changes, ps.consumed])
            partitions[p] = ps.to_dict()
        if changed:
            history.append(Segment(self.config.labels, self.config.weights, "resume"))
            self._events.append({"from": "resume", "weights": dict(zip(labels, self.config.weights)),
                                 "added": [label for label in labels if label not in every],
                                 "removed": [label for label in saved_labels if label not in labels]})
        self._history, self._retired = history, {label: saved_fp["sources"][label] for label in order[len(labels):]}
        if sps is not None:
            self._samples_per_step = sps
        self._changed()
        return {**state, "fingerprint": self._ours_with_transform_of(saved_fp), "partitions": partitions}

    def _restore_partition(self, p: int, ps: MixturePartitionState, where: str, verify_next_sample: bool) -> None:
        """Continue partition ``p``: each source's view from its cursor, the draws from the saved position."""
        labels, n = self.config.labels, len(self.config.labels)
        if len(ps.sources) != n + len(self._retired):
            raise SidecarError(f"{where}: partition {p}: the state of {len(ps.sources)} sources; this mixture has "
                               f"{len(labels)} ({', '.join(labels)}) and keeps {len(self._retired)} removed ones")
        if len(ps.changes) != len(self._history) - 1:
            raise SidecarError(f"{where}: partition {p}: starts of {len(ps.changes)} weight changes; the weight history "
                               f"has {len(self._history) - 1}")
        for i, label in enumerate(labels):
            view = self._views[i][p]
            view.set_endless()       # the source epoch to read is set again when the view is next iterated
            state = view.state_dict({p: ps.sources[i]})
            view.load_state_dict(state, where=f"{where}, source {label!r}", verify_next_sample=verify_next_sample)
        pos = self._pos[p]
        pos.epoch, pos.draws, pos.consumed = ps.epoch, ps.draws, ps.consumed
        pos.source_epochs, pos.ended = list(ps.source_epochs[:n]), list(ps.ended[:n])
        pos.changes = list(ps.changes)
        pos.iters = [None] * n
        self._kept[p] = [(ps.source_epochs[i], ps.ended[i], ps.sources[i]) for i in range(n, len(ps.sources))]


def _is_mixture_state(state: dict[str, Any]) -> bool:
    fp = state.get("fingerprint")
    return state.get("kind") == "mixture" and isinstance(fp, dict) and isinstance(fp.get("mixture"), dict)


def _core(fp: dict[str, Any], labels: list[str], weights: bool = True) -> dict[str, Any]:
    """What must agree for a state to resume here: the mixture's labels, stopping and seed, its sources'
    entries (without their weights when ``weights`` is False: a change of mixture)."""
    mix = fp["mixture"]
    sources = fp.get("sources") if isinstance(fp.get("sources"), dict) else {}
    core_mix = {k: mix.get(k) for k in (("labels", "stopping", "seed") if weights else ("stopping", "seed"))}
    return {"mixture": core_mix,
            "sources": {label: {k: v for k, v in (sources.get(label) or {}).items() if weights or k != "weight"}
                        for label in labels}}


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
    out = {"format_version": state["format_version"], "topology": state["topology"],
           "mixture": {"stopping": mix["stopping"], "seed": mix["seed"], "labels": labels},
           "partitions": partitions, "sources": sources}
    history = mix.get("history")
    if history:      # each entry with the draw it starts at in each partition (the first: draw 0)
        out["mixture"]["weight_history"] = [
            {**entry, "starts": {str(p): (ps["mixture"].get("changes") or [0] * len(history))[j - 1] if j else 0
                                 for p, ps in parts}}
            for j, entry in enumerate(history)]
    for key in ("retired", "samples_per_step"):
        if key in mix:
            out["mixture"][key] = mix[key]
    return out


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
    """The stream of a ``data:`` config (a :class:`MixtureStream` with ``sources``), opened at its fresh position or
    at ``data.resume_state_path``'s. ``index_from``: a checkpoint about to be resumed, whose saved indexes are
    reused; ``mixture_draws``: ``hash`` or ``datasets_cycle`` / ``datasets_choice`` (:class:`.weights.DatasetsDraws`)."""
    if isinstance(config, MixtureConfig):
        return MixtureStream(config, rank=rank, world_size=world_size, num_workers=num_workers,
                             index_from=index_from, draws=mixture_draws)
    return ResumableStream(config, rank=rank, world_size=world_size, num_workers=num_workers,
                           index_from=index_from)
