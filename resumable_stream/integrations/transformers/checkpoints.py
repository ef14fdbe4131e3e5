"""Writing a checkpoint's stream state from every rank of a Trainer (which checkpoints are complete:
:mod:`resumable_stream.state.checkpoint`)."""

from __future__ import annotations

import logging
import os

from ...state.checkpoint import (
    finish,
)
from ...state.names import STATE_DIR

log = logging.getLogger(__name__)
__all__ = ["refresh_stream_files", "save_stream_state"]


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
