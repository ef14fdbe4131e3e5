"""The transform protocol: the stateful processor the loader drives, one per partition in every DataLoader worker.

    proc.feed(sample, key)              # one raw row and its stream key
    while proc.ready() >= batch_size:
        batch = [proc.take() for _ in range(batch_size)]
        carry = proc.state()            # saved beside the partition's cursor after every batch

A fresh processor given ``load_state(carry)`` continues as if it had never stopped; ``fingerprint()`` names what
decides its outputs. Implementations subclass :class:`QueuedProcessor`; one with the required methods only is
driven through :func:`as_processor`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..errors import BAD_SAMPLE_COLUMN, SidecarError, StreamMismatchError
from .errors import skip_or_raise
from .row_map import BadMapResult

Example = dict[str, Any]
HOOKS = ("takes_source", "counts_key_tokens", "epoch_bound", "data_epoch", "flush", "end_epoch", "epoch_tail")


@runtime_checkable
class Processor(Protocol):
    """Raw rows in, training examples out (each with its ``keys``), with a state that resumes it exactly."""

    takes_source: bool = False          # feed() is told each sample's mixture source (per-source settings)
    counts_key_tokens: bool = False     # take(with_key_tokens=True) adds "key_tokens": each key's tokens in it
    # examples never span the data's epochs: the loader calls end_epoch() on the first row of the next epoch and
    # batches the ended epoch's examples (epoch_tail()) apart; data_epoch is the epoch of the rows fed
    epoch_bound: bool = False
    data_epoch: int | None = None

    def feed(self, sample: dict, key: str, source: str | None = None) -> None:
        """Take one raw row (``source``: its mixture source's label, passed only with ``takes_source``)."""

    def ready(self) -> int:
        """How many finished examples wait to be taken."""

    def take(self, with_key_tokens: bool = False) -> Example:
        """The oldest finished example (IndexError when none is ready)."""

    def state(self) -> dict[str, Any]:
        """``{"tensors": {name: ndarray}, "meta": JSON-able dict}``: what continues it exactly."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a ``state()`` (``checked_state`` checks its version and fingerprint)."""

    def fingerprint(self) -> dict[str, Any]:
        """What decides the outputs (JSON-able)."""

    def stats(self) -> dict[str, int]:
        """Counters: rows fed, examples made, rows skipped by kind."""

    def flush(self) -> None:
        """The end of a finite stream: what is carried becomes examples (the loader carries it instead)."""

    def end_epoch(self, epoch: int) -> None:
        """With ``epoch_bound``: the rows fed so far end the data's epoch; the next ones are of ``epoch``."""
        self.data_epoch = epoch

    def epoch_tail(self) -> int:
        """With ``epoch_bound``: how many of the ready examples are of the ended epoch."""
        return 0


class QueuedProcessor(Processor):
    """A processor whose finished examples wait in the deque ``self._pending``, with its counters in
    ``self._stats``, its fingerprint in ``self._fingerprint`` and (for ``_bad`` / ``_empty``) its
    ``TransformConfig`` in ``self.cfg``."""

    def ready(self) -> int:
        return len(self._pending)

    def take(self, with_key_tokens: bool = False) -> Example:
        if not self._pending:
            raise IndexError(f"{type(self).__name__}.take: no finished example; feed more samples (check ready())")
        return self._pending.popleft()

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def _bad(self, key: str, why: str, counter: str = "skipped_bad") -> None:
        skip_or_raise(self.cfg.bad_sample, "data.bad_sample", key, why, self._stats, counter,
                      logging.getLogger(type(self).__module__))

    def _empty(self, key: str, why: str) -> None:
        skip_or_raise(self.cfg.empty, "data.empty", key, why, self._stats, "skipped_empty")

    def _feed_mapped(self, sample: dict, key: str, row_map: Any, feed_row: Callable[[dict, str], None],
                     map_counter: str = "skipped_bad") -> None:
        """One raw row: one the source could not read whole (a tar member) or that ``data.map`` refuses goes to
        ``self._bad``; every row ``data.map`` returns is fed now, so what is not yet taken is in ``state()``."""
        key = str(key)
        self._stats["samples"] += 1
        bad = sample.get(BAD_SAMPLE_COLUMN) if isinstance(sample, dict) else None
        if bad is not None:
            self._bad(key, str(bad), "skipped_bad")
            return
        if row_map is None:
            feed_row(sample, key)
            return
        try:
            rows = row_map.rows(sample, key)
        except BadMapResult as e:
            self._bad(key, str(e), map_counter)
            return
        if not rows:
            self._stats["dropped_by_map"] += 1
        for row, row_key in rows:
            feed_row(row, row_key)


class _RequiredOnly(Processor):
    """A processor written with the required methods only, driven with the optional hooks' defaults."""

    def __init__(self, inner: Any):
        self.inner = inner

    def feed(self, sample: dict, key: str, source: str | None = None) -> None:
        self.inner.feed(sample, key)

    def ready(self) -> int:
        return self.inner.ready()

    def take(self, with_key_tokens: bool = False) -> Example:
        return self.inner.take()

    def state(self) -> dict[str, Any]:
        return self.inner.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.inner.load_state(state)

    def fingerprint(self) -> dict[str, Any]:
        return self.inner.fingerprint()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()


def as_processor(obj: Any) -> Processor:
    """``obj`` when it has every member of :class:`Processor`; one with the required methods only, wrapped with the
    hooks' defaults. TypeError for one that defines some hooks but not all (they would be ignored silently)."""
    if isinstance(obj, Processor):
        return obj
    some = [name for name in HOOKS if hasattr(obj, name)]
    if some:
        raise TypeError(f"processor {type(obj).__name__}: defines {', '.join(some)} but not every member of "
                        "resumable_stream.transforms.Processor; subclass it (its defaults fill in the rest)")
    return _RequiredOnly(obj)


def checked_state(state: dict[str, Any], version: int, fingerprint: dict) -> tuple[dict, dict]:
    """(tensors, meta) of a processor's ``state()``: ``SidecarError`` if malformed or of another version,
    ``StreamMismatchError`` naming every setting that differs from ``fingerprint``."""
    try:
        tensors, meta = state["tensors"], state["meta"]
        saved_version = meta["version"]
    except (KeyError, TypeError):
        raise SidecarError("transform state: expected {'tensors': ..., 'meta': {'version': ...}}") from None
    if saved_version != version:
        raise SidecarError(f"transform state: version {saved_version!r}; this version reads {version}")
    saved = meta.get("fingerprint") or {}
    if saved != fingerprint:
        diffs = [(f"transform.{k}", saved.get(k), fingerprint.get(k))
                 for k in sorted(set(saved) | set(fingerprint)) if saved.get(k) != fingerprint.get(k)]
        what = "; ".join(f"{w}: saved {s!r}, now {n!r}" for w, s, n in diffs)
        raise StreamMismatchError(f"transform state belongs to different transform settings ({what})", diffs)
    return tensors, meta


def saved_stats(meta: dict, keys: tuple[str, ...], later: tuple[str, ...]) -> dict[str, int]:
    """The counters of a state's ``meta``: every one of ``keys``; those of ``later`` (added since) 0 when absent."""
    return {k: int(meta["stats"][k] if k not in later else meta["stats"].get(k, 0)) for k in keys}
