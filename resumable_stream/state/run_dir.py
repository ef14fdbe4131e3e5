"""The checkpoints of a training run's output_dir (``checkpoint-N/``) and which of them are complete; light
enough for the command line (no transformers)."""

from __future__ import annotations

import os
import re

from .sidecar import MANIFEST, STATE_DIR

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def checkpoint_step(path: str) -> int | None:
    m = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found)


def is_complete(checkpoint: str) -> bool:
    """Complete = the Trainer's state and a stream-state manifest (written last) are both there."""
    return (os.path.isfile(os.path.join(checkpoint, TRAINER_STATE))
            and os.path.isfile(os.path.join(checkpoint, STATE_DIR, MANIFEST)))


def latest_complete_checkpoint(output_dir: str) -> str | None:
    for _, path in reversed(checkpoint_dirs(output_dir)):
        if is_complete(path):
            return path
    return None
