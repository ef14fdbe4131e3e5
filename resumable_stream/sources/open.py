"""``open_source``: a config's split as a :class:`~resumable_stream.sources.base.Source`, by way of the registry."""

from __future__ import annotations

from collections.abc import Callable

from ..config import formats as registry
from ..config.stream_config import StreamConfig
from ..io.net import RetryPolicy
from ..runtime.threads import map_files
from .base import Source
from .datasets_stream import open_streaming
from .map_style import open_local, open_prepared
from .resolve import (
    build_index,
    builder_args,
    dataset_fingerprint,
    file_identity,
    remote_targets,
    resolve_split,
)


def open_source(cfg: StreamConfig, index: dict | None = None, progress: Callable[[], None] | None = None,
                footers: dict[str, bytes] | None = None) -> Source:
    """Open ``cfg``'s dataset split. Raises ConfigError / SourceError with the reason.

    Remote datasets are resolved under ``data.retries`` / ``data.retry_backoff_s`` (each step on its
    own) with ``data.timeout_s`` on every HTTP connection and read. Files of a registered format (parquet)
    are read from their dataset index: ``index`` when given (checked against the config; nothing is resolved
    then), otherwise built here (``progress()`` after each file). ``footers``: the raw metadata (parquet
    footers) of the index's files already read elsewhere (path -> bytes, checked against the index; the
    source's ``footers``). Anything else is read by ``datasets``."""
    if cfg.backend == "local":
        return open_local(cfg)
    path, data_files = builder_args(cfg)
    targets = remote_targets(path, data_files)
    retry = RetryPolicy(cfg, remote=bool(targets))
    if index is not None and cfg.streaming:
        return open_indexed(cfg, index, retry, footers)
    resolved = resolve_split(cfg, path, data_files, targets, retry)
    if resolved.format is not None:
        footers = {}
        index = build_index(resolved.format, cfg, resolved.files, resolved.features, retry, progress, footers)
        return resolved.format.load().open_indexed(cfg, index, retry, footers)
    files, builder = resolved.files, resolved.builder
    identities = map_files(lambda f: file_identity(f, retry), files)
    if cfg.streaming:
        return open_streaming(cfg, builder, files, targets, retry, identities)
    return open_prepared(cfg, builder, files, targets, retry, dataset_fingerprint(cfg, builder.name, identities))


def open_indexed(cfg: StreamConfig, index: dict, retry: RetryPolicy, footers: dict[str, bytes] | None = None) -> Source:
    """The source of a dataset index, read by the format the index names."""
    return registry.format_of_index(index).load().open_indexed(cfg, index, retry, footers)
