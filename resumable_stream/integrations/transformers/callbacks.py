"""Trainer callbacks: the per-step consumed-sample log, ``train_log.jsonl`` (with the transform's
counters) and block cache statistics."""

from __future__ import annotations

import json
import logging
import os
import time

from transformers import TrainerCallback

from ...observe.mixture_counts import realized_shares
from ...stream.mixture import source_counts
from .source_loss import source_means

log = logging.getLogger(__name__)
# the block cache's counters (CachedSource.stats()) that train_log.jsonl has as cache_<name>_total
CACHE_TOTALS = ("hits", "misses", "hit_rate", "corrupt", "unavailable", "writes_skipped", "bytes_read", "bytes_written")


def truncate_jsonl(path: str, last_step: int, step_key: str = "step") -> None:
    """Keep the lines of steps <= last_step (a resumed run redoes the later ones), by each line's ``step_key``: a
    damaged line is kept (with a warning), a cut last line is dropped."""
    if not os.path.isfile(path):
        return
    keep, damaged = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break    # the write of the last line was cut short by the interruption
            step = _step_of(line, step_key)
            if step is None:
                damaged += 1
                log.warning("%s: line %d does not parse as a step record; kept as it is", path, number)
                keep.append(line)
            elif step <= last_step:
                keep.append(line)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def _step_of(line: str, step_key: str) -> int | None:
    try:
        step = json.loads(line)[step_key]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class ConsumedLogCallback(TrainerCallback):
    """``DIR/rank-{r:05d}.jsonl``: one line per optimizer step, ``{"step": s, "samples": [key, ...]}``."""

    def __init__(self, directory: str, rank: int, loader_of):
        self.path = os.path.join(directory, f"rank-{rank:05d}.jsonl")
        self.loader_of = loader_of   # () -> the trainer's StreamLoader (built after the callback)
        self._file = None

    def on_train_begin(self, args, state, control, **kwargs):
        # the loader exists (built before this event) and is not iterated yet: ask it for the keys, which it
        # keeps only for a consumer like this one
        self.loader_of().keep_keys = True
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        truncate_jsonl(self.path, state.global_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def on_step_end(self, args, state, control, **kwargs):
        keys = self.loader_of().pop_consumed_keys()
        self._file.write(json.dumps({"step": state.global_step, "samples": keys}) + "\n")
        self._file.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self._file is not None:
            self._file.close()
            self._file = None


def transform_stats(loader) -> dict:
    """The transform's counters as of the last batch the training loop consumed, summed over this rank's partitions,
    as ``data_<name>`` fields (they travel with the batch snapshots: workers' counts and resumes included)."""
    totals: dict[str, int] = {}
    if loader is None:
        return totals
    for extra in loader.transform_states().values():
        for name, value in ((extra.get("meta") or {}).get("stats") or {}).items():
            totals[f"data_{name}"] = totals.get(f"data_{name}", 0) + int(value)
    return totals


class SourceCountsCallback(TrainerCallback):
    """A mixture's ``source_*`` figures for ``train_log.jsonl``, summed over ranks (listed in docs/mixtures.md)."""

    def __init__(self, loader_of, loss_of=None):
        self.loader_of = loader_of   # () -> the trainer's StreamLoader
        self.loss_of = loss_of       # () -> its SourceLoss (data.log_source_loss), or None
        self.latest: dict[str, dict] = {}
        self._counted: tuple = (None, {})    # (the loader, its per-source counters at the last log)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:   # the training logs, which every rank makes at the same steps
            return

        loader = self.loader_of()
        labels = tuple(loader.stream.config.labels)
        n = len(labels)
        before_loader, before = self._counted
        now = loader.counters.per_source()
        if before_loader is not loader:     # a new loader (a resumed run): its counters start at zero
            before = {}
        self._counted = (loader, now)
        interval = {k: _minus(now[k], before.get(k, ()), n) for k in ("samples", "tokens")}
        losses = self.loss_of() if self.loss_of is not None else None
        loss_sums, loss_tokens = losses.take() if losses is not None else ([], [])
        counts = list(source_counts(loader.rank_state()["stream"]).values())
        values = _summed_over_ranks(args, [*counts, *interval["samples"], *interval["tokens"], *loss_sums,
                                           *loss_tokens])
        counts, samples, tokens = values[:n], values[n:2 * n], values[2 * n:3 * n]
        self.latest = {
            "source_samples": dict(zip(labels, map(int, counts))),
            "source_interval_samples": dict(zip(labels, map(int, samples))),
            "source_interval_tokens": dict(zip(labels, map(int, tokens))),
            "source_target_weights": {k: round(v, 6) for k, v in loader.current_weights().items()},
            "source_realized_weights": realized_shares(dict(zip(labels, map(int, samples)))),
        }
        if losses is not None:
            labelled = [int(v) for v in values[4 * n:]]
            self.latest["source_loss"] = source_means(values[3 * n:4 * n], labelled, labels)
            self.latest["source_loss_tokens"] = dict(zip(labels, labelled))

    def fields(self) -> dict:
        return dict(self.latest)


def _minus(now: tuple[int, ...], before: tuple[int, ...], n: int) -> list[int]:
    """Per source, ``now - before`` (either empty: nothing counted yet)."""
    now, before = now or (0,) * n, before or (0,) * n
    return [a - b for a, b in zip(now, before)]


def _summed_over_ranks(args, values: list[float]) -> list[float]:
    """``values`` summed over every rank (one all_reduce; as they are without torch.distributed)."""
    import torch
    import torch.distributed as dist

    if args.world_size > 1 and dist.is_available() and dist.is_initialized():
        total = torch.tensor(values, dtype=torch.float64, device=args.device)
        dist.all_reduce(total)
        return total.tolist()
    return [float(v) for v in values]


def weight_changes(stream) -> dict:
    """``mixture_changes`` for train_log.jsonl: the changes of a mixture's weights made since the last line (a
    resume with data.mixture_change: allow, a set_weights), each with its weights; nothing when none."""
    events = stream.pop_weight_events()
    return {"mixture_changes": events} if events else {}


class MixtureWeightsCallback(TrainerCallback):
    """The hook for a mixture's weights decided by code during training: override :meth:`new_weights`, asked after
    every optimizer step on every rank (rank 0's values apply; docs/mixtures.md)."""

    def new_weights(self, args, state, current: dict[str, float], **kwargs) -> dict[str, float] | None:
        """The weights (label -> number >= 0, or a schedule) from the next batch on, or None to keep them.
        ``current``: the target weights of the next draw (normalised); ``kwargs``: the callback's (model,
        processing_class, optimizer, ...)."""
        return None

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        loader = train_dataloader
        if loader is None or not hasattr(loader, "set_weights") or not hasattr(loader.stream, "current_weights"):
            return
        weights = self.new_weights(args, state, loader.current_weights(), **kwargs)
        if weights is not None:
            loader.set_weights(weights, step=state.global_step)


class TrainLogCallback(TrainerCallback):
    """``output_dir/train_log.jsonl`` (main process): a line per training log (step, loss, throughput, epochs, the
    data path's ``data_*`` figures; ``resumed_from`` after a resume) and one per evaluation (docs/training.md)."""

    def __init__(self, output_dir: str, samples_per_step: int, extra_of=None):
        self.path = os.path.join(output_dir, "train_log.jsonl")
        self.samples_per_step = samples_per_step
        self.extra_of = extra_of
        self._last = None
        self._resumed_from: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            truncate_jsonl(self.path, state.global_step)
        self._last = (time.perf_counter(), state.global_step)
        self._resumed_from = f"checkpoint-{state.global_step}" if state.global_step > 0 else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "eval_loss" in logs:   # an evaluation (data.eval): its own line
            self._write({"step": state.global_step, **{k: v for k, v in logs.items() if k.startswith("eval_")}})
            return
        if "loss" not in logs:
            return
        now, step = time.perf_counter(), state.global_step
        t0, s0 = self._last
        rate = (step - s0) * self.samples_per_step / (now - t0) if now > t0 and step > s0 else None
        self._last = (now, step)
        rec = {"step": step, "loss": logs["loss"], "learning_rate": logs.get("learning_rate"),
               "samples_per_s": rate, "epoch": logs.get("epoch")}
        if self._resumed_from is not None:
            rec["resumed_from"], self._resumed_from = self._resumed_from, None
        rec.update({k: v for k, v in logs.items() if k.startswith("data_")})
        if self.extra_of is not None:
            rec.update(self.extra_of())
        self._write(rec)

    def _write(self, rec: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


class CacheStatsCallback(TrainerCallback):
    """Block cache counters of this rank (its DataLoader workers included), logged every ``every_s`` seconds and/or
    ``every_steps`` steps and at the end; :meth:`fields` gives them as ``cache_*`` fields for ``train_log.jsonl``."""

    def __init__(self, stats_of, rank: int = 0, every_s: float | None = 60.0, every_steps: int | None = None):
        self.stats_of = stats_of   # () -> CachedSource.stats()
        self.rank, self.every_s, self.every_steps = rank, every_s, every_steps
        self._last_t = time.monotonic()
        self._last_step = 0
        self.records: list[dict] = []   # what was logged (the newest few)

    def fields(self) -> dict:
        """This rank's counters since the process started (``_total``, as the Prometheus endpoint names them;
        the ``data_cache_*`` fields beside them are all ranks' in the logging interval) and the cache's size."""
        s = self.stats_of()
        return {**{f"cache_{k}_total": s[k] for k in CACHE_TOTALS}, "cache_size_bytes": s["cache_bytes"]}

    def _emit(self, step: int) -> None:
        rec = {"step": step, "rank": self.rank, **self.fields()}
        self.records = (self.records + [rec])[-100:]
        rate = rec["cache_hit_rate_total"]
        log.info("block cache, rank %d, step %d: %d hits, %d misses (hit rate %s), %.1f MB read from the cache, "
                 "%.1f MB written, %d corrupt blocks re-fetched, %.2f GB on disk", self.rank, step,
                 rec["cache_hits_total"], rec["cache_misses_total"], "n/a" if rate is None else f"{rate:.1%}",
                 rec["cache_bytes_read_total"] / 1e6, rec["cache_bytes_written_total"] / 1e6,
                 rec["cache_corrupt_total"], (rec["cache_size_bytes"] or 0) / 2**30)
        self._last_t, self._last_step = time.monotonic(), step

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_t, self._last_step = time.monotonic(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        due_t = self.every_s is not None and time.monotonic() - self._last_t >= self.every_s
        due_s = self.every_steps is not None and step - self._last_step >= self.every_steps
        if due_t or due_s:
            self._emit(step)

    def on_train_end(self, args, state, control, **kwargs):
        self._emit(state.global_step)


class FollowEndCallback(TrainerCallback):
    """``data.growth: follow``: when the stream ended after waiting ``data.follow_timeout_s`` for new files, the
    epoch the trainer was in ends; this ends the run there, with a checkpoint (unless that step has one)."""

    def __init__(self, stream):
        self.stream = stream
        self._saved_step: int | None = None    # the last step with a checkpoint (saved or resumed from)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:      # resumed from checkpoint-<global_step>
            self._saved_step = state.global_step
        return control

    def on_save(self, args, state, control, **kwargs):
        self._saved_step = state.global_step
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if not self.stream.follow_ended:
            return control
        control.should_training_stop = True
        # the same decision on every rank (their streams end at the same step): from the trainer's own state,
        # not from the output dir, where rank 0 may already be writing this step's checkpoint
        if self._saved_step != state.global_step:
            control.should_save = True
        log.warning("data.growth: follow: no new data within data.follow_timeout_s (%s s); the run ends at step %d "
                    "with a checkpoint", self.stream.config.follow_timeout_s, state.global_step)
        return control
