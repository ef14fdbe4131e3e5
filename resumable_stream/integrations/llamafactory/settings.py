"""The yaml ``llamafactory-cli train`` reads, split into LLaMA-Factory's arguments (to its own parser, unchanged)
and our ``resumable_stream:`` section, checked here; a key whose meaning a resumable stream cannot keep exactly
is a ConfigError naming it and why (:func:`refuse_unsupported`)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

from ...config.stream_config import StreamConfig
from ...config.yaml_files import load_text, read_config_text
from ...errors import ConfigError, shown
from ...observe.monitoring import MONITOR_KEYS, MonitorSettings
from .held_out import check_val_size
from .media import MEDIA_KEYS, media_settings

SECTION = "resumable_stream"
# data keys of ours that may be set in the section (the stream's; the dataset comes from dataset_info.json)
STREAM_KEYS = ("shuffle", "buffer_size", "shuffle_seed", "interleave_shards", "block_rows", "cache_dir",
               "cache_size_limit_gb", "retries", "retry_backoff_s", "timeout_s", "retry_budget_s",
               "num_partitions", "elastic", "elastic_determinism", "index_path", "verify_files", "prefetch_blocks", "prefetch_memory_mb",
               "storage_options", "resume_state_path")
# mixture_change: allow lets a resume change interleave_probs or the datasets of a mixture (data.mixture_change)
MIXTURE_KEYS = ("mixture_change",)
# consumed_log: a directory (true: output_dir/consumed), the keys of the samples each step consumed, per rank; the monitoring keys:
# a Prometheus endpoint per rank, the data-bound warning (resumable_stream.observe.monitoring)
# bad_sample, max_image_bytes, allow_absolute_image_paths: the images of multimodal rows (media.py)
OWN_KEYS = ("consumed_log", *MIXTURE_KEYS, *MONITOR_KEYS, *MEDIA_KEYS)


def read(config: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LLaMA-Factory's arguments, our section) of ``config`` with ``key=value`` overrides merged as
    ``llamafactory-cli`` merges them (OmegaConf: the yaml, then the dotlist)."""
    # omegaconf comes with llamafactory (an optional extra): imported when used
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(config):
        raise ConfigError(f"config file {shown(config)}: not found")
    if not config.endswith((".yaml", ".yml")):
        raise ConfigError(f"config file {shown(config)}: allowed: a .yaml / .yml file, as llamafactory-cli train takes")
    # bounded first (size, aliases, nesting: config/yaml_files.py), as our own yaml is; OmegaConf would expand
    # an alias chain or recurse into a self-referencing alias
    text = read_config_text(config)
    load_text(text, f"config file {shown(config)}")
    for item in overrides:
        load_text(item.partition("=")[2], f"override {shown(item)}")
    try:
        merged = OmegaConf.merge(OmegaConf.load(io.StringIO(text)), OmegaConf.from_cli(list(overrides)))
        args = OmegaConf.to_container(merged)
    except (OmegaConfBaseException, ValueError, OSError) as e:
        raise ConfigError(f"config file {shown(config)} with overrides {shown(overrides)}: {type(e).__name__}: {e}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"config file {shown(config)}: got {type(args).__name__}; allowed: a mapping of arguments")
    return split(args)


def split(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LLaMA-Factory's arguments, our section, checked) of a yaml's mapping."""
    args = dict(args)
    ours = args.pop(SECTION, None) or {}
    if not isinstance(ours, dict):
        raise ConfigError(f"{SECTION}: got {shown(ours)}; allowed: a mapping of resumable-stream keys")
    unknown = sorted(set(ours) - set(STREAM_KEYS) - set(OWN_KEYS))
    if unknown:
        raise ConfigError(f"{SECTION}.{unknown[0]}: unknown key; allowed: {', '.join(STREAM_KEYS + OWN_KEYS)}")
    if ours.get("log_source_loss"):
        raise ConfigError(f"{SECTION}.log_source_loss: got {shown(ours['log_source_loss'])}; not supported with "
                          "LLaMA-Factory (its trainers compute their own losses); allowed: false, or train with "
                          "`resumable-stream train`")
    log_dir = ours.get("consumed_log")
    if not (log_dir is None or isinstance(log_dir, bool) or (isinstance(log_dir, str) and log_dir.strip())):
        raise ConfigError(f"{SECTION}.consumed_log: got {shown(log_dir)}; allowed: null or false (off), true "
                          "(output_dir/consumed) or a directory")
    _check_stream_keys(ours)
    change = ours.get("mixture_change", "refuse")
    if change not in ("refuse", "allow"):
        raise ConfigError(f"{SECTION}.mixture_change: got {shown(change)}; allowed: refuse (default: resuming with other "
                          "interleave_probs or datasets is an error) or allow (they apply from the resume point)")
    monitor_settings(ours)
    media_settings(ours)
    return args, ours


def monitor_settings(ours: dict[str, Any]) -> MonitorSettings:
    """The section's metrics endpoint and data-bound warning settings (errors name ``resumable_stream.KEY``)."""
    try:
        return MonitorSettings.from_data(ours)
    except ConfigError as e:
        raise e.in_source(SECTION, set(MONITOR_KEYS)) from None


def _check_stream_keys(ours: dict[str, Any]) -> None:
    """Our data keys checked now, before LLaMA-Factory loads anything (errors name ``resumable_stream.KEY``)."""
    keys = {k: v for k, v in ours.items() if k in STREAM_KEYS}
    try:
        StreamConfig(dataset_name_or_path="org/dataset", **keys)
    except ConfigError as e:
        raise e.in_source(SECTION, set(keys)) from None


def _why(key: str, value: Any, reason: str) -> ConfigError:
    return ConfigError(f"{key}: got {shown(value)}; not supported by resumable-stream llamafactory: {reason}")


def refuse_unsupported(args: dict[str, Any], environ: Mapping[str, str] = os.environ) -> None:
    """The keys whose LLaMA-Factory meaning a resumable stream cannot keep exactly (before its parser runs);
    ``environ``: the environment LLaMA-Factory reads its launch switches from."""
    if environ.get("USE_RAY", "0").lower() in ("true", "y", "1"):     # LLaMA-Factory's is_env_enabled
        raise ConfigError(f"USE_RAY: got {shown(environ['USE_RAY'])}; not supported by resumable-stream llamafactory: "
                          "LLaMA-Factory's Ray workers run its training afresh, with its own get_dataset instead "
                          "of our stream; allowed: unset or 0 (launch several ranks with FORCE_TORCHRUN=1)")
    stage = args.get("stage", "sft")
    if stage == "ppo":
        raise _why("stage", stage, "PPO trains on responses it samples from the policy as it goes, so there is no "
                   "fixed sequence of batches to resume; allowed: pt, sft, rm, dpo, kto")
    if stage not in ("pt", "sft", "rm", "dpo", "kto"):
        raise _why("stage", stage, "allowed: pt, sft, rm, dpo, kto")
    if not args.get("do_train", False):
        raise _why("do_train", args.get("do_train"), "this command trains: set do_train: true "
                   "(evaluate or predict with llamafactory-cli)")
    if args.get("streaming") is False:
        raise _why("streaming", False, "the stream is always streamed; llamafactory-cli's non-streaming order "
                   "(a sampler over the whole dataset) cannot be resumed exactly: remove the key or set true")
    if args.get("max_samples") is not None:
        raise _why("max_samples", args["max_samples"], "refused with streaming, as llamafactory-cli refuses it; "
                   "bound training with max_steps")
    if not isinstance(args.get("max_steps"), int) or isinstance(args.get("max_steps"), bool) or args["max_steps"] <= 0:
        raise _why("max_steps", args.get("max_steps"), "required (an integer > 0): a stream has no length, as "
                   "llamafactory-cli requires it in streaming mode")
    check_val_size(args)         # an integer: the first rows held out (held_out.py)
    if args.get("tokenized_path"):
        raise _why("tokenized_path", args["tokenized_path"], "the stream tokenizes as it reads; there is no saved "
                   "tokenized dataset")
    if args.get("mix_strategy") == "interleave_once":
        raise _why("mix_strategy", "interleave_once", "datasets 4.0 (LLaMA-Factory 0.9.5's pin) has no "
                   "all_exhausted_without_replacement either; use interleave_under or interleave_over")
