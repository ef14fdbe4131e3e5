"""What ``resumable-stream train`` says when it starts (fresh or resumed, where, with which data settings),
and the one transformers warning it hides on resume (missing tied weights)."""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import re
from collections.abc import Iterator

from ..config.stream_config import MixtureConfig, StreamConfig
from ..config.trainer import TrainerConfig
from ..observe.prometheus import metrics_url
from ..state.output_dir import checkpoint_step


def _dataset(s: StreamConfig) -> str:
    name = s.dataset_name_or_path + (f" ({s.name})" if s.name else "")
    files = f", data_files {s.data_files}" if s.data_files else ""
    return f"{name}{files}, split {s.split}"


def _order(s: StreamConfig) -> str:
    return f"shuffle seed {s.shuffle_seed}, buffer {s.buffer_size}" if s.shuffle else "no shuffle"


def _data_lines(stream: StreamConfig | MixtureConfig) -> list[str]:
    if isinstance(stream, MixtureConfig):
        lines = [f"data: mixture of {len(stream.sources)} sources, stopping {stream.stopping}"]
        for label, w, s in zip(stream.labels or (), stream.probabilities, stream.sources):
            lines.append(f"  {label} ({w:.3g}): {_dataset(s)}; {_order(s)}")
        first = stream.sources[0]
    else:
        lines, first = [f"data: {_dataset(stream)}; {_order(stream)}"], stream
    prefetch = "adaptive" if first.prefetch_blocks is None else first.prefetch_blocks
    lines.append(f"  cache_dir {stream.cache_dir or 'off'}; prefetch_blocks {prefetch}, "
                 f"prefetch_memory_mb {first.prefetch_memory_mb:g}; num_partitions "
                 f"{stream.num_partitions or 'ranks x workers'}")
    return lines


def startup_summary(cfg: TrainerConfig, args, checkpoint: str | None, threads: str) -> str:
    """A few lines: fresh or resumed (and from which checkpoint), output_dir, ranks and device, data settings."""
    if checkpoint:
        step = checkpoint_step(checkpoint)
        head = f"resuming from {checkpoint}" + (f" (step {step} of {args.max_steps})" if step is not None else "")
    elif cfg.stream.resume_state_path:
        head = (f"starting at step 0 (no complete checkpoint in output_dir), {args.max_steps} steps; the data "
                f"continues from data.resume_state_path {cfg.stream.resume_state_path}")
    else:
        head = f"starting afresh (no complete checkpoint in output_dir), {args.max_steps} steps"
    t = cfg.transform
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    lines = [
        f"resumable-stream train: {head}",
        f"  output_dir {os.path.abspath(args.output_dir)}",
        f"  {args.world_size} rank{'s' if args.world_size > 1 else ''} on {args.device}"
        + (f" ({args.ddp_backend})" if args.world_size > 1 and args.ddp_backend else "")
        + f"; torch threads per process {threads}",
        *("  " + line for line in _data_lines(cfg.stream)),
        f"  format {t.format}, max_seq_len {t.max_seq_len}, packing {t.packing}; batch size per device "
        f"{args.per_device_train_batch_size} x gradient accumulation {args.gradient_accumulation_steps} x "
        f"{args.world_size} rank(s) = {per_step} per step; dataloader_num_workers {args.dataloader_num_workers}",
        _metrics_line(cfg.monitor, args.world_size),
    ]
    return "\n".join(lines)


def _metrics_line(monitor, world_size: int) -> str:
    """Where the Prometheus endpoint is (data.metrics_port, data.metrics_addr), or that there is none."""
    if monitor.metrics_port is None:
        return "  metrics endpoint off (data.metrics_port)"

    served = monitor.metrics_addr or "0.0.0.0, every IPv4 interface"
    others = "; another rank on the port + its local rank" if world_size > 1 else ""
    return f"  metrics {metrics_url(monitor.metrics_port, monitor.metrics_addr)} (served on {served}{others})"


_MISSING = re.compile(r"missing keys in the checkpoint model loaded: (\[.*\])")


def tied_parameter_names(model) -> set[str]:
    """Names of parameters that share their tensor with another name (lm_head.weight and embed_tokens.weight
    with tie_word_embeddings): a checkpoint saves one of them."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return {n for names in by_tensor.values() if len(names) > 1 for n in names}


@contextlib.contextmanager
def quiet_tied_weights(model) -> Iterator[None]:
    """Drops the Trainer's "missing keys" warning when every missing key is a tied weight; any other missing
    key shows the warning unchanged."""
    tied = tied_parameter_names(model)

    def hide(record: logging.LogRecord) -> bool:     # a logging filter may be a function
        m = _MISSING.search(record.getMessage())
        try:
            keys = ast.literal_eval(m.group(1)) if m is not None else None
        except (ValueError, SyntaxError):
            return True
        return not (keys and set(keys) <= tied)

    logger = logging.getLogger("transformers.trainer")
    logger.addFilter(hide)
    try:
        yield
    finally:
        logger.removeFilter(hide)
