"""Everything streamed that we do not index: ``load_dataset(..., streaming=True)``, one shard per file.

``read(shard, row)`` goes through ``IterableDataset.shard(...).with_format("arrow")``; reopening at a row
re-reads the shard's prefix (``datasets`` has no row seek), so resuming costs at most one file per open shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from ..io.net import RetryPolicy
from .base import READ_BATCH_ROWS, RetriedSource, ShardInfo


class DatasetsStreamSource(RetriedSource):
    """A ``datasets`` IterableDataset read one shard per file (faults: see :class:`RetriedSource`)."""

    def __init__(self, ids, shards: list[ShardInfo], fingerprint: dict, retry: RetryPolicy | None = None):
        super().__init__(shards, fingerprint, retry)
        self._ids = ids
        self.column_names = ids.column_names

    def _tables_from(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        one = self._ids.shard(num_shards=len(self.shards), index=shard, contiguous=True).with_format("arrow")
        seen = 0
        tables = one.iter(batch_size=READ_BATCH_ROWS)
        try:
            # Reopening at a row re-reads the shard's prefix: bounded by one shard.
            for table in tables:
                n = table.num_rows
                if seen + n <= start_row:
                    seen += n
                    continue
                if seen < start_row:
                    table = table.slice(start_row - seen)
                seen += n
                yield table
        finally:
            tables.close()   # a shard left mid-way: end datasets' reader (and its pyarrow scan) now
