"""Callbacks added to LLaMA-Factory's own: its ``trainer_log.jsonl`` kept consistent on resume, and our
consumed-sample log."""

from __future__ import annotations

import os

from transformers import TrainerCallback

from ..transformers.callbacks import ConsumedLogCallback, truncate_jsonl

TRAINER_LOG = "trainer_log.jsonl"      # LLaMA-Factory's LogCallback writes it (one line per log)


class TrimLogOnResume(TrainerCallback):
    """LLaMA-Factory appends to ``trainer_log.jsonl`` on resume: the lines of the steps after the checkpoint
    (logged before a kill) would stay twice. Runs before its LogCallback writes a line (ours come first)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step > 0:
            truncate_jsonl(os.path.join(args.output_dir, TRAINER_LOG), state.global_step, step_key="current_steps")


class ConsumedLog(ConsumedLogCallback):
    """``DIR/rank-{r:05d}.jsonl`` (see ConsumedLogCallback), the loader taken from the callback arguments;
    ``directory`` None: the run's ``output_dir/consumed``."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._loader = None
        super().__init__(directory or "", 0, lambda: self._loader)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._loader = train_dataloader
        directory = self.directory or os.path.join(args.output_dir, "consumed")
        self.path = os.path.join(directory, f"rank-{args.process_index:05d}.jsonl")
        super().on_train_begin(args, state, control, **kwargs)
