"""Everything streamed that we do not index: ``load_dataset(..., streaming=True)``, one shard per file.

``read(shard, row)`` goes through ``IterableDataset.shard(...).with_format("arrow")``; reopening at a row
re-reads the shard's prefix (``datasets`` has no row seek), so resuming costs at most one file per open shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ..config.specs import SourceSpec
from ..errors import SourceError
from ..io.net import RetryPolicy
from .base import READ_BATCH_ROWS, RetriedSource, ShardInfo
from .fingerprint_files import dataset_fingerprint
from .resolve import where_of


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


def open_streaming(spec: SourceSpec, builder: Any, files: list[str], targets: list[str], retry: RetryPolicy,
                   identities: list[dict]) -> DatasetsStreamSource:
    """``builder``'s split as a stream; ``identities``: its files'."""
    try:
        ids = retry.call(lambda: builder.as_streaming_dataset(split=spec.data.split),
                         f"{where_of(spec.data, targets)}: opening the stream", files or targets)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {spec.data.dataset_name_or_path!r}: streaming failed "
                          f"({type(e).__name__}: {e})") from None
    n = ids.num_shards
    names = files if len(files) == n else [""] * n
    shards = [ShardInfo(i, f, None, None) for i, f in enumerate(names)]
    return DatasetsStreamSource(ids, shards, dataset_fingerprint(spec, builder.name, identities, shards),
                                retry if retry.remote else None)
