"""The ``data:`` section of a trainer yaml, validated into a frozen dataclass.

Every bad value raises ``ConfigError`` naming the key, the value and what is allowed,
so a typo in a yaml file never turns into a silently different data order.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, UnknownKeyError, shown
from ..limits import MAX_OPEN_SHARDS, MAX_PARTITIONS, is_int, is_number
from ..observe.monitoring import MONITOR_KEYS
from . import formats as registry
from . import overrides as override
from .specs import CacheSpec, DataSpec, GrowthSpec, IndexSpec, NetPolicy, ReadSpec, SourceSpec
from .transforms import SOURCE_TRANSFORM_KEYS, TransformConfig
from .weight_schedule import check_weights, normalised, weight_at

BACKENDS = ("hf", "local")


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, str) and x for x in v)


def _check_data_files(v: Any) -> bool:
    if v is None or (isinstance(v, str) and v):
        return True
    if _is_str_list(v):
        return True
    if isinstance(v, dict) and v:
        return all(isinstance(k, str) and (isinstance(x, str) and x or _is_str_list(x)) for k, x in v.items())
    return False


# datasets' packaged builders that read files: without data_files they read the working directory
FILE_BUILDERS = ("parquet", "json", "csv", "text", "arrow", "pandas", "xml", "webdataset", "imagefolder",
                 "audiofolder", "videofolder")


def file_builders() -> tuple[str, ...]:
    """Builder names that read the files data_files names: datasets' and the registered formats' (sources/)."""
    return tuple(dict.fromkeys(FILE_BUILDERS + registry.indexed_builders()))


# data.max_requests_per_s: io/budget.py's settings (kept here: config/ imports no io module)
REQUEST_RATE_NAMES = ("hub-anonymous", "hub-free", "hub-pro", "hub-team", "hub-enterprise", "hub-enterprise-plus",
                      "unlimited")
MAX_REQUEST_RATE = 1_000_000.0


def _check_request_rate(v: Any) -> bool:
    if v is None or v in REQUEST_RATE_NAMES:
        return True
    return is_number(v) and 0.001 <= v <= MAX_REQUEST_RATE


# The most data.max_member_bytes may allow: a member is held in memory whole.
MAX_MEMBER_BYTES = 1 << 32

# key -> (check, what is allowed)
GROWTH_MODES = ("off", "append", "follow")

_RULES: dict[str, tuple[Any, str]] = {
    "backend": (lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
    "streaming": (lambda v: v is None or isinstance(v, bool), "true or false"),   # None: by backend
    "dataset_name_or_path": (lambda v: isinstance(v, str) and v.strip() != "",
                             "a non-empty string: a hub id, a builder name "
                             f"({', '.join(dict.fromkeys((*registry.indexed_builders(), *registry.DATASETS_BUILDERS)))}) "
                             "with data_files, a local directory or file, or an http(s):// / hf:// path"),
    "name": (lambda v: v is None or (isinstance(v, str) and v), "null or a dataset config (subset) name"),
    "data_files": (_check_data_files, "null, a path or glob, a non-empty list of them, or a mapping split -> paths"),
    "revision": (lambda v: v is None or (isinstance(v, str) and v.strip() != "" and not v.startswith("/")),
                 "null (the repo's main branch) or a Hub revision: a branch, a tag or a commit sha"),
    "data_dir": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                 "null or a folder of the dataset (datasets' load_dataset data_dir)"),
    "split": (lambda v: isinstance(v, str) and v.strip() != "", "a split name such as train"),
    "shuffle": (lambda v: isinstance(v, bool), "true or false"),
    "shuffle_seed": (lambda v: is_int(v, 0, 2**63 - 1), "an integer in [0, 2**63)"),
    "buffer_size": (lambda v: is_int(v, 1, 10_000_000), "an integer from 1 to 10000000 (rows)"),
    "interleave_shards": (lambda v: is_int(v, 1, MAX_OPEN_SHARDS), f"an integer from 1 to {MAX_OPEN_SHARDS}"),
    "block_rows": (lambda v: is_int(v, 1, 1_000_000), "an integer from 1 to 1000000 (rows)"),
    "resume_state_path": (lambda v: v is None or (isinstance(v, str) and v), "null or a sidecar file / directory"),
    "cache_dir": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "null (off) or a directory"),
    "cache_size_limit_gb": (lambda v: is_number(v) and 0 < v <= 1e9,
                            "a number of gigabytes > 0 and at most 1e9 (diskcache keeps the limit in bytes as a "
                            "64-bit integer)"),
    "retries": (lambda v: is_int(v, 0, 100), "an integer from 0 to 100"),
    "retry_backoff_s": (lambda v: is_number(v) and 0 <= v <= 600,
                        "a number of seconds from 0 to 600"),
    "timeout_s": (lambda v: is_number(v) and 0 < v <= 3600,
                  "a number of seconds > 0 and <= 3600"),
    "retry_budget_s": (lambda v: is_number(v) and 0 < v <= 86400,
                       "a number of seconds > 0 and <= 86400"),
    "max_requests_per_s": (_check_request_rate,
                           "null (automatic: hf:// data on huggingface.co at the Hub's free tier with a token, anonymous without; S3 at "
                           "4950/s per bucket; other stores unlimited), a number of requests per second for the whole "
                           f"job from 0.001 to {int(MAX_REQUEST_RATE)}, or one of {', '.join(REQUEST_RATE_NAMES)}"),
    "rate_limit_wait_s": (lambda v: is_number(v) and 0 <= v <= 86400,
                          "a number of seconds from 0 to 86400: how long one request may wait out a store's "
                          "rate-limit answers (HTTP 429, S3 503 SlowDown) before it fails"),
    "num_partitions": (lambda v: v is None or is_int(v, 1, MAX_PARTITIONS),
                       f"null (ranks x DataLoader workers of the first run) or an integer from 1 to {MAX_PARTITIONS}, "
                       "at least ranks x workers"),
    "elastic": (lambda v: isinstance(v, bool), "true or false"),
    "elastic_determinism": (lambda v: v is None or isinstance(v, bool),
                            "null (true when data.num_partitions is set, unless data.growth is follow), true (every "
                            "optimizer step takes the same micro-batches, one from each partition, on any number of "
                            "ranks and DataLoader workers; docs/elastic.md) or false (the global batches depend on "
                            "ranks x workers; any shape)"),
    "index_path": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                   "null or the path of a dataset index file (written by `resumable-stream index`)"),
    "verify_files": (lambda v: isinstance(v, bool), "true or false"),
    "prefetch_blocks": (lambda v: v is None or is_int(v, 0, 256),
                        "null (adaptive, at most 64) or an integer from 0 (off) to 256: the most row groups fetched "
                        "ahead per partition"),
    "prefetch_memory_mb": (lambda v: is_number(v)
                           and 1 <= v <= 1_048_576,
                           "a number of MiB from 1 to 1048576: the bytes the row groups fetched ahead may hold, "
                           "in flight and decoded, per process"),
    "max_member_bytes": (lambda v: is_int(v, 1, MAX_MEMBER_BYTES),
                         f"an integer from 1 to {MAX_MEMBER_BYTES} (bytes): the largest WebDataset tar member read; "
                         "a sample with a larger one is a bad sample"),
    "growth": (lambda v: v in GROWTH_MODES, "one of off (the files are fixed), append (files that appear join at "
               "the next epoch), follow (only new files are read: at the end of the known data the stream waits "
               "for more; see docs/growing-data.md)"),
    "poll_interval_s": (lambda v: is_number(v) and 0.01 <= v <= 3600,
                        "a number of seconds from 0.01 to 3600: how often data.growth: follow lists the files while "
                        "it waits (backing off to 16x that)"),
    "follow_timeout_s": (lambda v: is_number(v) and 0 <= v <= 31_536_000,
                         "a number of seconds from 0 to 31536000: how long data.growth: follow waits for new files "
                         "before the stream ends (the run ends with a checkpoint)"),
    "growth_allow_removal": (lambda v: isinstance(v, bool), "true or false (with data.growth: append, a file that "
                             "disappeared leaves the epochs after the current one instead of stopping the resume)"),
    "storage_options": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) and k for k in v)),
                        "null or a mapping of fsspec filesystem options (e.g. endpoint_url for s3://), flat or "
                        "keyed by protocol"),
}


@dataclass(frozen=True)
class StreamConfig:
    """Validated data configuration. Construct with keywords, ``from_dict`` or ``from_yaml``."""

    dataset_name_or_path: str
    backend: str = "hf"
    streaming: bool | None = None  # None: true for backend hf, false for local
    name: str | None = None
    data_files: str | list[str] | dict[str, Any] | None = None
    revision: str | None = None         # Hub repo revision (branch, tag, commit sha); None: main
    data_dir: str | None = None         # a folder of the dataset (load_dataset's data_dir)
    split: str = "train"
    shuffle: bool = False
    shuffle_seed: int = 42
    buffer_size: int = 16384
    interleave_shards: int = 4
    block_rows: int = 1024
    resume_state_path: str | None = None
    cache_dir: str | None = None
    cache_size_limit_gb: float = 50
    retries: int = 5
    retry_backoff_s: float = 1.0
    timeout_s: float = 60.0             # the deadline of one request: connect, headers and body
    retry_budget_s: float = 180.0       # one read's tries and waits; no try starts after it (see sources/net.py)
    max_requests_per_s: float | str | None = None   # the job's request rate per store (io/budget.py); None: auto
    rate_limit_wait_s: float = 600.0    # one request's waits for a store's rate-limit resets, at most
    num_partitions: int | None = None   # virtual partitions; None: ranks x workers (or the checkpoint's)
    elastic: bool = False               # resume a checkpoint on other ranks / workers
    elastic_determinism: bool | None = None   # the same global batches on any ranks x workers (None: with num_partitions)
    index_path: str | None = None       # dataset index file: used when present, written (rank 0) when not
    verify_files: bool = True           # re-check each file's identity against a saved / given index
    prefetch_blocks: int | None = None  # most parquet row groups fetched ahead per partition (None: adaptive; 0: off)
    prefetch_memory_mb: float = 256     # what the row groups fetched ahead may hold per process (in flight + decoded)
    max_member_bytes: int = 64 << 20    # largest WebDataset tar member read (a larger one: a bad sample)
    growth: str = "off"                 # off: fixed files; append: new files join at the next epoch
    growth_allow_removal: bool = False  # append: a vanished file leaves the next epochs (else a mismatch)
    poll_interval_s: float = 10.0       # follow: seconds between listings while waiting (backs off to 16x)
    follow_timeout_s: float = 3600.0    # follow: a wait longer than this ends the stream
    storage_options: dict[str, Any] | None = None   # fsspec options of remote files (s3fs: endpoint_url, ...)
    source_file: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key, (check, allowed) in _RULES.items():
            value = getattr(self, key)
            if not check(value):
                raise ConfigError(f"data.{key}: got {shown(value)}; allowed: {allowed}")
        if self.streaming is None:
            object.__setattr__(self, "streaming", self.backend == "hf")
        if self.streaming and self.backend != "hf":
            raise ConfigError(
                f"data.streaming: got true with data.backend {shown(self.backend)}; streaming needs backend 'hf' "
                "(backend 'local' loads a dataset saved with save_to_disk, set streaming: false)"
            )
        if self.backend == "hf" and self.dataset_name_or_path in file_builders() and self.data_files is None:
            # datasets would read the files of the current working directory
            raise ConfigError(
                f"data.data_files: missing with data.dataset_name_or_path {shown(self.dataset_name_or_path)}; the "
                f"{self.dataset_name_or_path} builder reads the files data_files names (a path or glob, a list of "
                "them, or a mapping split -> paths), or set dataset_name_or_path to a directory or a hub id"
            )
        path = self.dataset_name_or_path
        if self.revision is not None and (path in file_builders() or self.backend == "local" or os.path.exists(path)
                                          or ("://" in path and not path.startswith("hf://"))):
            raise ConfigError(
                f"data.revision: got {shown(self.revision)} with data.dataset_name_or_path {shown(path)}; a revision "
                "applies to a Hub repo id (org/name); for hf:// files write it into the path "
                "(hf://datasets/org/name@revision/...)"
            )
        if self.growth != "off" and not (self.backend == "hf" and self.streaming):
            raise ConfigError(f"data.growth: got {shown(self.growth)} with data.backend {shown(self.backend)} and streaming "
                              f"{self.streaming}; allowed: off, or append / follow with backend 'hf' and streaming: true")
        if self.elastic_determinism and self.growth == "follow":
            raise ConfigError(
                "data.elastic_determinism: got true with data.growth 'follow'; allowed: null or false (follow mode "
                "reads each round of new files to its end in every partition, so partitions give different numbers "
                "of micro-batches per round and no step can take one from each)")
        if self.backend == "local" and self.data_files is not None:
            raise ConfigError(
                f"data.data_files: got {shown(self.data_files)} with data.backend 'local'; "
                "backend 'local' reads a save_to_disk directory, remove data_files or use backend 'hf'"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "source_file"]

    @classmethod
    def from_dict(cls, data: Any, *, base_dir: str | None = None, source_file: str | None = None,
                  extra_keys: tuple[str, ...] | None = None) -> StreamConfig | MixtureConfig:
        """The ``data:`` section as a :class:`StreamConfig` (a :class:`MixtureConfig` with ``sources``).

        ``base_dir``: where relative paths are looked for first (the yaml's folder); ``source_file``: named in
        errors; ``extra_keys``: other keys accepted and left out (default: the transform's, monitoring's and
        trainer's). Raises ConfigError naming key, value and what is allowed (UnknownKeyError with a suggestion)."""
        if not isinstance(data, dict):
            raise ConfigError(f"data: got {type(data).__name__} {shown(data)}; allowed: a mapping of data keys")
        if extra_keys is None:
            extra_keys = (*TransformConfig.KEYS, *MONITOR_KEYS, "max_samples", "eval")   # eval: the trainer's
        if "sources" in data:
            return MixtureConfig.from_dict(data, base_dir=base_dir, source_file=source_file, extra_keys=extra_keys)
        known = cls.keys()
        everything = known + list(extra_keys) + list(MIXTURE_KEYS)
        for key in data:
            if key not in everything:
                raise UnknownKeyError("data", str(key), everything, f" Allowed keys: {', '.join(sorted(everything))}")
        for key in ("stopping", "mixture_change"):
            if key in data:
                raise ConfigError(f"data.{key}: got {shown(data[key])} without data.sources; it only applies to a "
                                  "mixture of datasets (data.sources: [...])")
        if "dataset_name_or_path" not in data:
            raise ConfigError("data.dataset_name_or_path: missing; it is required (a hub id, builder name or path)")
        values = {k: v for k, v in data.items() if k in known}
        if base_dir is not None:
            values = _resolve_relative_paths(values, base_dir)
        return cls(**values, source_file=source_file)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> StreamConfig | MixtureConfig:
        """The ``data:`` section of a trainer yaml, or of a yaml of data keys only, with ``key=value`` ``overrides``
        merged in first (:mod:`resumable_stream.config.overrides`); relative paths from the yaml's folder first."""
        path = os.fspath(path)
        doc, base_dir, given = override.read(path, overrides, "a mapping at the top level", data_only=True)
        if "data" not in doc and ({"model", "train"} & set(doc)):
            raise ConfigError(f"config file {shown(path)}: a trainer yaml (it has {', '.join(sorted({'model', 'train'} & set(doc)))}) "
                              "without a data: section; add one with at least dataset_name_or_path")
        section = doc["data"] if "data" in doc else doc
        with override.named(given):
            return cls.from_dict(section, base_dir=base_dir, source_file=path)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}

    @property
    def same_global_batches(self) -> bool:
        """``data.elastic_determinism`` as it applies: set, or by default whenever ``num_partitions`` is set
        (not in follow mode)."""
        if self.elastic_determinism is not None:
            return self.elastic_determinism
        return self.num_partitions is not None and self.growth != "follow"

    # ----------------------------------------------------------------- the specs of the stages (config/specs.py)
    @functools.cached_property
    def source_spec(self) -> SourceSpec:
        """What opening this dataset needs (resolution, network, readers, growth, index), built once."""
        return SourceSpec(
            data=DataSpec(self.dataset_name_or_path, self.backend, bool(self.streaming), self.name, self.data_files,
                          self.revision, self.data_dir, self.split),
            net=NetPolicy(self.retries, self.retry_backoff_s, self.timeout_s, self.retry_budget_s,
                          self.storage_options, self.max_requests_per_s, self.rate_limit_wait_s),
            read=ReadSpec(self.interleave_shards, self.prefetch_blocks, self.prefetch_memory_mb,
                          self.max_member_bytes, self.cache_dir),
            growth=GrowthSpec(self.growth, self.growth_allow_removal, self.poll_interval_s, self.follow_timeout_s),
            index=IndexSpec(self.index_path, self.verify_files))

    @functools.cached_property
    def cache_spec(self) -> CacheSpec:
        """The block cache's settings (``directory`` None: no cache)."""
        return CacheSpec(self.cache_dir, self.cache_size_limit_gb)

    def replace(self, **changes: Any) -> StreamConfig:
        """A copy with ``changes`` (data keys), validated again."""
        return dataclasses.replace(self, **changes)


def _looks_remote(p: str) -> bool:
    return "://" in p


def _resolve_one(p: str, base_dir: str) -> str:
    """A relative local path that exists next to the yaml file is taken from there."""
    if _looks_remote(p) or os.path.isabs(p):
        return p
    candidate = os.path.join(base_dir, p)
    if os.path.exists(candidate) or glob.glob(candidate, recursive=True):
        return os.path.normpath(candidate)
    return p


def _resolve_paths(value: Any, base_dir: str) -> Any:
    """A path, a list of paths or a mapping split -> those (data_files), each path taken as :func:`_resolve_one`
    takes it; anything else as it is."""
    if isinstance(value, dict):
        return {k: _resolve_paths(v, base_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_one(p, base_dir) if isinstance(p, str) else p for p in value]
    return _resolve_one(value, base_dir) if isinstance(value, str) else value


def _resolve_relative_paths(values: dict[str, Any], base_dir: str) -> dict[str, Any]:
    out = dict(values)
    out["data_files"] = _resolve_paths(out.get("data_files"), base_dir)
    for key in ("resume_state_path", "index_path"):
        value = out.get(key)
        if isinstance(value, str) and value:
            out[key] = _resolve_one(value, base_dir)
    name = out.get("dataset_name_or_path")
    if isinstance(name, str) and (name.startswith(".") or os.sep in name) and not _looks_remote(name):
        out["dataset_name_or_path"] = _resolve_one(name, base_dir)
    return out


# ------------------------------------------------------------------ mixtures of datasets
STOPPING = ("first_exhausted", "all_exhausted", "never")
MIXTURE_KEYS = ("sources", "stopping", "mixture_change")
MIXTURE_CHANGE = ("refuse", "allow")
# What one entry of data.sources may set: which dataset it is, how it is read and ordered, its weight and
# label, and the transform keys a source may set for itself (transforms.config.SOURCE_TRANSFORM_KEYS).
# Everything else (shuffle_seed, cache, num_partitions, elastic, the other transform keys) is the data
# section's and applies to every source.
SOURCE_KEYS = ("dataset_name_or_path", "name", "data_files", "data_dir", "split", "backend", "streaming", "shuffle",
               "buffer_size", "interleave_shards", "block_rows", "retries", "retry_backoff_s", "timeout_s",
               "retry_budget_s", "prefetch_blocks", "prefetch_memory_mb", "storage_options", "index_path", "weight",
               "label", "max_requests_per_s", "rate_limit_wait_s")
_IDENTITY_KEYS = ("dataset_name_or_path", "name", "data_files", "data_dir")
_SHARED_KEYS = ("shuffle_seed", "cache_dir", "cache_size_limit_gb", "num_partitions", "elastic", "elastic_determinism",
                "verify_files")
_LABEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _shared(name: str) -> property:
    return property(lambda self: getattr(self.sources[0], name), doc=f"data.{name}: the same for every source")


@dataclass(frozen=True)
class MixtureConfig:
    """A weighted mixture of datasets (``data.sources``): one full :class:`StreamConfig` per source, relative
    ``weights``, ``labels`` (default ``source0``, ...) and ``stopping`` (docs/mixtures.md). The other keys of
    ``data:`` apply to every source; ``resume_state_path`` is the mixture's own."""

    sources: tuple[StreamConfig, ...]
    weights: tuple[float, ...]
    labels: tuple[str, ...] | None = None
    stopping: str = "first_exhausted"
    resume_state_path: str | None = None
    source_file: str | None = field(default=None, compare=False, repr=False)
    mixture_change: str = "refuse"      # allow: a resume with other weights / sources applies them from there

    def __post_init__(self) -> None:
        if not (isinstance(self.sources, (list, tuple)) and self.sources
                and all(isinstance(s, StreamConfig) for s in self.sources)):
            raise ConfigError(f"data.sources: got {shown(self.sources)}; allowed: a non-empty list of sources")
        if any(src.growth == "follow" for src in self.sources):
            raise ConfigError("data.growth: got 'follow' with data.sources; allowed: off or append in a mixture "
                              "(follow mode reads a single dataset)")
        n = len(self.sources)
        labels = tuple(self.labels) if self.labels is not None else tuple(f"source{i}" for i in range(n))
        if not isinstance(self.weights, (list, tuple)) or len(self.weights) != n or len(labels) != n:
            raise ConfigError(f"data.sources: {n} sources with weights {shown(self.weights)} and labels {shown(labels)}; "
                              "allowed: one weight and one label per source")
        weights = check_weights(list(self.weights), list(labels), lambda i: f"data.sources[{i}].weight")
        if self.mixture_change not in MIXTURE_CHANGE:
            raise ConfigError(f"data.mixture_change: got {shown(self.mixture_change)}; allowed: refuse (default: resuming "
                              "with other weights or sources is an error) or allow (they apply from the resume point)")
        for i, label in enumerate(labels):
            if not (isinstance(label, str) and _LABEL.match(label)):
                raise ConfigError(f"data.sources[{i}].label: got {shown(label)}; allowed: 1 to 64 letters, digits, "
                                  "'_', '-' or '.' (it prefixes the source's sample keys)")
            if label in labels[:i]:
                j = labels.index(label)
                if label == f"source{i}":    # source i has no label of its own: its default clashes
                    raise ConfigError(f"data.sources[{j}].label: got {shown(label)}, which is the default label of "
                                      f"data.sources[{i}]; give data.sources[{i}] a label, or data.sources[{j}] "
                                      "another one")
                raise ConfigError(f"data.sources[{i}].label: got {shown(label)}, the label of data.sources"
                                  f"[{j}] too; allowed: a label no other source has")
        if self.stopping not in STOPPING:
            raise ConfigError(f"data.stopping: got {shown(self.stopping)}; allowed: one of {', '.join(STOPPING)}")
        first = self.sources[0]
        for i, s in enumerate(self.sources):
            if s.resume_state_path is not None:
                raise ConfigError(f"data.sources[{i}].resume_state_path: got {shown(s.resume_state_path)}; allowed: null "
                                  "(the mixture resumes as a whole from data.resume_state_path)")
            if s.index_path is not None and s.index_path in [o.index_path for o in self.sources[:i]]:
                j = [o.index_path for o in self.sources].index(s.index_path)
                raise ConfigError(f"data.sources[{i}].index_path: got {shown(s.index_path)}, the index_path of "
                                  f"data.sources[{j}] too; allowed: a file of its own (an index describes one dataset)")
            for key in _SHARED_KEYS:
                if getattr(s, key) != getattr(first, key):
                    raise ConfigError(f"data.sources[{i}].{key}: got {shown(getattr(s, key))}, data.sources[0] has "
                                      f"{shown(getattr(first, key))}; allowed: the same for every source (set it in data:)")
        if self.resume_state_path is not None and not (isinstance(self.resume_state_path, str)
                                                       and self.resume_state_path):
            raise ConfigError(f"data.resume_state_path: got {shown(self.resume_state_path)}; allowed: null or a sidecar "
                              "file / directory")
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "labels", labels)

    # settings every source shares (set in data:)
    shuffle_seed = _shared("shuffle_seed")
    cache_dir = _shared("cache_dir")
    num_partitions = _shared("num_partitions")
    elastic = _shared("elastic")
    elastic_determinism = _shared("elastic_determinism")
    same_global_batches = _shared("same_global_batches")

    @property
    def growth(self) -> str:
        """``data.growth`` of the mixture: a growing source's mode (the key is the data section's), else off."""
        return next((s.growth for s in self.sources if s.growth != "off"), "off")

    @property
    def probabilities(self) -> tuple[float, ...]:
        """The weights normalised to sum to 1 (schedules: at position 0)."""
        return normalised([weight_at(w, 0.0) for w in self.weights])

    @classmethod
    def from_dict(cls, data: dict, *, base_dir: str | None = None, source_file: str | None = None,
                  extra_keys: tuple[str, ...] = ()) -> MixtureConfig:
        raw = data["sources"]
        if not (isinstance(raw, list) and raw):
            raise ConfigError(f"data.sources: got {shown(raw)}; allowed: a non-empty list of mappings, each with "
                              "dataset_name_or_path (and data_files, split, weight, label, ...)")
        for key in _IDENTITY_KEYS:
            if key in data:
                raise ConfigError(f"data.{key}: got {shown(data[key])} next to data.sources; allowed: only inside each "
                                  f"source (data.sources[i].{key})")
        if data.get("index_path") is not None:     # one file per dataset: each source names its own
            raise ConfigError(f"data.index_path: got {shown(data['index_path'])} next to data.sources; allowed: null (a "
                              "dataset index is per source: set data.sources[i].index_path)")
        shared = {k: v for k, v in data.items() if k not in MIXTURE_KEYS}
        # the shared keys, checked under their own names (a placeholder stands in for the dataset)
        StreamConfig.from_dict({**shared, "dataset_name_or_path": "-"}, extra_keys=extra_keys)
        base = {k: v for k, v in shared.items() if k in StreamConfig.keys() and k not in ("resume_state_path",
                                                                                        "index_path")}
        sources, weights, labels = [], [], []
        for i, entry in enumerate(raw):
            at = f"data.sources[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{at}: got {shown(entry)}; allowed: a mapping with dataset_name_or_path, data_files, "
                                  "split, weight, label, ...")
            for key in entry:
                if key in SOURCE_KEYS or key in SOURCE_TRANSFORM_KEYS:
                    continue
                if key in StreamConfig.keys() or key in extra_keys or key in MIXTURE_KEYS:
                    raise ConfigError(f"{at}.{key}: not a per-source key; set it in the data: section, where it "
                                      f"applies to every source. Per-source keys: "
                                      f"{', '.join(SOURCE_KEYS + SOURCE_TRANSFORM_KEYS)}")
                raise UnknownKeyError(at, str(key), SOURCE_KEYS + SOURCE_TRANSFORM_KEYS,
                                      f" Allowed keys: {', '.join(SOURCE_KEYS + SOURCE_TRANSFORM_KEYS)}")
            if "dataset_name_or_path" not in entry:
                raise ConfigError(f"{at}.dataset_name_or_path: missing; every source needs one (a hub id, builder "
                                  "name or path)")
            weights.append(entry.get("weight", 1.0))
            labels.append(entry.get("label", f"source{i}"))
            values = {**base, **{k: v for k, v in entry.items()
                                 if k not in ("weight", "label") and k not in SOURCE_TRANSFORM_KEYS}}
            try:
                sources.append(StreamConfig.from_dict(values, base_dir=base_dir, source_file=source_file,
                                                      extra_keys=()))
            except ConfigError as e:
                raise e.in_source(at, entry) from None
        resume = shared.get("resume_state_path")
        if base_dir is not None and isinstance(resume, str) and resume:
            resume = _resolve_one(resume, base_dir)
        return cls(tuple(sources), tuple(weights), tuple(labels), data.get("stopping", "first_exhausted"), resume,
                   source_file=source_file, mixture_change=data.get("mixture_change", "refuse"))

    def replace(self, **changes: Any) -> MixtureConfig:
        """Mixture fields (sources, weights, labels, stopping, resume_state_path) change here; data keys
        (e.g. cache_dir) change in every source."""
        own = {k: changes.pop(k) for k in list(changes) if k in ("sources", "weights", "labels", "stopping",
                                                                 "resume_state_path", "mixture_change")}
        for key in changes:
            if key not in StreamConfig.keys():
                raise ConfigError(f"data.{key}: unknown key")
        if changes:
            own["sources"] = tuple(s.replace(**changes) for s in own.get("sources", self.sources))
        return dataclasses.replace(self, **own)


def not_a_config(config: Any, allowed: str) -> ConfigError:
    """The error for something given where a config belongs; an opened ``datasets`` pipeline is told how it
    maps onto a config (docs/trainers.md, "Moving a datasets streaming pipeline over")."""
    kind = type(config)
    if kind.__module__.split(".")[0] == "datasets":
        return ConfigError(
            f"config: got a datasets {kind.__name__} (a pipeline already opened); allowed: {allowed}. The stream "
            "resolves, plans, seeks and verifies the files itself, so it takes what load_dataset was given as data: "
            "keys (StreamConfig(dataset_name_or_path=..., name=..., data_files=..., split=..., shuffle=True, "
            "shuffle_seed=..., buffer_size=...)), and a .map function of one row as TransformConfig(map=fn) or "
            "data.map: 'module:function'; see docs/trainers.md, 'Moving a datasets streaming pipeline over'")
    return ConfigError(f"config: got {kind.__name__}; allowed: {allowed}")

