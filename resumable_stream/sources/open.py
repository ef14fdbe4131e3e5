"""``open_source``: a dataset split as a :class:`~resumable_stream.sources.base.Source`, by way of the registry."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config import formats as registry
from ..config.specs import SourceSpec
from ..io.net import RetryPolicy
from ..runtime.threads import map_files
from .base import NotIndexable, Source
from .datasets_stream import open_streaming
from .fingerprint_files import dataset_fingerprint
from .map_style import open_local, open_prepared
from .resolve import (
    Resolved,
    build_index,
    file_identity,
    resolve_files,
    resolve_split,
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
        return open_local(spec)
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
    if data.streaming:
        return open_streaming(spec, builder, files, targets, retry, identities)
    return open_prepared(spec, builder, files, targets, retry, dataset_fingerprint(spec, builder.name, identities))


def open_indexed(spec: SourceSpec, index: dict, retry: RetryPolicy, footers: dict[str, bytes] | None = None) -> Source:
    """The source of a dataset index, read by the format the index names."""
    return registry.format_of_index(index).load().open_indexed(spec, index, retry, footers)
