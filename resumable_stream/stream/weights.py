"""A mixture's weight history and the sources its draws pick: a pure function of the draw and the history, so
it has no state to save (docs/mixtures.md, "Curricula and changing mixtures"). Or (:class:`DatasetsDraws`) the
sequence of ``datasets.interleave_datasets`` that LLaMA-Factory's ``interleave_*`` draws (docs/llamafactory.md)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config.weight_schedule import check_weights, is_schedule, normalised, schedule_unit
from ..errors import ConfigError, SidecarError
from ..plan import counter_hashes, derive_seed

TAG_MIXTURE = 101          # domain tag of the draw seeds (plan's tags are small integers)
ORIGINS = ("config", "resume", "set_weights")
MAX_SEGMENTS = 100_000


def uniforms(seed: int, epoch: int, partition: int, start: int, count: int) -> np.ndarray:
    """The uniforms in [0, 1) of draws ``start .. start+count-1`` of (partition, mixture epoch)."""
    key = derive_seed(TAG_MIXTURE, seed, epoch, partition)
    bits = counter_hashes(key, start, count)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def pick_fixed(probabilities: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """The source each uniform picks under fixed probabilities."""
    picks = np.searchsorted(np.cumsum(probabilities), uniform, side="right")
    return np.minimum(picks, len(probabilities) - 1)


def draw_sources(probabilities: np.ndarray, seed: int, epoch: int, partition: int, start: int,
                 count: int) -> np.ndarray:
    """The sources of draws ``start .. start+count-1`` of (partition, epoch) under fixed probabilities."""
    return pick_fixed(probabilities, uniforms(seed, epoch, partition, start, count))


def normalised_rows(w: np.ndarray) -> np.ndarray:
    """Each row of weights divided by its sum; a row whose sum overflows is divided by its largest weight first
    (config.weight_schedule.normalised, row by row)."""
    with np.errstate(over="ignore"):       # an overflow is what is looked for
        total = w.sum(axis=1, keepdims=True)
    huge = ~np.isfinite(total[:, 0])
    if huge.any():
        w = w.copy()
        w[huge] /= w[huge].max(axis=1, keepdims=True)
        total = w.sum(axis=1, keepdims=True)
    return w / total


@dataclass(frozen=True)
class Segment:
    """The weights of ``labels`` from a draw on (the draw is each partition's own)."""

    labels: tuple[str, ...]
    weights: tuple            # per label: a float, or a schedule (config.weight_schedule)
    origin: str = "config"    # config | resume | set_weights
    step: int | None = None   # the training step of a set_weights, when the caller told it

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from": self.origin, "weights": dict(zip(self.labels, self.weights))}
        if self.step is not None:
            out["step"] = self.step
        return out

    def to_state(self) -> dict[str, Any]:
        """:meth:`to_json` with the labels in their order: the order of the cumulative weights a draw's uniform picks
        against (a saved state's JSON sorts keys)."""
        return {**self.to_json(), "labels": list(self.labels)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> Segment:
        ok = (isinstance(d, dict) and d.get("from") in ORIGINS and isinstance(d.get("weights"), dict)
              and d["weights"] and all(isinstance(k, str) for k in d["weights"])
              and (d.get("step") is None or (isinstance(d["step"], int) and d["step"] >= 0)))
        if not ok:
            raise SidecarError(f"{where}: corrupt weight history entry {d!r:.120}; allowed: a mapping with from "
                               f"({', '.join(ORIGINS)}), weights (label: weight) and an optional step")
        labels = list(d["weights"])
        order = d.get("labels")       # to_state's: the draws' order of the labels (else the mapping's)
        if order is not None:
            if not (isinstance(order, list) and all(isinstance(x, str) for x in order)
                    and sorted(order) == sorted(labels)):
                raise SidecarError(f"{where}: corrupt weight history entry: labels {order!r:.120}; allowed: the "
                                   f"labels of its weights ({', '.join(sorted(labels))}) in some order")
            labels = order
        try:
            weights = check_weights([d["weights"][label] for label in labels], labels, lambda i: f"weights.{labels[i]}",
                                    allow_zero=True)
        except ConfigError as e:
            raise SidecarError(f"{where}: corrupt weight history entry: {e}") from None
        return cls(tuple(labels), weights, d["from"], d.get("step"))

    @property
    def fixed(self) -> bool:
        return not any(is_schedule(w) for w in self.weights)


def history_from_json(entries: Any, where: str) -> list[Segment]:
    if not (isinstance(entries, list) and 1 <= len(entries) <= MAX_SEGMENTS):
        raise SidecarError(f"{where}: corrupt weight history {entries!r:.80}; allowed: a list of 1 to {MAX_SEGMENTS} "
                           "entries")
    return [Segment.from_json(e, f"{where}[{j}]") for j, e in enumerate(entries)]


def history_unit(history: list[Segment]) -> str | None:
    """``steps`` when some segment has a schedule in steps (it then needs samples_per_step), else its unit."""
    units = {schedule_unit(s.weights) for s in history} - {None}
    return "steps" if "steps" in units else next(iter(units), None)


class WeightPlan:
    """The sources the draws of a partition pick, under a history, as indexes of the mixture's active sources."""

    def __init__(self, history: list[Segment], active: tuple[str, ...], num_partitions: int,
                 samples_per_step: int | None):
        self.history, self.num_partitions, self.samples_per_step = history, num_partitions, samples_per_step
        slot = {label: i for i, label in enumerate(active)}
        self._slots = [np.asarray([slot.get(label, -1) for label in s.labels], dtype=np.int64) for s in history]
        self._fixed = []
        for s in history:      # as MixtureConfig.probabilities normalises: fixed weights draw as they always did
            fixed = s.fixed and all(w > 0 for w in s.weights)
            self._fixed.append(np.asarray(normalised(s.weights)) if fixed else None)

    def position(self, draws: np.ndarray, unit: str) -> np.ndarray:
        """The schedule position of draw indexes ``draws`` (module doc)."""
        samples = draws.astype(np.float64) * self.num_partitions
        if unit == "samples":
            return samples
        if not self.samples_per_step:
            raise ConfigError("data.sources[i].weight: a schedule in steps needs the samples per optimizer step of "
                              "the job (the trainer sets it; a stream of your own: "
                              "stream.set_samples_per_step(batch_size * gradient_accumulation * world_size)), or "
                              "write the schedule with unit: samples")
        return samples / float(self.samples_per_step)

    def segment_of(self, draw: int, changes: list[int]) -> int:
        """The segment draw index ``draw`` of a partition falls in (``changes``: where segments 1.. start)."""
        return bisect.bisect_right(changes, draw)

    def weights(self, segment: int, draws: np.ndarray) -> np.ndarray:
        """(len(draws), labels of the segment) weights, unnormalised."""
        s = self.history[segment]
        unit = schedule_unit(s.weights)
        x = self.position(draws, unit) if unit else None
        cols = []
        for w in s.weights:
            if not is_schedule(w):
                cols.append(np.full(len(draws), float(w)))
                continue
            xs = np.asarray([p[0] for p in w["points"]])
            ws = np.asarray([p[1] for p in w["points"]])
            if w["schedule"] == "linear":
                cols.append(np.interp(x, xs, ws))
            else:
                cols.append(ws[np.maximum(np.searchsorted(xs, x, side="right") - 1, 0)])
        return np.stack(cols, axis=1)

    def picks(self, seed: int, epoch: int, partition: int, draw: int, consumed: int, changes: list[int],
              count: int) -> list[int]:
        """Active-source indexes of draws ``draw ..`` of mixture epoch ``epoch`` (draw indexes ``consumed ..``
        overall), at most ``count`` and never past the start of the next segment."""
        segment = self.segment_of(consumed, changes)
        if segment < len(changes):
            count = max(1, min(count, changes[segment] - consumed))
        u = uniforms(seed, epoch, partition, draw, count)
        if self._fixed[segment] is not None:
            local = pick_fixed(self._fixed[segment], u)
        else:
            w = self.weights(segment, consumed + np.arange(count, dtype=np.int64))
            cum = np.cumsum(normalised_rows(w), axis=1)
            local = (cum <= u[:, None]).sum(axis=1)
            last_positive = w.shape[1] - 1 - np.argmax(w[:, ::-1] > 0, axis=1)
            local = np.minimum(local, last_positive)
        out = self._slots[segment][local]
        if (out < 0).any():
            raise SidecarError(f"partition {partition}: draw {consumed} is in a weight history entry of sources "
                               f"{list(self.history[segment].labels)}, some of which this mixture no longer reads")
        return out.tolist()

    def weights_now(self, consumed: int, changes: list[int]) -> dict[str, float]:
        """label -> normalised target weight of the draw with index ``consumed``."""
        segment = self.segment_of(consumed, changes)
        w = normalised_rows(self.weights(segment, np.asarray([consumed], dtype=np.int64)))[0]
        return {label: float(v) for label, v in zip(self.history[segment].labels, w)}


# ------------------------------------------------------------------ datasets.interleave_datasets' draws
DATASETS_MODES = ("datasets_cycle", "datasets_choice")
DATASETS_BLOCK = 1000        # datasets' random_batch_size


def _datasets_generator(seed: int, epoch: int, partition: int) -> np.random.Generator:
    if epoch > 0:      # datasets' _effective_generator
        effective = int(np.random.default_rng(seed).integers(0, 1 << 63)) - epoch
        seed = (1 << 63) + effective if effective < 0 else effective
    # one rank and one worker (partition 0): datasets' own generator; other partitions: their own sequence
    return np.random.default_rng(seed if partition == 0 else [seed, partition])


class DatasetsDraws:
    """Blocks of draws of one mixture, per (epoch, partition), continued without regenerating."""

    def __init__(self, mode: str, weights: tuple[float, ...], seed: int):
        if mode not in DATASETS_MODES:
            raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(DATASETS_MODES)}")
        self.mode, self.seed, self.n = mode, int(seed), len(weights)
        p = np.asarray(weights, dtype=np.float64)
        with np.errstate(over="ignore"):
            if not np.isfinite(p.sum()):      # weights near the float maximum: the sum overflows
                p = p / p.max()
        self.p = p if p.sum() == 1.0 else p / p.sum()
        self._at: dict[int, tuple[int, int, np.random.Generator]] = {}   # partition -> (epoch, next block, rng)

    def block(self, epoch: int, partition: int, start: int) -> tuple[int, list[int]]:
        """(first draw, sources) of the block holding draw ``start`` of (epoch, partition)."""
        first = start // DATASETS_BLOCK
        if self.mode == "datasets_cycle":
            return first * DATASETS_BLOCK, [(first * DATASETS_BLOCK + i) % self.n for i in range(DATASETS_BLOCK)]
        at = self._at.get(partition)
        if at is None or at[0] != epoch or at[1] > first:
            at = (epoch, 0, _datasets_generator(self.seed, epoch, partition))
        _, k, rng = at
        while True:
            picks = rng.choice(self.n, size=DATASETS_BLOCK, p=self.p)
            k += 1
            if k > first:
                self._at[partition] = (epoch, k, rng)
                return first * DATASETS_BLOCK, picks.tolist()
