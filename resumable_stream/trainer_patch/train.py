"""Train a causal LM from one yaml file; a restart with the same output_dir resumes exactly.

    python examples/train_lm.py CONFIG                 # one process
    torchrun --nproc_per_node=N examples/train_lm.py CONFIG
    resumable-stream train CONFIG
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys

from ..devices import detect_device
from ..errors import ConfigError
from ..stream import ResumableStream
from .callbacks import CacheStatsCallback, ConsumedLogCallback, TrainLogCallback
from .checkpoints import check_complete, latest_complete_checkpoint, remove_incomplete_after
from .config import TrainerConfig
from .patch import TrainingStream, patch_trainer

log = logging.getLogger(__name__)


class ColumnKey:
    """Sample key from a column (``data.id_column``); picklable for DataLoader workers."""

    def __init__(self, column: str):
        self.column = column

    def __call__(self, sample: dict, where: tuple[int, int]) -> str:
        return str(sample[self.column])


def shard_row(sample: dict, where: tuple[int, int]) -> str:
    return f"{where[0]}:{where[1]}"


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


def _load_model(cfg: TrainerConfig, tokenizer, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    dtype = None if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    if cfg.model.name_or_path:
        try:
            return AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=dtype or "auto",
                                                        trust_remote_code=cfg.model.trust_remote_code)
        except OSError as e:
            raise ConfigError(f"model.name_or_path: {cfg.model.name_or_path!r} cannot be loaded ({e})") from None
    fields = dict(cfg.model.config)
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", len(tokenizer))
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            fields.setdefault(name, getattr(tokenizer, name))
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.config: model_type {model_type!r} with these fields is not a transformers "
                          f"config ({type(e).__name__}: {e})") from None
    set_seed(seed)   # the random init is part of what a rerun must reproduce
    model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype) if dtype is not None else model


def _check_columns(cfg: TrainerConfig, columns: list[str] | None) -> None:
    if not columns:
        return   # unknown until read (some json / hub datasets); the loader catches an all-skipped epoch
    tc = cfg.transform
    wanted = {"text_column": tc.text_column} if tc.format == "text" else {"messages_column": tc.messages_column}
    if tc.id_column:
        wanted["id_column"] = tc.id_column
    for key, column in wanted.items():
        if column not in columns:
            raise ConfigError(f"data.{key}: got {column!r}; the dataset's columns are: {', '.join(columns)}")


def build_trainer(cfg: TrainerConfig, **argument_overrides):
    """Everything but ``train()``: arguments, tokenizer, model, stream, patched Trainer."""
    from transformers import Trainer

    from ..transforms.text import TextProcessor, collate

    device = detect_device()
    overrides = dict(argument_overrides)
    if "ddp_backend" not in cfg.train and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        overrides["ddp_backend"] = device.backend
    args = cfg.training_arguments(**overrides)
    tokenizer = _load_tokenizer(cfg)
    model = _load_model(cfg, tokenizer, args.seed)

    # The loader restores the state (stream cursor + transform carry), not the bare stream.
    stream = ResumableStream(cfg.stream.replace(resume_state_path=None), rank=args.process_index,
                             world_size=args.world_size, num_workers=args.dataloader_num_workers)
    _check_columns(cfg, stream.source.column_names)
    processor_factory = functools.partial(TextProcessor, tokenizer, cfg.transform)
    collate_fn = functools.partial(collate, pad_token_id=tokenizer.pad_token_id)
    key_fn = ColumnKey(cfg.transform.id_column) if cfg.transform.id_column else shard_row
    dataset = TrainingStream(stream, collate_fn, processor_factory, key_fn,
                             resume_state_path=cfg.stream.resume_state_path)

    patch_trainer(Trainer)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    extra_of = None
    if cfg.stream.cache_dir:     # block cache counters: logged periodically and in train_log.jsonl
        cache_stats = CacheStatsCallback(stream.source.stats, args.process_index, every_s=60.0)
        trainer.add_callback(cache_stats)
        extra_of = cache_stats.fields
    trainer.add_callback(TrainLogCallback(args.output_dir, per_step, extra_of=extra_of))
    if cfg.transform.consumed_log:
        trainer.add_callback(ConsumedLogCallback(cfg.transform.consumed_log, args.process_index,
                                                 lambda: trainer._rs_loader))
    return trainer


def resolve_resume(cfg: TrainerConfig, trainer) -> str | None:
    """Explicit ``train.resume_from_checkpoint``, else the last complete checkpoint in output_dir."""
    explicit = cfg.train.get("resume_from_checkpoint")
    if explicit:
        check_complete(explicit)
        return explicit
    latest = latest_complete_checkpoint(trainer.args.output_dir)
    if trainer.args.process_index == 0:
        remove_incomplete_after(trainer.args.output_dir, latest)
    return latest


def _die_with_launcher() -> None:
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


def run_training(config_path: str, **argument_overrides):
    _die_with_launcher()
    cfg = TrainerConfig.from_yaml(config_path)
    trainer = build_trainer(cfg, **argument_overrides)
    checkpoint = resolve_resume(cfg, trainer)
    if checkpoint:
        log.warning("resuming from %s", checkpoint)
    return trainer.train(resume_from_checkpoint=checkpoint)
