"""The small typed specs each stage of the data path takes, built once from a validated ``data:`` section
(``StreamConfig.source_spec`` / ``cache_spec``): below ``config/`` a stage takes the spec it needs, never
the whole config, so its signature says what it reads."""

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
    """How the network is used: retries, deadlines, fsspec ``storage_options`` (``io/net.py``) and the request
    budget (``io/budget.py``; ``max_requests_per_s`` None: automatic)."""

    retries: int = 5
    retry_backoff_s: float = 1.0
    timeout_s: float = 60.0
    retry_budget_s: float = 180.0
    storage_options: dict[str, Any] | None = None
    max_requests_per_s: float | str | None = None
    rate_limit_wait_s: float = 600.0


@dataclass(frozen=True)
class ReadSpec:
    """How a reader reads: open shards per partition, row groups fetched ahead (None: adaptive; 0: off) and their
    memory, the largest tar member, and ``footer_dir`` (``data.cache_dir``: index footers kept by identity)."""

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
