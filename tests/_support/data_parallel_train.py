"""Run a training script (``examples/train_lm.py`` / ``train_vl.py``) with a data-parallelism check.

    python -m torch.distributed.run --nproc_per_node 2 tests/_support/data_parallel_train.py SCRIPT CONFIG

Every Trainer it builds gets a callback that, at each logging step, gathers what each rank's
``training_step`` returned since the previous log (the Trainer logs the mean of these over ranks, see
``Trainer._maybe_log_save_evaluate``), and at the end of training gathers each rank's sum of parameters.
Rank 0 appends both to ``output_dir/data_parallel.jsonl``; ``training_helpers.assert_data_parallel``
checks them. Ranks that each trained their own copy of the model end with different parameters.

With ``RS_TEST_RECORD=PATH`` each process also appends to PATH one line when it starts (its RANK,
LOCAL_RANK, GROUP_RANK and run tag: which launcher got which ranks) and one each time it resolves a dataset
(lists its files and builds the index): what "resolved once per job" is counted with.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import resumable_stream.app.train as train_module

RECORDS = "data_parallel.jsonl"


def _gather(value: torch.Tensor) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value.item()]
    out = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return [v.item() for v in out]


class DataParallelCheck(TrainerCallback):
    def __init__(self, trainer):
        self.losses: list[torch.Tensor] = []
        self.last_logged_step = 0
        original = trainer.training_step

        def training_step(*args, **kwargs):
            loss = original(*args, **kwargs)
            self.losses.append(loss.detach().clone())
            return loss

        trainer.training_step = training_step

    def _write(self, args, state, record: dict) -> None:
        if state.is_world_process_zero:
            with open(os.path.join(args.output_dir, RECORDS), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_logged_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        mine = torch.stack(self.losses).sum() / (state.global_step - self.last_logged_step)
        self.losses, self.last_logged_step = [], state.global_step
        self._write(args, state, {"step": state.global_step, "logged_loss": logs["loss"],
                                  "rank_losses": _gather(mine.to(torch.float64))})

    def on_train_end(self, args, state, control, model=None, **kwargs):
        total = sum(p.detach().to(torch.float64).sum() for p in model.parameters())
        self._write(args, state, {"step": state.global_step, "parameter_sums": _gather(total.to(args.device))})


def _record(path: str, event: str) -> None:
    env = os.environ
    line = {"event": event, "rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)),
            "group_rank": int(env.get("GROUP_RANK", 0)), "run": env.get("RS_TEST_RUN"), "pid": os.getpid()}
    with open(path, "a", encoding="utf-8") as f:      # one short write per line: lines of processes never mix
        f.write(json.dumps(line) + "\n")


def _count_resolutions(path: str) -> None:
    import resumable_stream.sources.open as opening

    original = opening.resolve_split

    def resolve_split(*args, **kwargs):
        _record(path, "resolve")
        return original(*args, **kwargs)

    opening.resolve_split = resolve_split


def _build_checked(original):
    def build_trainer(*args, **kwargs):
        trainer = original(*args, **kwargs)
        trainer.add_callback(DataParallelCheck(trainer))
        return trainer
    return build_trainer


if __name__ == "__main__":
    script, config = sys.argv[1:]
    if os.environ.get("RS_TEST_RECORD"):
        _record(os.environ["RS_TEST_RECORD"], "start")
        _count_resolutions(os.environ["RS_TEST_RECORD"])
    train_module.build_trainer = _build_checked(train_module.build_trainer)
    sys.argv = [script, config]
    runpy.run_path(script, run_name="__main__")
