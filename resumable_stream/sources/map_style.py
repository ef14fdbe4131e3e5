"""A dataset loaded normally (``streaming: false``, or ``backend: local``): memory-mapped Arrow, cut into
fixed-size row ranges, so that reading shard *s* at row *r* is a slice (no prefix to re-read)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ..config.specs import SourceSpec
from ..errors import ConfigError, SourceError
from ..io.net import RetryPolicy
from .base import READ_BATCH_ROWS, ShardInfo, Source
from .fingerprint_files import dataset_fingerprint
from .resolve import file_identity, where_of

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


def open_prepared(spec: SourceSpec, builder: Any, files: list[str], targets: list[str], retry: RetryPolicy,
                  fingerprint: dict) -> MapStyleSource:
    """``builder``'s split downloaded and prepared by ``datasets`` (``streaming: false``)."""
    def load():
        builder.download_and_prepare()
        return builder.as_dataset(split=spec.data.split)

    try:
        ds = retry.call(load, f"{where_of(spec.data, targets)}: downloading and preparing", files or targets)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {spec.data.dataset_name_or_path!r}: loading without streaming "
                          f"failed ({type(e).__name__}: {e})") from None
    return MapStyleSource(ds, fingerprint)


def open_local(spec: SourceSpec) -> MapStyleSource:
    """``backend: local``: a directory written by ``save_to_disk``."""
    import datasets

    path = spec.data.dataset_name_or_path
    if not os.path.isdir(path):
        raise SourceError(f"data.dataset_name_or_path {path!r}: backend 'local' needs a directory written by "
                          "Dataset.save_to_disk / DatasetDict.save_to_disk")
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {path!r}: not a save_to_disk directory "
                          f"({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if spec.data.split not in loaded:
            raise ConfigError(f"data.split: got {spec.data.split!r}; this dataset has the splits: {', '.join(loaded)}")
        ds = loaded[spec.data.split]
    else:
        ds = loaded
    files = sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names
        if f.endswith(".arrow") or f in ("state.json", "dataset_info.json")
    )
    return MapStyleSource(ds, dataset_fingerprint(spec, None, [file_identity(f) for f in files]))
