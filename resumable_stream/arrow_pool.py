"""The Arrow memory pool decoded row groups and shuffle windows are allocated from.

The system allocator, which gives a freed row group back at once, unless ``ARROW_DEFAULT_MEMORY_POOL``
chooses one (then pyarrow's default, as the user asked). pyarrow's own default, mimalloc, keeps freed row
groups mapped, per thread: over a shuffled pass of the benchmark data that was 10-25 MiB more peak RSS
(docs/architecture.md, Memory).
"""

from __future__ import annotations

import os

import pyarrow as pa


def rows_pool() -> pa.MemoryPool | None:
    """The pool to allocate rows from; None: pyarrow's default (``ARROW_DEFAULT_MEMORY_POOL`` is set)."""
    return None if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") else pa.system_memory_pool()
