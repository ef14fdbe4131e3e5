"""``open_source``: a dataset split as a :class:`~resumable_stream.sources.base.Source`, by way of the registry.
The way down: resolution, then an index and its format's reader, or ``datasets``; no reader calls back up."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..config import formats as registry
from ..config.specs import SourceSpec
from ..errors import ConfigError, SourceError
from ..io.net import RetryPolicy
from ..runtime.threads import map_files
from .base import NotIndexable, ShardInfo, Source
from .datasets_stream import DatasetsStreamSource
from .fingerprint_files import dataset_fingerprint
from .map_style import MapStyleSource
from .resolve import (
    Resolved,
    build_index,
    file_identity,
    resolve_files,
    resolve_split,
    where_of,
    where_to_look,
)

log = logging.getLogger(__name__)


def open_source(spec: SourceSpec, index: dict | None = None, progress: Callable[[int], None] | None = None,
                footers: dict[str, bytes] | None = None) -> Source:
    """Open a dataset split (``spec``: ``StreamConfig.source_spec``); ConfigError / SourceError with the reason.

    Files of a registered format are read from their dataset index: ``index`` when given (from a checkpoint, a
    file or rank 0: nothing is resolved), else built here (``progress(number of files)`` after each file;
    ``footers``: parquet footers read elsewhere, checked against the index). Anything else is read by
    ``datasets``. Every remote step runs under ``data.retries`` and ``data.timeout_s``."""
    data = spec.data
    if data.backend == "local":
        return _open_local(spec)
    path, data_files, targets, retry = where_to_look(spec)
    if index is not None and data.streaming:
        return open_indexed(spec, index, retry, footers)
    resolved = resolve_split(spec, path, data_files, targets, retry)
    if resolved.format is not None:
        footers = {}
        try:
            index = build_index(resolved.format, spec, resolved.files, resolved.features, retry, progress, footers)
        except NotIndexable as e:       # e.g. a .json file holding one JSON array: datasets' reader reads it
            log.info("%s; read by datasets' own reader", e)
            if resolved.builder is None:
                builder, files = resolve_files(data, path, data_files, targets, retry)
                resolved = Resolved(files, None, builder)
        else:
            return resolved.reader.open_indexed(spec, index, retry, footers)
    files, builder = resolved.files, resolved.builder
    identities = map_files(lambda f: file_identity(f, retry), files)

    def by_datasets(make: Callable[[], Any], doing: str, failed: str) -> Any:
        try:
            return retry.call(make, f"{where_of(data, targets)}: {doing}", files or targets)
        except SourceError:
            raise
        except Exception as e:
            raise SourceError(f"data.dataset_name_or_path {data.dataset_name_or_path!r}: {failed} "
                              f"({type(e).__name__}: {e})") from None

    if data.streaming:      # one shard per file
        ids = by_datasets(lambda: builder.as_streaming_dataset(split=data.split), "opening the stream",
                          "streaming failed")
        names = files if len(files) == ids.num_shards else [""] * ids.num_shards
        shards = [ShardInfo(i, f, None, None) for i, f in enumerate(names)]
        return DatasetsStreamSource(ids, shards, dataset_fingerprint(spec, builder.name, identities, shards),
                                    retry if retry.remote else None)

    def prepared():
        builder.download_and_prepare()
        return builder.as_dataset(split=data.split)

    ds = by_datasets(prepared, "downloading and preparing", "loading without streaming failed")
    return MapStyleSource(ds, dataset_fingerprint(spec, builder.name, identities))


def _open_local(spec: SourceSpec) -> MapStyleSource:
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


def open_indexed(spec: SourceSpec, index: dict, retry: RetryPolicy, footers: dict[str, bytes] | None = None) -> Source:
    """The source of a dataset index, read by the format the index names."""
    return registry.format_of_index(index).load().open_indexed(spec, index, retry, footers)
