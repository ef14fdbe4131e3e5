"""The ``data:`` section of a trainer yaml, validated into a frozen dataclass.

Every bad value raises ``ConfigError`` naming the key, the value and what is allowed,
so a typo in a yaml file never turns into a silently different data order.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import ConfigError

BACKENDS = ("hf", "local")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


# key -> (check, what is allowed)
_RULES: dict[str, tuple[Any, str]] = {
    "backend": (lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
    "streaming": (lambda v: isinstance(v, bool), "true or false"),
    "dataset_name_or_path": (lambda v: isinstance(v, str) and v.strip() != "",
                             "a non-empty string: a hub id, a builder name (parquet, json, csv, text, arrow) "
                             "with data_files, a local directory or file, or an http(s):// / hf:// path"),
    "name": (lambda v: v is None or (isinstance(v, str) and v), "null or a dataset config (subset) name"),
    "data_files": (_check_data_files, "null, a path or glob, a non-empty list of them, or a mapping split -> paths"),
    "split": (lambda v: isinstance(v, str) and v.strip() != "", "a split name such as train"),
    "shuffle": (lambda v: isinstance(v, bool), "true or false"),
    "shuffle_seed": (lambda v: _is_int(v) and 0 <= v < 2**63, "an integer in [0, 2**63)"),
    "buffer_size": (lambda v: _is_int(v) and 1 <= v <= 10_000_000, "an integer from 1 to 10000000 (rows)"),
    "interleave_shards": (lambda v: _is_int(v) and 1 <= v <= 64, "an integer from 1 to 64"),
    "block_rows": (lambda v: _is_int(v) and 1 <= v <= 1_000_000, "an integer from 1 to 1000000 (rows)"),
    "resume_state_path": (lambda v: v is None or (isinstance(v, str) and v), "null or a sidecar file / directory"),
    "cache_dir": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "null (off) or a directory"),
    "cache_size_limit_gb": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
                            "a finite number of gigabytes > 0"),
    "retries": (lambda v: _is_int(v) and 0 <= v <= 100, "an integer from 0 to 100"),
    "retry_backoff_s": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and 0 <= v <= 600,
                        "a number of seconds from 0 to 600"),
    "timeout_s": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and 0 < v <= 3600,
                  "a number of seconds > 0 and <= 3600"),
}


@dataclass(frozen=True)
class StreamConfig:
    """Validated data configuration. Construct with keywords, ``from_dict`` or ``from_yaml``."""

    dataset_name_or_path: str
    backend: str = "hf"
    streaming: bool | None = None  # None: true for backend hf, false for local
    name: str | None = None
    data_files: str | list[str] | dict[str, Any] | None = None
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
    timeout_s: float = 60.0
    source_file: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key, (check, allowed) in _RULES.items():
            value = getattr(self, key)
            if key == "streaming" and value is None:
                continue
            if not check(value):
                raise ConfigError(f"data.{key}: got {value!r}; allowed: {allowed}")
        if self.streaming is None:
            object.__setattr__(self, "streaming", self.backend == "hf")
        if self.streaming and self.backend != "hf":
            raise ConfigError(
                f"data.streaming: got true with data.backend {self.backend!r}; streaming needs backend 'hf' "
                "(backend 'local' loads a dataset saved with save_to_disk, set streaming: false)"
            )
        if self.backend == "local" and self.data_files is not None:
            raise ConfigError(
                f"data.data_files: got {self.data_files!r} with data.backend 'local'; "
                "backend 'local' reads a save_to_disk directory, remove data_files or use backend 'hf'"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "source_file"]

    @classmethod
    def from_dict(cls, data: Any, *, base_dir: str | None = None, source_file: str | None = None,
                  extra_keys: tuple[str, ...] | None = None) -> StreamConfig:
        """``extra_keys``: other keys of the ``data:`` section (the transform's), accepted and left out.
        Default: the text transform's keys, so a trainer yaml's data section reads as a stream config."""
        if not isinstance(data, dict):
            raise ConfigError(f"data: got {type(data).__name__} {data!r}; allowed: a mapping of data keys")
        if extra_keys is None:
            from .transforms.config import TransformConfig

            extra_keys = (*TransformConfig.KEYS, "max_samples")
        known = cls.keys()
        everything = known + list(extra_keys)
        for key in data:
            if key not in everything:
                close = difflib.get_close_matches(str(key), everything, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"data.{key}: unknown key{hint} Allowed keys: {', '.join(sorted(everything))}")
        if "dataset_name_or_path" not in data:
            raise ConfigError("data.dataset_name_or_path: missing; it is required (a hub id, builder name or path)")
        values = {k: v for k, v in data.items() if k in known}
        if base_dir is not None:
            values = _resolve_relative_paths(values, base_dir)
        return cls(**values, source_file=source_file)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> StreamConfig:
        """Read the ``data:`` section of a trainer yaml, or a yaml that is only the data section."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r}: not found") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path!r}: not UTF-8 text; expected a yaml file") from None
        except OSError as e:
            raise ConfigError(f"config file {path!r}: cannot be read ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r}: not valid yaml ({e})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"config file {path!r}: expected a mapping at the top level, got {type(doc).__name__}")
        if "data" not in doc and ({"model", "train"} & set(doc)):
            raise ConfigError(f"config file {path!r}: a trainer yaml (it has {', '.join(sorted({'model', 'train'} & set(doc)))}) "
                              "without a data: section; add one with at least dataset_name_or_path")
        section = doc["data"] if "data" in doc else doc
        return cls.from_dict(section, base_dir=os.path.dirname(os.path.abspath(path)), source_file=path)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}

    def replace(self, **changes: Any) -> StreamConfig:
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


def _resolve_relative_paths(values: dict[str, Any], base_dir: str) -> dict[str, Any]:
    out = dict(values)
    dfs = out.get("data_files")
    if isinstance(dfs, str):
        out["data_files"] = _resolve_one(dfs, base_dir)
    elif isinstance(dfs, list):
        out["data_files"] = [_resolve_one(p, base_dir) if isinstance(p, str) else p for p in dfs]
    elif isinstance(dfs, dict):
        out["data_files"] = {
            k: (_resolve_one(v, base_dir) if isinstance(v, str)
                else [_resolve_one(p, base_dir) if isinstance(p, str) else p for p in v] if isinstance(v, list) else v)
            for k, v in dfs.items()
        }
    state = out.get("resume_state_path")
    if isinstance(state, str) and state:
        out["resume_state_path"] = _resolve_one(state, base_dir)
    name = out.get("dataset_name_or_path")
    if isinstance(name, str) and (name.startswith(".") or os.sep in name) and not _looks_remote(name):
        out["dataset_name_or_path"] = _resolve_one(name, base_dir)
    return out
