"""Open a rank's source so that the whole job resolves its dataset once: the index of the checkpoint being resumed,
else ``data.index_path``, else built (a loaded one checked: ``growth.recheck``); under ``torch.distributed`` by
rank 0 only, broadcast with the settings every rank must share (``index_message``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Protocol

from ..config.specs import SourceSpec
from ..errors import ConfigError
from ..io import budget as request_budget
from ..runtime.collectives import broadcast_bytes, max_over_ranks, shared_over_dist
from ..sources.base import Source
from ..sources.index import check_resolution, load_index, same_resolution, save_index
from ..sources.open import open_source
from . import growth
from .index_message import encode_message, errors_sent, received

log = logging.getLogger(__name__)

class Saved(Protocol):
    """What a checkpoint being resumed saved of the dataset (``state.checkpoint.SavedIndexes``): read on demand."""

    def index(self, label: str | None = None) -> dict[str, Any] | None: ...

    def furthest_epoch(self, source: int | None = None) -> int | None: ...

    def where(self, label: str | None = None) -> str: ...


def open_job_source(spec: SourceSpec, rank: int = 0, world_size: int = 1, saved: Saved | None = None,
                    agree: dict[str, Any] | None = None) -> Source:
    """This rank's source of one dataset; ``saved``: what a checkpoint being resumed saved of it (its index may
    be used: ``data.resume_state_path`` or a loader's / trainer's ``index_from``); ``agree``: settings (key ->
    JSON value) every rank must have the same, checked against rank 0's when the index is shared."""
    return open_job_sources([spec], [None], rank, world_size, saved, agree)[0]


def open_job_sources(specs: list[SourceSpec], labels: list[str | None], rank: int = 0, world_size: int = 1,
                     saved: Saved | None = None, agree: dict[str, Any] | None = None) -> list[Source]:
    """This rank's sources of a mixture, one per spec (``labels``: the mixture's source labels; None: one
    dataset), each resolved and indexed once per job as :func:`open_job_source` does for one dataset; under
    ``torch.distributed`` all sources' indexes broadcast in one message."""
    specs, labels = list(specs), list(labels)
    shared = shared_over_dist(rank, world_size) and any(c.data.indexed for c in specs)
    if shared and rank != 0:
        message = received("open the dataset")
        _check_agreement(message["agree"], agree or {}, rank)
        out = []
        for c, entry in zip(specs, message["sources"]):
            index = entry["index"] if c.data.indexed and entry is not None else None
            out.append(open_source(c, index=index, footers=entry["footers"]) if index is not None else open_source(c))
        return out
    # rank 0 opening for the job (the other ranks wait for its index): the job's whole request rate is its
    with errors_sent(shared), request_budget.opening_alone() if shared else contextlib.nullcontext():
        sources = [_open_first(c, rank, saved, label, i if label is not None else None) if c.data.indexed
                   else open_source(c) for i, (c, label) in enumerate(zip(specs, labels))]
    if shared:
        # the footers rank 0 read to build the index: the other ranks then read none (O(files) per job)
        entries = [None if src.index is None else {"index": src.index, "footers": src.footers} for src in sources]
        broadcast_bytes(encode_message(entries, agree or {}))
        _check_agreement(agree or {}, agree or {}, rank)     # the collective the others are in
    return sources


def _check_agreement(first: dict[str, Any], mine: dict[str, Any], rank: int) -> None:
    """Every rank (a collective): a ConfigError on all of them when some rank's settings differ from rank 0's
    ``first``; the ranks that differ name the keys."""
    first, mine = json.loads(json.dumps(first)), json.loads(json.dumps(mine))   # as sent: tuples are lists
    diffs = [(k, first.get(k), mine.get(k)) for k in sorted(set(first) | set(mine)) if first.get(k) != mine.get(k)]
    if max_over_ranks(1 if diffs else 0) == 0:
        return
    if diffs:
        shown = "; ".join(f"{k}: rank 0 {a!r}, rank {rank} {b!r}" for k, a, b in diffs)
        raise ConfigError(f"the ranks of this job read the data with different settings: {shown}; allowed: the same "
                          "value on every rank (on several nodes, give every node the same data and order keys; only "
                          "cache_dir, cache_size_limit_gb, metrics_port and metrics_addr may differ per node)")
    raise ConfigError("the ranks of this job read the data with different settings (the ranks that differ name "
                      "them); allowed: the same data and order keys on every rank")


def _open_first(spec: SourceSpec, rank: int, saved_state: Saved | None, label: str | None = None,
                position: int | None = None) -> Source:
    """Rank 0's (or a lone process's) source: from a saved / given index when there is one, else resolved.
    ``label``: the mixture source whose index the checkpoint saved under that name."""
    if spec.growth.growing:
        return _open_growing(spec, saved_state, label, position)
    index_path = spec.index.path
    index, where, given = None, None, False
    saved = saved_state.index(label) if saved_state is not None else None
    if saved is not None:
        index, where = saved, saved_state.where(label)
    elif index_path and os.path.isfile(index_path):
        index, where, given = load_index(index_path), repr(index_path), True
        if label is not None:
            where += f" (source {label!r})"
    if saved is not None and not same_resolution(index, spec.data):
        index = None        # resolved afresh: the resume check then names what changed in the config
    if index is not None:
        check_resolution(index, spec.data, where)
        if spec.index.verify_files:
            index = growth.recheck(spec, index, None, where, given=given)
        if index is not None:
            return open_source(spec, index=index)
    src = open_source(spec)
    if index_path and rank == 0 and src.index is not None:
        save_index(index_path, src.index)
    return src


def _open_growing(spec: SourceSpec, saved_state: Saved | None, label: str | None, position: int | None) -> Source:
    """A growing dataset (``data.growth``): a resume takes the checkpoint's index, checks the files it has read
    and adds those that appeared since, from the epoch after the furthest one begun (``growth.recheck``); a fresh
    start resolves the files, its one generation from epoch 0. ``position``: the source's in a mixture."""
    if spec.index.path:
        log.warning("data.index_path %r is not used with data.growth: %s (the checkpoint's index is, which "
                    "grows with the data)", spec.index.path, spec.growth.mode)
    saved = saved_state.index(label) if saved_state is not None else None
    if saved is not None and same_resolution(saved, spec.data):
        where = saved_state.where(label)
        furthest = saved_state.furthest_epoch(position)
        return open_source(spec, index=growth.recheck(spec, saved, growth.joins_at(spec.growth, saved, furthest or 0),
                                                   where))
    src = open_source(spec)
    if src.index is None:
        src.close()
        raise ConfigError(f"data.growth: got {spec.growth.mode!r} for {spec.data.dataset_name_or_path!r}, which is not read "
                          "through a dataset index; allowed: off, or append for indexed formats (parquet)")
    src.index[growth.KEY] = {"generations": growth.generations(src.index)}
    return src
