"""A dataset loaded normally (``streaming: false``, or ``backend: local``): memory-mapped Arrow, cut into
fixed-size row ranges, so that reading shard *s* at row *r* is a slice (no prefix to re-read)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from .base import READ_BATCH_ROWS, ShardInfo, Source

# Rows per shard when a dataset is loaded normally.
MAP_STYLE_SHARD_ROWS = 8192


class MapStyleSource(Source):
    """A dataset loaded normally (memory-mapped Arrow), cut into fixed-size row ranges."""

    def __init__(self, ds, fingerprint: dict):
        self._arrow = ds.with_format("arrow")
        n = len(ds)
        count = max(1, -(-n // MAP_STYLE_SHARD_ROWS))
        self.shards = [
            ShardInfo(i, "", i, min(MAP_STYLE_SHARD_ROWS, n - i * MAP_STYLE_SHARD_ROWS)) for i in range(count)
        ] if n else [ShardInfo(0, "", 0, 0)]
        self.fingerprint = dict(fingerprint, num_rows=n, shard_rows_each=MAP_STYLE_SHARD_ROWS,
                                num_shards=len(self.shards))
        self.column_names = ds.column_names

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        lo = shard * MAP_STYLE_SHARD_ROWS
        hi = lo + (self.shards[shard].num_rows or 0)
        pos = lo + start_row
        while pos < hi:  # random access: no prefix to re-read
            end = min(hi, pos + READ_BATCH_ROWS)
            yield self._arrow[pos:end]
            pos = end

