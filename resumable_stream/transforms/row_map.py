"""``data.map``: a user's deterministic function of one row, applied before the built-in transform; its name and
source digest (or ``data.map_version``) join the fingerprint, and nothing read from a sidecar names a module to
import (docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config.user_function import function_identity, load_function


class BadMapResult(ValueError):
    """The function raised or returned something that is not a row, a list of rows or None."""


class RowMap:
    """The configured map function, applied to one row: ``rows(sample, key)`` -> [(row, key), ...]."""

    def __init__(self, spec: str | Callable, version: str | int | None = None, key: str = "data.map"):
        self.fn = load_function(spec, key)
        self.identity = function_identity(spec, self.fn, version, key)
        self.spec = self.identity["function"]

    def rows(self, sample: Any, key: str) -> list[tuple[dict, str]]:
        """The rows the function made of ``sample``; each has the sample's key, with ``#i`` appended when
        there are several. ``BadMapResult`` when the function raises or returns something else."""
        try:
            out = self.fn(sample)
        except Exception as e:  # noqa: BLE001 - the user's code: data.bad_sample decides
            raise BadMapResult(f"data.map function {self.spec!r} raised {type(e).__name__}: {e}") from e
        if out is None:
            return []
        if isinstance(out, dict):
            return [(out, key)]
        if isinstance(out, (list, tuple)) and all(isinstance(r, dict) for r in out):
            return [(out[0], key)] if len(out) == 1 else [(r, f"{key}#{i}") for i, r in enumerate(out)]
        raise BadMapResult(f"data.map function {self.spec!r} returned {type(out).__name__}; expected a row (a dict), "
                           "a list of rows or None")
