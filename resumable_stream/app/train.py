"""Train a causal LM or, with ``data.format: vl``, a vision-language model from one yaml file (``resumable-stream
train CONFIG``, under torchrun too); a restart with the same output_dir resumes exactly (docs/training.md)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys

from ..config.chat_formats import REQUIRED as FORMAT_REQUIRED
from ..config.chat_formats import resolved_columns
from ..config.model_config import field_error
from ..config.stream_config import MixtureConfig
from ..config.trainer import TrainerConfig
from ..errors import ConfigError
from ..integrations.transformers.callbacks import (
    CacheStatsCallback,
    ConsumedLogCallback,
    FollowEndCallback,
    SourceCountsCallback,
    TrainLogCallback,
    transform_stats,
    weight_changes,
)
from ..integrations.transformers.patch import (
    EvalStream,
    TrainingStream,
    data_metrics_log,
    finished_step,
    fit_to_steps,
    patch_trainer,
    samples_per_step,
    source_loss,
    stream_loader,
)
from ..io.net import RetryPolicy
from ..loader import shard_row_key
from ..runtime.collectives import barrier
from ..runtime.devices import data_parallel_arguments, detect_device
from ..runtime.output_lock import output_dir_lock
from ..runtime.threads import set_trainer_threads
from ..state.output_dir import check_complete, latest_complete_checkpoint, resume_latest
from ..stream.mixture import MixtureStream, open_stream
from ..transforms.text import TextProcessor, collate
from ..transforms.vl import VLProcessor, collate_vl, load_processor
from .preflight import check_training_data
from .startup import quiet_tied_weights, startup_summary

log = logging.getLogger(__name__)

RUN_RESULTS = ("trainer_state.json", "train_results.json", "all_results.json")   # as HF's scripts end a run
# how the data.elastic_determinism errors name the train: keys
TRAIN_KEYS = {"accumulation": "train.gradient_accumulation_steps", "batch": "train.per_device_train_batch_size",
              "workers": "train.dataloader_num_workers"}


class ColumnKey:
    """Sample key from a column (``data.id_column``); picklable for DataLoader workers."""

    def __init__(self, column: str):
        self.column = column

    def __call__(self, sample: dict, where: tuple[int, int]) -> str:
        if isinstance(where[0], str):   # a mixture's ("label/shard", row): ids of two sources may coincide
            return f"{where[0].partition('/')[0]}/{sample[self.column]}"
        return str(sample[self.column])


def _load_tokenizer(cfg: TrainerConfig):
    from transformers import AutoTokenizer

    name = cfg.model.tokenizer or cfg.model.name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.name_or_path"
        raise ConfigError(f"{key}: {name!r} cannot be loaded as a tokenizer ({type(e).__name__}: {e})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _load_processor(cfg: TrainerConfig):
    name = cfg.model.processor or cfg.model.name_or_path
    key = "model.processor" if cfg.model.processor else "model.name_or_path"
    try:
        processor = load_processor(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"{key}: {name!r} cannot be loaded as a processor ({type(e).__name__}: {e})") from None
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"{key}: {name!r} loads as {type(processor).__name__}, not a processor with a tokenizer "
                          "and an image processor (data.format vl needs one)")
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def _token_fields(fields: dict, tokenizer, vocab: bool = True) -> None:
    """Defaults a random-init config takes from the tokenizer: its special tokens and (``vocab``) vocabulary size."""
    if vocab:
        fields.setdefault("vocab_size", len(tokenizer))
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            fields.setdefault(name, getattr(tokenizer, name))


def _vl_config_fields(fields: dict, processor) -> None:
    """Defaults a random-init VL config takes from the processor: the text model's vocabulary size and
    special tokens, and the vision token ids."""
    text = fields.setdefault("text_config", {})
    if isinstance(text, dict):
        _token_fields(text, processor.tokenizer)
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int) and value >= 0:
            fields.setdefault(name, value)


def _load_model(cfg: TrainerConfig, tokenizer, seed: int, processor=None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, set_seed

    auto = AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM
    dtype = None if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    if cfg.model.name_or_path:
        name = cfg.model.name_or_path
        need = ("; data.format vl needs an image-text-to-text model (one AutoModelForImageTextToText loads, "
                "e.g. Qwen2-VL / Qwen3-VL), not a text-only checkpoint" if processor is not None else "")
        if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"model.name_or_path: {name!r} is a directory without config.json, not a saved "
                              f"model{need}")
        try:
            return auto.from_pretrained(name, dtype=dtype or "auto", trust_remote_code=cfg.model.trust_remote_code)
        except OSError as e:
            raise ConfigError(f"model.name_or_path: {name!r} cannot be loaded ({e}){need}") from None
        except (ValueError, KeyError) as e:   # e.g. "Unrecognized configuration class ... for this kind of AutoModel"
            raise ConfigError(f"model.name_or_path: {name!r} cannot be loaded as an {auto.__name__} model "
                              f"({type(e).__name__}: {e}){need}") from None
    fields = dict(cfg.model.config)
    model_type = fields.pop("model_type")
    if processor is not None:
        _vl_config_fields(fields, processor)
    _token_fields(fields, tokenizer, vocab=processor is None)     # a VL model's vocabulary: its text config's
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:   # checked with the yaml already; here the fields taken from the tokenizer too
        raise field_error(model_type, fields, e) from None
    set_seed(seed)   # the random init is part of what a rerun must reproduce
    try:
        model = auto.from_config(config)
    except ValueError as e:
        raise ConfigError(f"model.config: model_type {model_type!r} is not a {auto.__name__} model ({e})") from None
    return model.to(dtype) if dtype is not None else model


def _check_columns(cfg: TrainerConfig, columns: list[str] | None) -> None:
    if not columns:
        return   # unknown until read (some json / hub datasets); the loader catches an all-skipped epoch
    tc = cfg.transform
    if tc.map or tc.sources:
        return   # data.map makes the rows the transform reads; per-source settings: each source has its own columns
    if tc.format in FORMAT_REQUIRED:
        columns_of = resolved_columns(tc.format, tc.columns)
        wanted = {f"columns.{k}": columns_of[k] for k in FORMAT_REQUIRED[tc.format]}
    elif tc.format == "text":
        wanted = {"text_column": tc.text_column}
    else:
        wanted = {"messages_column": tc.messages_column}
    if tc.format == "vl":
        wanted["images_column"] = tc.images_column
    if tc.id_column:
        wanted["id_column"] = tc.id_column
    for key, column in wanted.items():
        if column not in columns:
            raise ConfigError(f"data.{key}: got {column!r}; the dataset's columns are: {', '.join(columns)}")


def training_arguments(cfg: TrainerConfig, **argument_overrides):
    """The TrainingArguments of ``train:`` with the data parallelism of the device found (under torchrun
    creating them sets up torch.distributed)."""
    requested = {**cfg.train, **argument_overrides}
    kind = "cpu" if requested.get("use_cpu") else detect_device().kind
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.training_arguments(**data_parallel_arguments(kind, world_size, requested), **argument_overrides)


def build_trainer(cfg: TrainerConfig, args=None, **argument_overrides):
    """Everything but ``train()``: arguments (``args``: made by :func:`training_arguments` already), tokenizer,
    model, stream, patched Trainer."""
    from transformers import Trainer

    args = args if args is not None else training_arguments(cfg, **argument_overrides)
    vl = cfg.transform.format == "vl"

    # The data first: what is wrong with it (files, columns, the resolution) is said before the model is built.
    # The loader restores the state (stream cursor + transform carry), not the bare stream; the stream only
    # reuses the dataset index saved with the checkpoint this run will resume (no resolving on a restart).
    explicit = cfg.train.get("resume_from_checkpoint")
    resumed = ((explicit if isinstance(explicit, str) else None) or latest_complete_checkpoint(args.output_dir)
               or cfg.stream.resume_state_path)
    stream = open_stream(cfg.stream.replace(resume_state_path=None), rank=args.process_index,
                         world_size=args.world_size, num_workers=args.dataloader_num_workers, index_from=resumed)
    _check_columns(cfg, stream.source.column_names)
    fit_to_steps(stream, args, TRAIN_KEYS)
    processor = _load_processor(cfg) if vl else None
    tokenizer = processor.tokenizer if vl else _load_tokenizer(cfg)
    model = _load_model(cfg, tokenizer, args.seed, processor)
    if vl:
        # image URLs under the data's retries and timeouts (a mixture's are the same for every source)
        net = cfg.stream.sources[0] if isinstance(cfg.stream, MixtureConfig) else cfg.stream
        processor_factory = functools.partial(VLProcessor, processor, cfg.transform, RetryPolicy(net.source_spec.net, remote=True))
        collate_fn = functools.partial(collate_vl, pad_token_id=tokenizer.pad_token_id)
    else:
        processor_factory = functools.partial(TextProcessor, tokenizer, cfg.transform)
        # neat packing under flash attention: the varlen path needs the segments of a batch of several rows
        flash = "flash" in str(getattr(model.config, "_attn_implementation", None) or "")
        collate_fn = functools.partial(collate, pad_token_id=tokenizer.pad_token_id, flash_attn_kwargs=flash)
    key_fn = ColumnKey(cfg.transform.id_column) if cfg.transform.id_column else shard_row_key
    dataset = TrainingStream(stream, collate_fn, processor_factory, key_fn,
                             resume_state_path=cfg.stream.resume_state_path, monitor=cfg.monitor)

    eval_dataset = None
    if cfg.eval_stream is not None:   # data.eval: the same fixed validation samples at every evaluation
        eval_stream = open_stream(cfg.eval_stream, rank=args.process_index, world_size=args.world_size)
        eval_dataset = EvalStream(eval_stream, collate_fn, processor_factory, cfg.eval_samples, key_fn)
        eval_dataset.batches(args.eval_batch_size)   # a bad num_samples fails now, not at the first evaluation

    patch_trainer(Trainer)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                      processing_class=processor or tokenizer)
    extras = [lambda: transform_stats(stream_loader(trainer)),    # skips, drops: data_* fields
              lambda: getattr(data_metrics_log(trainer), "latest", {})]   # the data path's figures: data_*
    if cfg.stream.cache_dir:     # block cache counters: logged periodically and in train_log.jsonl
        cache_stats = CacheStatsCallback(stream.source.stats, args.process_index, every_s=60.0)
        trainer.add_callback(cache_stats)
        extras.append(cache_stats.fields)
    if isinstance(stream, MixtureStream):   # samples per source: source_samples in train_log.jsonl
        source_samples = SourceCountsCallback(lambda: stream_loader(trainer), lambda: source_loss(trainer))
        trainer.add_callback(source_samples)
        extras.append(source_samples.fields)
        extras.append(lambda: weight_changes(stream))     # mixture_changes: a change of weights, when one was made
    if getattr(cfg.stream, "growth", "off") == "follow":     # the data stopped arriving: end with a checkpoint
        trainer.add_callback(FollowEndCallback(stream))
    trainer.add_callback(TrainLogCallback(args.output_dir, samples_per_step(args),
                                          extra_of=lambda: {k: v for f in extras for k, v in f().items()}))
    if cfg.transform.consumed_log:
        trainer.add_callback(ConsumedLogCallback(cfg.transform.consumed_log, args.process_index,
                                                 lambda: stream_loader(trainer)))
    return trainer


def resolve_resume(cfg: TrainerConfig, trainer) -> str | None:
    """Explicit ``train.resume_from_checkpoint``, else the last complete checkpoint in output_dir."""
    explicit = cfg.train.get("resume_from_checkpoint")
    if explicit:
        check_complete(explicit)
        return explicit
    return resume_latest(trainer.args.output_dir, trainer.args.process_index == 0, barrier)


def die_with_launcher() -> None:
    """Under torchrun each rank runs in its own session; if the launcher is killed, take the rank down
    too instead of leaving it training (and writing checkpoints) on its own."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:               # the launcher is already gone
        os._exit(1)


def run_training(config_path: str, overrides=(), callbacks=(), **argument_overrides):
    """Train as the yaml says; ``callbacks``: more ``TrainerCallback``s (e.g. a MixtureWeightsCallback)."""
    die_with_launcher()
    check_training_data(config_path, overrides)     # no model, no network: before anything is built
    cfg = TrainerConfig.from_yaml(config_path, overrides)
    threads = set_trainer_threads()
    args = training_arguments(cfg, **argument_overrides)
    # one job per output_dir, taken before the model is built and the checkpoints are read or cleaned (a
    # second job fails in seconds); the trainer's train() holds it again inside, nested
    with output_dir_lock(args.output_dir, args.process_index, args.world_size):
        trainer = build_trainer(cfg, args, **argument_overrides)
        for callback in callbacks:
            trainer.add_callback(callback)
        checkpoint = resolve_resume(cfg, trainer)
        if args.process_index == 0:
            log.warning("%s", startup_summary(cfg, args, checkpoint, threads))
        nothing_left = finished_step(checkpoint, args.max_steps) is not None
        with quiet_tied_weights(trainer.model):
            result = trainer.train(resume_from_checkpoint=checkpoint)
            save_final_model(trainer, checkpoint if nothing_left else None)
        save_results(trainer, result.metrics, nothing_left)
        return result


def save_results(trainer, metrics: dict, nothing_left: bool) -> None:
    """End a run as HF's example scripts do: ``train_results.json``, ``all_results.json`` and ``trainer_state.json``
    (main process). A rerun with nothing left to train keeps those of the run that trained."""
    out = trainer.args.output_dir
    if nothing_left and all(os.path.isfile(os.path.join(out, name)) for name in RUN_RESULTS):
        return
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()


def save_final_model(trainer, finished_checkpoint: str | None) -> None:
    """The final model (and tokenizer / processor) in output_dir: every rank calls save_model, the main process
    writes. ``finished_checkpoint``: nothing was left to train, so the model is that checkpoint's, loaded first."""
    if finished_checkpoint is not None:
        if trainer.args.deepspeed or trainer.args.fsdp:   # their engines load inside train() only
            log.warning("the final model is %s's (DeepSpeed / FSDP: not saved again in %s)", finished_checkpoint,
                        trainer.args.output_dir)
            return
        trainer._load_from_checkpoint(finished_checkpoint)
    trainer.save_model()
