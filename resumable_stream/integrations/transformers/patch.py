"""One call makes ``transformers.Trainer`` (or a subclass) train from a :class:`TrainingStream`: our rank-aware
loader, no batch replayed on resume, the stream state written before checkpoints rotate (docs/trainers.md)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator

import torch.utils.data

from ...config.trainer import check_data_arguments
from ...errors import ConfigError
from ...loader import StreamLoader, check_step_shape, shard_row_key
from ...observe.monitoring import MonitorSettings
from ...runtime.collectives import barrier
from ...runtime.output_lock import output_dir_lock
from ...state.output_dir import check_complete, resume_latest
from ...stream.base import Stream
from ..checkpoints import refresh_stream_files, save_stream_state
from .data_metrics import DataMetricsLog
from .source_loss import SourceLoss

_PATCHED = "_resumable_stream_patched"
# how the data.elastic_determinism errors name the Trainer's keys
TRAINING_ARGUMENT_KEYS = {"accumulation": "TrainingArguments.gradient_accumulation_steps",
                          "batch": "TrainingArguments.per_device_train_batch_size",
                          "workers": "TrainingArguments.dataloader_num_workers"}
logger = logging.getLogger(__name__)


_LOADERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # trainer -> the StreamLoader it reads
_DATA_METRICS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # trainer -> its DataMetricsLog
_SOURCE_LOSS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # trainer -> its SourceLoss


def stream_loader(trainer) -> StreamLoader | None:
    """The :class:`StreamLoader` a patched trainer trains from (None until it built its train dataloader)."""
    return _LOADERS.get(trainer)


def source_loss(trainer) -> SourceLoss | None:
    """The per-source loss sums of a patched trainer (``data.log_source_loss`` on a mixture; None otherwise or
    until it built its train dataloader)."""
    return _SOURCE_LOSS.get(trainer)


def data_metrics_log(trainer) -> DataMetricsLog | None:
    """The per-step data figures of a patched trainer (None until it built its train dataloader)."""
    return _DATA_METRICS.get(trainer)


class TrainingStream(torch.utils.data.IterableDataset):
    """What to hand the Trainer as ``train_dataset``: a stream plus how to turn rows into batches
    (``collate_fn`` None: the Trainer's ``data_collator``)."""

    def __init__(self, stream: Stream, collate_fn: Callable | None, processor_factory: Callable | None = None,
                 key_fn: Callable = shard_row_key, resume_state_path: str | None = None,
                 monitor: MonitorSettings | None = None):
        super().__init__()
        self.stream, self.collate_fn = stream, collate_fn
        self.processor_factory, self.key_fn = processor_factory, key_fn
        self.resume_state_path = resume_state_path
        self.monitor = monitor or MonitorSettings()   # data metrics endpoint, data-bound warning

    def __iter__(self):
        raise TypeError("TrainingStream is read through the patched Trainer's StreamLoader; call patch_trainer() "
                        "before creating the Trainer")


class EvalStream(torch.utils.data.IterableDataset):
    """What to hand the Trainer as ``eval_dataset``: a finite validation pass over the first ``num_samples``
    training examples (packed blocks with packing) of ``stream``, over all ranks, the same at every
    evaluation and after a resume (each pass restarts from the stream's position at creation)."""

    def __init__(self, stream: Stream, collate_fn: Callable, processor_factory: Callable | None = None,
                 num_samples: int = 0, key_fn: Callable = shard_row_key, key: str = "data.eval.num_samples"):
        super().__init__()
        if stream.num_workers:
            raise ConfigError("the eval stream is read in the main process: create it with num_workers=0")
        if not (isinstance(num_samples, int) and num_samples > 0 and num_samples % stream.world_size == 0):
            raise ConfigError(f"{key}: got {num_samples!r}; allowed: an integer > 0, a multiple of the "
                              f"{stream.world_size} ranks")
        self.stream, self.collate_fn = stream, collate_fn
        self.processor_factory, self.key_fn, self.num_samples, self.key = processor_factory, key_fn, num_samples, key
        if processor_factory is not None:   # as a StreamLoader sets it: part of the state every pass restores
            stream.transform_fingerprint = processor_factory().fingerprint()
        self.start = stream.state_dict()

    def batches(self, batch_size: int) -> _EvalPass:
        per_rank = self.num_samples // self.stream.world_size
        if per_rank % batch_size:
            raise ConfigError(f"{self.key}: got {self.num_samples}: {per_rank} per rank is not a multiple of "
                              f"per_device_eval_batch_size {batch_size}")
        return _EvalPass(self, batch_size, per_rank // batch_size)

    def __iter__(self):
        raise TypeError("EvalStream is read through the patched Trainer's evaluation; call patch_trainer() "
                        "before creating the Trainer")


class _EvalPass:
    """One evaluation: ``num_batches`` batches from the eval stream's start."""

    def __init__(self, source: EvalStream, batch_size: int, num_batches: int):
        self.source, self.batch_size, self.num_batches = source, batch_size, num_batches

    def __iter__(self):
        src = self.source
        src.stream.load_state_dict(src.start, where="the eval stream's start")
        loader = StreamLoader(src.stream, batch_size=self.batch_size, collate_fn=src.collate_fn,
                              processor_factory=src.processor_factory, key_fn=src.key_fn, num_workers=0)
        return itertools.islice(iter(loader), self.num_batches)


def samples_per_step(args) -> int:
    """Samples of the whole job per optimizer step of ``args`` (TrainingArguments): batch x accumulation x ranks."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def fit_to_steps(stream: Stream, args, keys: dict[str, str]) -> None:
    """Before the model is built: under data.elastic_determinism every optimizer step of ``args`` takes a
    micro-batch of each partition (``keys`` name the arguments in its errors); a mixture's weight schedules in
    steps map to draws with :func:`samples_per_step` (fixed now; a resume keeps its own)."""
    check_step_shape(stream, args.gradient_accumulation_steps, args.per_device_train_batch_size, keys)
    if hasattr(stream, "set_samples_per_step"):
        stream.set_samples_per_step(samples_per_step(args))


def _uses_stream(trainer) -> bool:
    return isinstance(getattr(trainer, "train_dataset", None), TrainingStream)


def _check_data_parallel(args) -> None:
    """Under torchrun (WORLD_SIZE > 1) accelerate must have set up data parallelism, else every rank trains
    its own copy of the model on its share of the data (accelerate on CPU: only with use_cpu)."""
    from transformers.training_args import ParallelMode

    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and args.parallel_mode in (ParallelMode.NOT_PARALLEL, ParallelMode.NOT_DISTRIBUTED):
        raise ConfigError(f"TrainingArguments: {launched} processes were launched (WORLD_SIZE) but the model is "
                          f"not wrapped for data parallelism (parallel_mode {args.parallel_mode.value}); each rank "
                          "would train its own copy. On CPU set use_cpu=True (accelerate needs it for gloo); "
                          "see resumable_stream.runtime.devices.data_parallel_arguments")


def _get_train_dataloader(original):
    @functools.wraps(original)
    def get_train_dataloader(self):
        if not _uses_stream(self):
            return original(self)
        ts: TrainingStream = self.train_dataset
        args = self.args
        check_data_arguments(args, section="TrainingArguments")
        _check_data_parallel(args)
        if ts.stream.num_workers != args.dataloader_num_workers:
            raise ConfigError(f"train.dataloader_num_workers: {args.dataloader_num_workers}, but the stream was "
                              f"created for {ts.stream.num_workers} workers; they must match")
        labels = getattr(getattr(ts.stream, "config", None), "labels", None)
        per_source_loss = bool(ts.monitor.log_source_loss and labels)
        loader = StreamLoader(
            ts.stream, batch_size=self._train_batch_size, collate_fn=ts.collate_fn or self.data_collator,
            processor_factory=ts.processor_factory, key_fn=ts.key_fn, num_workers=args.dataloader_num_workers,
            prefetch_factor=args.dataloader_prefetch_factor if args.dataloader_num_workers else None,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(), source_ids=per_source_loss,
        )
        if per_source_loss:
            _SOURCE_LOSS[self] = SourceLoss(len(labels))
        # the checkpoint being resumed wins; data.resume_state_path only seeds a fresh run
        source = getattr(self, "_rs_resume_checkpoint", None) or ts.resume_state_path
        if source:
            loader.load_sidecar(source)
        # data.elastic_determinism: a step takes a micro-batch of every partition (after the load: a null
        # num_partitions is the checkpoint's)
        check_step_shape(loader.stream, args.gradient_accumulation_steps, self._train_batch_size,
                         TRAINING_ARGUMENT_KEYS)
        _LOADERS[self] = loader
        config = getattr(ts.stream, "config", None)
        context = {"workers": args.dataloader_num_workers, "cache_dir": getattr(config, "cache_dir", None),
                   "prefetch_blocks": getattr(config, "prefetch_blocks", None)}
        previous = _DATA_METRICS.pop(self, None)
        if previous is not None:
            previous.close()
        _DATA_METRICS[self] = DataMetricsLog(loader, ts.monitor, context, args.process_index, args.world_size,
                                             args.device)
        return loader
    return get_train_dataloader


def _get_eval_dataloader(original):
    @functools.wraps(original)
    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if not isinstance(dataset, EvalStream):
            return original(self, eval_dataset)
        return dataset.batches(self.args.eval_batch_size)
    return get_eval_dataloader


def finished_step(checkpoint: str | None, max_steps: int) -> int | None:
    """The step of ``checkpoint`` when it reached ``max_steps`` (a run with nothing left to train), else None."""
    if not checkpoint or max_steps is None or max_steps <= 0:
        return None
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            step = int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError):
        return None
    return step if step >= max_steps else None


def _train(original):
    @functools.wraps(original)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if not _uses_stream(self):
            return original(self, resume_from_checkpoint, *args, **kwargs)
        # one job per output_dir, held from before the checkpoints are looked at until training returns
        with output_dir_lock(self.args.output_dir, self.args.process_index, self.args.world_size):
            if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
                # as `resumable-stream train` does: the newest complete checkpoint, the cut-short ones removed
                resume_from_checkpoint = resume_latest(self.args.output_dir, self.args.process_index == 0, barrier)
            elif resume_from_checkpoint:
                check_complete(resume_from_checkpoint)   # refuse half-written checkpoints
            self._rs_resume_checkpoint = resume_from_checkpoint or None
            # The Trainer counts the batches trained so far only when it is to skip them (its epoch at step N is
            # epoch + trained-or-skipped / steps_in_epoch); the skip is ours and a no-op (_patch_skip), so that
            # is what it must do: with ignore_data_skip its epoch would restart from 0 at the checkpoint.
            self.args.ignore_data_skip = False
            done = finished_step(resume_from_checkpoint, self.args.max_steps)
            if done is not None:
                # Without a dataset length the Trainer would run one more step past max_steps. The trainer's
                # state is the checkpoint's, so that a save_state() after this train() (LLaMA-Factory's
                # workflow does one) writes it, not a state of step 0 with an empty log.
                from transformers.trainer_callback import TrainerState
                from transformers.trainer_utils import TrainOutput

                logger.warning("checkpoint %s is already at step %d >= max_steps %d: nothing left to train",
                               resume_from_checkpoint, done, self.args.max_steps)
                self.state = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, "trainer_state.json"))
                return TrainOutput(done, 0.0, {"epoch": self.state.epoch})
            try:
                return original(self, resume_from_checkpoint or None, *args, **kwargs)
            finally:
                metrics_log = _DATA_METRICS.get(self)
                if metrics_log is not None:      # the metrics endpoint ends with the training
                    metrics_log.close()
    return train


def _get_resumed_dataloader(original):
    # transformers 5: the Trainer's skip of the batches a resumed run already trained. Our loader is restored
    # from the checkpoint's sidecars at the first batch not trained: it is handed back as it is.
    @functools.wraps(original)
    def get_resumed_dataloader(self, dataloader, num_batches):
        if isinstance(dataloader, StreamLoader):
            return dataloader
        return original(self, dataloader, num_batches)
    return get_resumed_dataloader


_OUR_SKIPS: set = set()    # the skip_first_batches wrappers made here (a module patched twice keeps one)


def _skip_first_batches(original):
    # transformers 4.x: the same skip is the function train() imported from accelerate
    @functools.wraps(original)
    def skip_first_batches(dataloader, num_batches=0):
        if isinstance(dataloader, StreamLoader):
            return dataloader
        return original(dataloader, num_batches)
    _OUR_SKIPS.add(skip_first_batches)
    return skip_first_batches


def _patch_skip(trainer_cls) -> None:
    if hasattr(trainer_cls, "get_resumed_dataloader"):
        trainer_cls.get_resumed_dataloader = _get_resumed_dataloader(trainer_cls.get_resumed_dataloader)
        return
    import transformers.trainer as trainer_module

    skip = getattr(trainer_module, "skip_first_batches", None)
    if skip is not None and skip not in _OUR_SKIPS:
        trainer_module.skip_first_batches = _skip_first_batches(skip)


def _compute_loss(original):
    # data.log_source_loss: the batch's source_ids are not the model's input; the loss is the Trainer's own
    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        if not (_uses_stream(self) and isinstance(inputs, dict) and "source_ids" in inputs):
            return original(self, model, inputs, return_outputs=return_outputs, **kwargs)
        source_ids = inputs.pop("source_ids")
        sums = _SOURCE_LOSS.get(self) if model.training else None
        if sums is None or "labels" not in inputs:
            return original(self, model, inputs, return_outputs=return_outputs, **kwargs)
        labels = inputs["labels"]
        loss, outputs = original(self, model, inputs, return_outputs=True, **kwargs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        sums.add(source_ids, logits, labels)
        return (loss, outputs) if return_outputs else loss
    return compute_loss


def _log(original):
    @functools.wraps(original)
    def log(self, logs, *args, **kwargs):
        metrics_log = _DATA_METRICS.get(self) if _uses_stream(self) else None
        # the training logs (every rank makes them at the same steps): the data figures join them, so that
        # every report_to integration and the log history get them
        if metrics_log is not None and "loss" in logs:
            metrics_log.on_log(logs, self.state.global_step)
        return original(self, logs, *args, **kwargs)
    return log


@contextlib.contextmanager
def _rotation_deferred(trainer):
    """Hold back the Trainer's checkpoint rotation (``trainer.rotate_checkpoints``, or ``Trainer._rotate_checkpoints``
    in 4.x) until the stream state completes the new checkpoint."""
    import transformers.trainer as trainer_module

    if hasattr(trainer_module, "rotate_checkpoints"):
        owner, name = trainer_module, "rotate_checkpoints"
    else:
        owner, name = trainer, "_rotate_checkpoints"   # an instance attribute shadows the method
    shadowed = name in vars(owner)
    real = getattr(owner, name)
    calls = []
    setattr(owner, name, lambda *a, **k: calls.append((a, k)))
    try:
        yield calls
    finally:
        if shadowed:
            setattr(owner, name, real)
        else:
            delattr(owner, name)
    for a, k in calls:
        real(*a, **k)


def _save_checkpoint(original):
    @functools.wraps(original)
    def _save_checkpoint(self, model, trial):
        loader = stream_loader(self)
        if not _uses_stream(self) or loader is None:
            return original(self, model, trial)
        with _rotation_deferred(self):
            original(self, model, trial)
            checkpoint = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            refresh_stream_files(loader.stream)
            save_stream_state(loader, checkpoint, self.args.world_size, self.args.process_index == 0,
                              barrier)
    return _save_checkpoint


@contextlib.contextmanager
def _cpu_map_location() -> Iterator[None]:
    """``torch.load`` with a CPU device of an index (``cpu:0``) as map_location loads to plain ``cpu``."""
    load = torch.load

    def load_to_cpu(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = load_to_cpu
    try:
        yield
    finally:
        torch.load = load


def _load_optimizer_and_scheduler(original):
    # accelerate <= 1.11 (LLaMA-Factory 0.9.5's pin) puts the ranks of a multi-process CPU job on "cpu:N"; the
    # Trainer maps the optimizer state it resumes to args.device, and torch cannot restore a storage to "cpu:N"
    # ("don't know how to restore data location ... (tagged with cpu:0)")
    @functools.wraps(original)
    def _load_optimizer_and_scheduler(self, checkpoint):
        device = self.args.device
        if not (_uses_stream(self) and device.type == "cpu" and device.index is not None):
            return original(self, checkpoint)
        with _cpu_map_location():
            return original(self, checkpoint)
    return _load_optimizer_and_scheduler


def patch_trainer(trainer_cls=None):
    """Patch ``trainer_cls`` (default ``transformers.Trainer``, which covers subclasses that do not
    override these methods). Idempotent. Returns the class."""
    if trainer_cls is None:
        from transformers import Trainer as trainer_cls
    if trainer_cls.__dict__.get(_PATCHED):
        return trainer_cls
    trainer_cls.get_train_dataloader = _get_train_dataloader(trainer_cls.get_train_dataloader)
    trainer_cls.get_eval_dataloader = _get_eval_dataloader(trainer_cls.get_eval_dataloader)
    trainer_cls.train = _train(trainer_cls.train)
    trainer_cls._save_checkpoint = _save_checkpoint(trainer_cls._save_checkpoint)
    trainer_cls.log = _log(trainer_cls.log)
    trainer_cls.compute_loss = _compute_loss(trainer_cls.compute_loss)
    _patch_skip(trainer_cls)
    if hasattr(trainer_cls, "_load_optimizer_and_scheduler"):
        trainer_cls._load_optimizer_and_scheduler = _load_optimizer_and_scheduler(
            trainer_cls._load_optimizer_and_scheduler)
    setattr(trainer_cls, _PATCHED, True)
    return trainer_cls
