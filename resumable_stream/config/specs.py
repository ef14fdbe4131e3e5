"""The small typed specs each stage of the data path takes, built once from a validated ``data:`` section.

``StreamConfig`` is the user-facing parse of ``data:`` (every key, every error). Below ``config/`` no function
takes it whole: a stage takes the spec it needs, so that a reader cannot come to depend on, say, the cache
settings, and a reader's signature says what it reads. ``StreamConfig.source_spec`` and
``StreamConfig.cache_spec`` build them (once per config); the order settings go into ``plan.Layout``.

    DataSpec     which data: the keys that name the dataset and its split (resolution, fingerprint, index key)
    NetPolicy    how the network is used: retries, backoff, deadlines, fsspec storage options
    ReadSpec     how a reader reads: open shards, row groups fetched ahead and their memory, tar member limit
    GrowthSpec   whether the files grow while the job runs, and how it waits for them
    IndexSpec    the dataset index file given by the user, and whether a loaded index is checked
    SourceSpec   all of the above: what opening one dataset needs
    CacheSpec    the local block cache
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataSpec:
    """Which data a source reads (``data.dataset_name_or_path``, ``name``, ``data_files``, ``revision``,
    ``data_dir``, ``split``) and through what (``backend``, ``streaming``)."""

    dataset_name_or_path: str
    backend: str = "hf"
    streaming: bool = True
    name: str | None = None
    data_files: str | list[str] | dict[str, Any] | None = None
    revision: str | None = None
    data_dir: str | None = None
    split: str = "train"

    @property
    def indexed(self) -> bool:
        """Whether the source may have a dataset index (streamed through ``datasets``' resolution)."""
        return self.backend == "hf" and self.streaming


@dataclass(frozen=True)
class NetPolicy:
    """``data.retries`` / ``retry_backoff_s`` / ``timeout_s`` / ``retry_budget_s``, the fsspec ``storage_options``
    (see ``io/net.py``, which turns it into a ``RetryPolicy`` for a source's paths) and the request budget:
    ``max_requests_per_s`` (the job's rate per store; None: automatic) and ``rate_limit_wait_s`` (see
    ``io/budget.py``)."""

    retries: int = 5
    retry_backoff_s: float = 1.0
    timeout_s: float = 60.0
    retry_budget_s: float = 180.0
    storage_options: dict[str, Any] | None = None
    max_requests_per_s: float | str | None = None
    rate_limit_wait_s: float = 600.0


@dataclass(frozen=True)
class ReadSpec:
    """How a reader reads: ``data.interleave_shards`` (open shards per partition, which bounds how far ahead
    it may fetch), ``prefetch_blocks`` (None: adaptive; 0: off), ``prefetch_memory_mb``,
    ``max_member_bytes`` (the largest WebDataset tar member read) and ``footer_dir`` (``data.cache_dir``: the
    footers an index build reads are kept there by file identity, ``sources/footer_cache.py``)."""

    interleave_shards: int = 4
    prefetch_blocks: int | None = None
    prefetch_memory_mb: float = 256
    max_member_bytes: int = 64 << 20
    footer_dir: str | None = None       # data.cache_dir: remote files' footers kept there by identity


@dataclass(frozen=True)
class GrowthSpec:
    """``data.growth`` (off / append / follow) and its settings (docs/growing-data.md)."""

    mode: str = "off"
    allow_removal: bool = False
    poll_interval_s: float = 10.0
    follow_timeout_s: float = 3600.0

    @property
    def growing(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class IndexSpec:
    """``data.index_path`` (used when present, written by rank 0 when not) and ``data.verify_files``."""

    path: str | None = None
    verify_files: bool = True


@dataclass(frozen=True)
class SourceSpec:
    """What opening one dataset needs, from its resolution to its readers."""

    data: DataSpec
    net: NetPolicy = NetPolicy()
    read: ReadSpec = ReadSpec()
    growth: GrowthSpec = GrowthSpec()
    index: IndexSpec = IndexSpec()


@dataclass(frozen=True)
class CacheSpec:
    """``data.cache_dir`` (None: no cache) and ``data.cache_size_limit_gb``."""

    directory: str | None = None
    size_limit_gb: float = 50
