"""The errors a sample meets in a transform, and what a skip policy (``data.bad_sample``, ``data.empty``) does."""

from __future__ import annotations

import logging

from ..errors import ResumableStreamError


class TransformError(ResumableStreamError, ValueError):
    """A sample cannot be turned into a training example under the configured policy; the message names the sample
    key (``key``) and what was wrong."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class BadSample(Exception):
    """A sample that ``data.bad_sample`` decides about; ``kind`` is its stats counter."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def skip_or_raise(policy: str, setting: str, key: str, why: str, stats: dict[str, int], counter: str,
                  log: logging.Logger | None = None, where: str | None = None) -> None:
    """A sample the skip policy ``setting`` decides about: under ``error`` a TransformError naming the sample
    (``where``, by default its key) and why; under ``skip`` counted in ``stats[counter]`` and logged to ``log``."""
    if policy == "error":
        raise TransformError(f"{where or f'sample {key!r}'}: {why} ({setting} is 'error'; 'skip' skips such "
                             "samples)", key) from None
    stats[counter] += 1
    if log is not None:
        log.warning("skipping sample %r: %s (%s: skip)", key, why, setting)
