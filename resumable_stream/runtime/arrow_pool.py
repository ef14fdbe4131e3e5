"""The Arrow memory pool decoded row groups and shuffle windows are allocated from.

jemalloc where pyarrow was built with it (its Linux wheels), else the system allocator, unless
``ARROW_DEFAULT_MEMORY_POOL`` chooses one (then pyarrow's default, as the user asked). pyarrow's own default,
mimalloc, keeps freed row groups mapped, per thread: over a shuffled pass of the benchmark data that was
10-25 MiB more peak RSS. The system allocator gives a freed row group back at once but maps every large buffer
afresh (glibc serves them with mmap), so each decode touches new pages: a row group of 16,384 rows cost
~4,000 page faults and 2-3x the CPU of a decode into reused memory. pyarrow's jemalloc (decay 0) reuses freed
extents and returns the rest: on the same pass 100 MiB peak RSS above imports against the system's 130 MiB,
and a resume's first sample ~15% sooner (docs/benchmarks.md).
"""

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
