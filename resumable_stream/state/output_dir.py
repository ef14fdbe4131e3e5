"""A run's ``output_dir``: its ``checkpoint-N/`` directories, which are complete, which one a restart resumes, and
the removal of those a kill cut short; the policy, apart from the format (:mod:`.checkpoint`). Complete: the
trainer's files (``required``) and a ``stream_state/`` manifest that loads (written last)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Sequence

from ..errors import SidecarError
from .checkpoint import read_manifest
from .names import MANIFEST, STATE_DIR

log = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
TRAINER_FILES = (TRAINER_STATE,)    # what the transformers Trainer writes before our stream state


def checkpoint_step(path: str) -> int | None:
    m = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every ``checkpoint-N`` directory of ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found)


def is_complete(checkpoint: str, required: Sequence[str] = TRAINER_FILES) -> bool:
    """Complete = ``required`` and the manifest are there as regular files: a symlink or FIFO named manifest.json was
    not written by a save, and would put its checkpoint ahead of an older good one."""
    return (all(_regular_file(os.path.join(checkpoint, name)) for name in required)
            and _regular_file(os.path.join(checkpoint, STATE_DIR, MANIFEST)))


def _regular_file(path: str) -> bool:
    """A regular file itself (os.path.isfile follows a symlink)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def latest_complete_checkpoint(output_dir: str, required: Sequence[str] = TRAINER_FILES) -> str | None:
    """The newest ``checkpoint-N`` of a run that was completely written, or None: a save cut short by a kill is
    passed over, the one before it resumes."""
    return next((path for _, path in reversed(checkpoint_dirs(output_dir)) if is_complete(path, required)), None)


def check_complete(checkpoint: str, required: Sequence[str] = TRAINER_FILES) -> None:
    if not os.path.isdir(checkpoint):
        raise SidecarError(f"checkpoint {checkpoint!r}: not found")
    for name in required:
        if not os.path.isfile(os.path.join(checkpoint, name)):
            raise SidecarError(f"checkpoint {checkpoint!r}: no {name}; it was not completely written")
    state_dir = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(state_dir):
        raise SidecarError(f"checkpoint {checkpoint!r}: no {STATE_DIR}/ with the data stream's state; it was not "
                           "written by a resumable-stream trainer, so the data position cannot be restored exactly")
    read_manifest(state_dir)   # raises when incomplete


def remove_incomplete_after(output_dir: str, keep: str | None, required: Sequence[str] = TRAINER_FILES) -> list[str]:
    """Delete checkpoints newer than ``keep`` that were cut short (rank 0, before training resumes)."""
    keep_step = checkpoint_step(keep) if keep else -1
    removed = []
    for step, path in checkpoint_dirs(output_dir):
        if step > keep_step and not is_complete(path, required):
            log.warning("removing incomplete checkpoint %s (interrupted while it was written)", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def resume_latest(output_dir: str, is_main: bool, barrier: Callable[[], None],
                  required: Sequence[str] = TRAINER_FILES) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (None: start afresh); rank 0 first removes the
    newer ones a kill cut short, so that the run writes its next checkpoints into clean directories."""
    latest = latest_complete_checkpoint(output_dir, required)
    if is_main:
        remove_incomplete_after(output_dir, latest, required)
    barrier()
    return latest
