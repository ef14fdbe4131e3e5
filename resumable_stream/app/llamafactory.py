"""``resumable-stream llamafactory train CONFIG [key=value ...]``: LLaMA-Factory's ``run_exp`` with our stream,
its dataset, processor, checkpoint and trainer hooks patched while it runs (docs/llamafactory.md)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from ..integrations.llamafactory import settings
from ..state.output_dir import TRAINER_STATE, latest_complete_checkpoint

log = logging.getLogger(__name__)


def _global_step(path: str) -> int | None:
    try:
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def finished_at(args: dict[str, Any]) -> int | None:
    """The step a run on ``args``' output_dir already finished at (>= max_steps), or None."""
    out = args.get("output_dir")
    if not out or args.get("overwrite_output_dir") or not os.path.isdir(out):
        return None
    explicit = args.get("resume_from_checkpoint")
    candidates = [explicit] if isinstance(explicit, str) else [latest_complete_checkpoint(out), out]
    steps = [_global_step(c) for c in candidates if c]
    done = max((s for s in steps if s is not None), default=None)
    return done if done is not None and done >= args["max_steps"] else None


@contextlib.contextmanager
def patched(ours: dict[str, Any]) -> Iterator[None]:
    """LLaMA-Factory's workflows reading our stream, resuming complete checkpoints, with patched trainers."""
    import llamafactory.hparams.parser as parser
    import llamafactory.model.loader as model_loader
    import llamafactory.train.dpo.workflow as dpo_workflow
    import llamafactory.train.kto.workflow as kto_workflow
    import llamafactory.train.pt.workflow as pt_workflow
    import llamafactory.train.rm.workflow as rm_workflow
    import llamafactory.train.sft.workflow as sft_workflow
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer
    from llamafactory.train.pt.trainer import CustomTrainer
    from llamafactory.train.rm.trainer import PairwiseTrainer
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    from ..integrations.llamafactory.data import get_dataset
    from ..integrations.llamafactory.media import ProcessorLoader
    from ..integrations.llamafactory.reward import load_value_head_checkpoint
    from ..integrations.llamafactory.weights import load_renamed_checkpoint, patch_checkpoint_loader
    from ..integrations.transformers import patch_trainer

    # trl's DPO / KTO trainers: our patched get_train_dataloader stands in for trl's, which adds only
    # precompute_ref_log_probs (LLaMA-Factory turns it off); their _save_checkpoint ends in the Trainer's
    for trainer in (CustomSeq2SeqTrainer, CustomTrainer, CustomDPOTrainer, CustomKTOTrainer, PairwiseTrainer):
        patch_trainer(trainer)
    # a LoRA reward model resumes (llamafactory-cli's fails); a full Qwen2-VL its weights (llamafactory-cli's not)
    patch_checkpoint_loader(PairwiseTrainer, load_value_head_checkpoint)
    for trainer in (CustomSeq2SeqTrainer, CustomTrainer):
        patch_checkpoint_loader(trainer, load_renamed_checkpoint)
    patches = [(m, "get_dataset", functools.partial(get_dataset, m.get_dataset, ours))
               for m in (sft_workflow, pt_workflow, dpo_workflow, kto_workflow, rm_workflow)]
    patches += [(parser, "get_last_checkpoint", latest_complete_checkpoint),
                (model_loader, "AutoProcessor", ProcessorLoader)]     # a VL processor without torchvision
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    try:
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _callbacks(ours: dict[str, Any]) -> list:
    from ..integrations.llamafactory.callbacks import ConsumedLog, TrimLogOnResume

    out = [TrimLogOnResume()]
    log_dir = ours.get("consumed_log")
    if log_dir:   # true: the run's output_dir/consumed, known when training begins
        out.append(ConsumedLog(None if log_dir is True else log_dir))
    return out


def _launched() -> bool:
    """Already one rank of a torchrun job."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _wants_torchrun() -> bool:
    from llamafactory.extras.misc import get_device_count, is_env_enabled

    return is_env_enabled("FORCE_TORCHRUN") or get_device_count() > 1


def torchrun_command(config: str, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The torchrun command (and environment) ``llamafactory-cli train`` would run, for our entry point."""
    from llamafactory.extras.misc import find_available_port, get_device_count, is_env_enabled

    env = dict(os.environ)
    addr = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = os.getenv("MASTER_PORT", str(find_available_port()))
    nproc = os.getenv("NPROC_PER_NODE", str(get_device_count() or 1))
    if is_env_enabled("OPTIM_TORCH", "1"):        # as llamafactory's launcher sets them
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
    run = [sys.executable, "-m", "torch.distributed.run"]
    rdzv_id = os.getenv("RDZV_ID")
    if rdzv_id is not None:                       # elastic: torchrun's rendezvous
        run += ["--nnodes", os.getenv("NNODES", "1"), "--nproc-per-node", nproc, "--rdzv-id", rdzv_id,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}",
                "--max-restarts", os.getenv("MAX_RESTARTS", "0")]
    else:
        run += ["--nnodes", os.getenv("NNODES", "1"), "--node_rank", os.getenv("NODE_RANK", "0"),
                "--nproc_per_node", nproc, "--master_addr", addr, "--master_port", port]
    return run + ["-m", "resumable_stream", "llamafactory", "train", config, *overrides], env


DATASET_INFO = "dataset_info.json"      # LLaMA-Factory's DATA_CONFIG
_REMOTE_ENTRIES = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def check_data(args: dict[str, Any], ours: dict[str, Any]) -> None:
    """What LLaMA-Factory would find wrong with the data only after seconds of imports and the model, said before:
    ``dataset_info.json`` and its ``dataset`` entries, local ``file_name`` files and the resume paths. Read as
    its ``get_dataset_list`` reads them, without importing it; remote entries are left to it."""
    from ..io.safe_files import FileRefused, JSONRefused, parse_json, read_regular_file
    from .preflight import check_checkpoint, check_resume_state

    names = args.get("dataset")
    dataset_dir = args.get("dataset_dir", "data")
    if names and isinstance(dataset_dir, str) and dataset_dir != "ONLINE" and not dataset_dir.startswith("REMOTE:"):
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else [str(n) for n in names]
        info_path = os.path.join(dataset_dir, DATASET_INFO)
        try:
            info = parse_json(read_regular_file(info_path, 64 << 20))
        except (OSError, FileRefused, JSONRefused) as e:
            raise ConfigError(f"dataset: got {names!r}; {info_path!r} cannot be read ({getattr(e, 'strerror', None) or e}); "
                              "allowed: the names of entries of dataset_dir's dataset_info.json") from None
        if not isinstance(info, dict):
            raise ConfigError(f"{info_path!r}: got a JSON {type(info).__name__}; allowed: a mapping of datasets")
        for name in names:
            entry = info.get(name)
            if not isinstance(entry, dict):
                raise ConfigError(f"dataset: {name!r} is not an entry of {info_path!r}; its entries: "
                                  f"{', '.join(sorted(map(str, info))[:20])}")
            if any(key in entry for key in _REMOTE_ENTRIES) or not isinstance(entry.get("file_name"), str):
                continue
            path = os.path.join(dataset_dir, entry["file_name"])
            if not os.path.exists(path):          # the words of integrations/llamafactory/data.py, which finds it
                raise ConfigError(f"dataset {entry['file_name']!r} (dataset_info.json file_name): {path!r} not found")
    check_resume_state(ours.get("resume_state_path"), "resumable_stream.resume_state_path")
    check_checkpoint(args)


def train(config: str, overrides: list[str], callbacks: tuple = ()) -> int:
    """Run (or launch) the training; the exit code. ``callbacks``: more TrainerCallbacks for LLaMA-Factory's
    trainer (in this process only: torchrun's ranks run the command afresh)."""
    args, ours = settings.read(config, overrides)
    settings.refuse_unsupported(args)
    check_data(args, ours)      # before the launch, LLaMA-Factory's parser, tokenizer and model
    args["streaming"] = True
    if not _launched() and _wants_torchrun():
        command, env = torchrun_command(config, overrides)
        log.warning("launching %s", " ".join(command))
        return subprocess.run(command, env=env).returncode
    done = finished_at(args)
    if done is not None:
        print(f"resumable-stream llamafactory: {args['output_dir']} already finished at step {done} (max_steps "
              f"{args['max_steps']}); nothing to train, outputs left as they are", file=sys.stderr)
        return 0
    from llamafactory.train.tuner import run_exp

    from .train import die_with_launcher

    die_with_launcher()
    with patched(ours):
        run_exp(args=args, callbacks=[*_callbacks(ours), *callbacks])
    return 0


def check_command(command: str) -> None:
    if command != "train":
        raise ConfigError(f"resumable-stream llamafactory {command}: allowed: train (LLaMA-Factory's chat, eval, "
                          "export and webui run as they are, with llamafactory-cli)")
