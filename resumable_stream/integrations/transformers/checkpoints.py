"""Which checkpoints are complete, and writing a checkpoint's stream state from every rank."""

from __future__ import annotations

import logging
import os
import shutil

from ...errors import SidecarError
from ...state.checkpoint import finish
from ...state.run_dir import (
    TRAINER_STATE,
    checkpoint_dirs,
    checkpoint_step,
    is_complete,
    latest_complete_checkpoint,
)
from ...state.sidecar import STATE_DIR, read_manifest

log = logging.getLogger(__name__)
__all__ = ["TRAINER_STATE", "check_complete", "checkpoint_dirs", "is_complete", "latest_complete_checkpoint",
           "refresh_stream_files", "remove_incomplete_after", "resume_latest", "save_stream_state"]


def check_complete(checkpoint: str) -> None:
    if not os.path.isdir(checkpoint):
        raise SidecarError(f"checkpoint {checkpoint!r}: not found")
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        raise SidecarError(f"checkpoint {checkpoint!r}: no {TRAINER_STATE}; it was not completely written")
    state_dir = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(state_dir):
        raise SidecarError(f"checkpoint {checkpoint!r}: no {STATE_DIR}/ with the data stream's state; it was not "
                           "written by a resumable-stream trainer, so the data position cannot be restored exactly")
    read_manifest(state_dir)   # raises when incomplete


def remove_incomplete_after(output_dir: str, keep: str | None) -> list[str]:
    """Delete checkpoints newer than ``keep`` that were cut short (rank 0, before training resumes)."""
    keep_step = checkpoint_step(keep) if keep else -1
    removed = []
    for step, path in checkpoint_dirs(output_dir):
        if step > keep_step and not is_complete(path):
            log.warning("removing incomplete checkpoint %s (interrupted while it was written)", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def resume_latest(output_dir: str, is_main: bool, barrier) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (None: start afresh); rank 0 first removes the
    newer ones a kill cut short, so that the run writes its next checkpoints into clean directories."""
    latest = latest_complete_checkpoint(output_dir)
    if is_main:
        remove_incomplete_after(output_dir, latest)
    barrier()
    return latest


def refresh_stream_files(stream) -> None:
    """At each save (every rank saves at the same step): with ``data.growth``, the files that appeared join the
    plan, so the checkpoint's index has them. DataLoader workers read ahead with the plan they started with:
    with them, new files join at the next resume instead (said once)."""
    if getattr(stream.config, "growth", "off") == "off":
        return
    if stream.num_workers:
        if not _growth_noted:
            _growth_noted.append(True)
            log.info("data.growth: with %d DataLoader workers new files join at the next resume, not at a save",
                     stream.num_workers)
        return
    joins = stream.refresh_files()    # an epoch; a mixture: {source label: epoch} of the sources that grew
    if isinstance(joins, dict):
        for label, epoch in joins.items():
            log.info("data.growth: new files of source %r join the run from its epoch %d", label, epoch)
    elif joins is not None:
        log.info("data.growth: new files join the run from epoch %d", joins)


_growth_noted: list[bool] = []


def save_stream_state(loader, checkpoint: str, world_size: int, is_main: bool, barrier) -> None:
    """Every rank writes its sidecar; after a barrier rank 0 writes the manifest that completes the checkpoint."""
    state_dir = os.path.join(checkpoint, STATE_DIR)
    os.makedirs(state_dir, exist_ok=True)
    loader.save_sidecar(state_dir, manifest=False)   # rank file (+ fingerprint and index on rank 0); the manifest last
    barrier()
    if is_main:
        finish(state_dir, world_size)
    barrier()
