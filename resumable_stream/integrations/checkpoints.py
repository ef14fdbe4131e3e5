"""A run's ``checkpoint-N/`` directories for any training loop, each completed by every rank's stream state after
the user's own files, the manifest last: a kill leaves the previous one the newest complete (docs/trainers.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError
from ..loader import StreamLoader
from ..runtime.collectives import barrier
from ..state.checkpoint import finish
from ..state.names import STATE_DIR
from ..state.output_dir import checkpoint_dirs, checkpoint_step, is_complete, resume_latest
from ..stream.mixture import open_stream

log = logging.getLogger(__name__)


def refresh_stream_files(stream) -> None:
    """At each save, with ``data.growth``: the files that appeared join the plan, so the checkpoint's index has them
    (with DataLoader workers, which read ahead with their plan, they join at the next resume: said once)."""
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


def save_stream_state(loader, checkpoint: str, world_size: int, is_main: bool,
                      wait: Callable[[], None] = barrier) -> str:
    """Every rank writes its state into ``checkpoint/stream_state``; after a barrier rank 0 writes the manifest
    that completes the checkpoint. Returns the stream_state directory."""
    state_dir = os.path.join(checkpoint, STATE_DIR)
    os.makedirs(state_dir, exist_ok=True)
    loader.save_sidecar(state_dir, manifest=False)   # rank file (+ fingerprint and index on rank 0); the manifest last
    wait()
    if is_main:
        finish(state_dir, world_size)
    wait()
    return state_dir


class Checkpoints:
    """The ``checkpoint-N`` directories of ``output_dir`` (the same on every rank) for a training loop of one or
    more ranks; ``keep``: complete checkpoints kept (None: all); ``required``: files of yours a checkpoint must
    have to count as complete, besides the stream state."""

    def __init__(self, output_dir: str | os.PathLike, keep: int | None = None, required: Sequence[str] = ()):
        if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1):
            raise ConfigError(f"keep: got {keep!r}; allowed: null or an integer >= 1")
        self.output_dir, self.keep, self.required = os.fspath(output_dir), keep, tuple(required)

    def latest(self, loader: Any = None) -> str | None:
        """The newest complete checkpoint (None: there is none); rank 0 first removes the newer ones a kill cut
        short. Collective (a barrier) under torch.distributed: every rank calls it."""
        return resume_latest(self.output_dir, _rank(loader) == 0, barrier, self.required)

    def resume(self, loader: Any) -> int:
        """Restore ``loader`` (anything with ``load_sidecar``) from the newest complete checkpoint: its step, or 0 when
        there is none. Restore your model and optimizer from :meth:`latest`'s path, or ``self.path(step)``."""
        latest = self.latest(loader)
        if latest is None:
            return 0
        loader.load_sidecar(latest)
        return checkpoint_step(latest)

    def path(self, step: int) -> str:
        return os.path.join(self.output_dir, f"checkpoint-{step}")

    @contextlib.contextmanager
    def save(self, step: int, loader: Any) -> Iterator[str]:
        """``checkpoint-<step>`` for your files, written inside the block; when it ends (on every rank) the stream
        state completes it and rank 0 removes the oldest beyond ``keep``. An exception leaves it incomplete."""
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise ConfigError(f"step: got {step!r}; allowed: an integer >= 0")
        path = self.path(step)
        if is_complete(path, self.required):
            raise ConfigError(f"step: got {step}; {path!r} is already a complete checkpoint: each step is saved "
                              "once (resume from it, or save under another step)")
        rank, world_size = _rank(loader), _world_size(loader)
        os.makedirs(path, exist_ok=True)
        yield path
        barrier()              # every rank's own files are written before any stream state
        if hasattr(loader, "stream"):
            refresh_stream_files(loader.stream)
        save_stream_state(loader, path, world_size, rank == 0)
        if rank == 0 and self.keep is not None:
            done = [p for _, p in checkpoint_dirs(self.output_dir) if is_complete(p, self.required)]
            for old in done[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def _rank(loader: Any) -> int:
    stream = getattr(loader, "stream", loader)
    return int(getattr(stream, "rank", 0))


def _world_size(loader: Any) -> int:
    stream = getattr(loader, "stream", loader)
    return int(getattr(stream, "world_size", 1))


class TrainerLoader:
    """A :class:`~resumable_stream.loader.StreamLoader` as another trainer's train dataloader (VeOmni,
    HyperParallel): its batches, ``set_epoch`` and state; a state that does not load names ``where``."""

    where = "the trainer's checkpoint"

    def __init__(self, loader):
        self.loader = loader

    @classmethod
    def of(cls, config, rank: int | None, world_size: int | None, batch_size: int, collate_fn: Callable,
           num_workers: int, prefetch_factor: int | None, pin_memory: bool):
        """Over ``config``'s stream of this rank: a loader whose state is this rank's alone (the trainer asks for
        it after every item, from its prefetch thread)."""
        stream = open_stream(config, rank=rank, world_size=world_size, num_workers=num_workers)
        return cls(StreamLoader(stream, batch_size, collate_fn=collate_fn, num_workers=num_workers,
                                prefetch_factor=prefetch_factor if num_workers else None, pin_memory=pin_memory,
                                per_rank_state=True))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state, where=self.where)

    def pop_consumed_keys(self) -> list[str]:
        """The keys of the samples handed out since the last call (``loader.keep_keys``)."""
        return self.loader.pop_consumed_keys()


class RowsCollator:
    """An item's raw rows -> the trainer's sample transform on each (``untransformed``: a row without one) -> its
    collator (None: the samples as they are); picklable: it runs in the DataLoader workers."""

    def __init__(self, transform: Callable | None, collate_fn: Callable | None):
        self.transform, self.collate_fn = transform, collate_fn

    @staticmethod
    def untransformed(row: dict) -> Any:
        return row

    def __call__(self, rows: list[dict]) -> Any:
        samples = [self.transform(row) if self.transform is not None else self.untransformed(row) for row in rows]
        return self.collate_fn(samples) if self.collate_fn is not None else samples
