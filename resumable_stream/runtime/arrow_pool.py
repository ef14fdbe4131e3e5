"""The Arrow memory pool decoded row groups and shuffle windows are allocated from: pyarrow's jemalloc where built
with it, else the system's, unless ``ARROW_DEFAULT_MEMORY_POOL`` chooses. mimalloc (pyarrow's default) kept
10-25 MiB more peak RSS; the system allocator maps every large buffer afresh (2-3x the CPU of a decode into
reused memory); jemalloc (decay 0) reuses and returns them (docs/benchmarks.md)."""

from __future__ import annotations

import functools
import os

import pyarrow as pa


@functools.cache
def _own_pool() -> pa.MemoryPool:
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:       # a pyarrow built without jemalloc (Windows, macOS, some conda builds)
        return pa.system_memory_pool()


def rows_pool() -> pa.MemoryPool | None:
    """The pool to allocate rows from; None: pyarrow's default (``ARROW_DEFAULT_MEMORY_POOL`` is set)."""
    return None if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") else _own_pool()
