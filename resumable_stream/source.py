"""Where rows come from: a dataset opened through HF ``datasets``, cut into shards we can name.

A ``Source`` knows its shard list (with identities and, where cheap, row counts), a
fingerprint of everything that determines its content, and can open shard *s* at row *r*
and yield Arrow tables from there. Everything above it (plan, stream, cache) only uses
``shards``, ``fingerprint`` and ``read``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .config import StreamConfig
from .errors import ConfigError, SourceError

log = logging.getLogger(__name__)

# Rows per shard when a dataset is loaded normally (streaming: false or backend: local).
MAP_STYLE_SHARD_ROWS = 8192
# Rows per Arrow table handed to the stream while reading a shard.
READ_BATCH_ROWS = 8192

_EXTENSION_BUILDERS = {
    ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
    ".csv": "csv", ".tsv": "csv", ".txt": "text", ".arrow": "arrow",
}


@dataclass(frozen=True)
class ShardInfo:
    index: int
    file: str            # path or URL of the file the shard lives in ("" when unknown)
    part: int | None     # parquet row group or map-style slice; None for a whole file
    num_rows: int | None

    @property
    def name(self) -> str:
        base = os.path.basename(self.file.rstrip("/")) or f"shard{self.index}"
        return base if self.part is None else f"{base}#{self.part}"


def builder_for_path(path: str) -> str | None:
    """The packaged builder for a single file path / URL, by extension (None if not a known file type)."""
    low = path.lower().split("?", 1)[0]
    for ext in sorted(_EXTENSION_BUILDERS, key=len, reverse=True):
        if low.endswith(ext):
            return _EXTENSION_BUILDERS[ext]
    return None


def _builder_args(cfg: StreamConfig) -> tuple[str, object]:
    """Map ``dataset_name_or_path`` (+ ``data_files``) to load_dataset's (path, data_files)."""
    path, data_files = cfg.dataset_name_or_path, cfg.data_files
    if path.startswith("hf://") and builder_for_path(path) is None:
        # LLaMA-Factory style "hf://org/name" or fsspec "hf://datasets/org/name": a hub id.
        path = path[len("hf://"):]
        path = path[len("datasets/"):] if path.startswith("datasets/") else path
    elif data_files is None and (os.path.isfile(path) or "://" in path):
        builder = builder_for_path(path)
        if builder is None:
            raise ConfigError(
                f"data.dataset_name_or_path: {path!r} is a file whose type is not known; "
                f"allowed extensions: {', '.join(sorted(_EXTENSION_BUILDERS))}"
            )
        path, data_files = builder, path
    return path, data_files


def _file_identity(path: str) -> dict:
    """Size plus whatever version marker the filesystem gives (mtime, ETag, Last-Modified, blob id)."""
    import fsspec

    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
        info = fs.info(fs_path)
    except FileNotFoundError:
        raise SourceError(f"data file {path!r}: not found") from None
    except Exception as e:  # network and permission errors
        raise SourceError(f"data file {path!r}: cannot read its metadata ({type(e).__name__}: {e})") from None
    ident = {"path": path, "size": info.get("size")}
    for key in ("mtime", "ETag", "Last-Modified", "blob_id"):
        if info.get(key) is not None:
            ident[key.lower()] = info[key] if not isinstance(info[key], float) else round(info[key], 6)
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        ident["sha256"] = lfs["sha256"]
    return ident


def _parquet_row_groups(path: str) -> list[int]:
    import fsspec

    try:
        with fsspec.open(path, "rb") as f:
            md = pq.ParquetFile(f).metadata
            return [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _map_threads(fn, items: list) -> list:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(fn, items))


def _digest(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


class Source:
    """A dataset split opened through ``datasets``. Use :func:`open_source` to make one."""

    shards: list[ShardInfo]
    fingerprint: dict
    column_names: list[str] | None

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        raise NotImplementedError


class StreamingSource(Source):
    """``load_dataset(..., streaming=True)``; parquet resharded to one shard per row group."""

    def __init__(self, ids, shards: list[ShardInfo], fingerprint: dict):
        self._ids = ids
        self.shards = shards
        self.fingerprint = fingerprint
        self.column_names = ids.column_names

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        one = self._ids.shard(num_shards=len(self.shards), index=shard, contiguous=True).with_format("arrow")
        seen = 0
        # Reopening at a row re-reads the shard's prefix: bounded by one shard (a row group for parquet).
        for table in self._guarded(one.iter(batch_size=READ_BATCH_ROWS), shard):
            n = table.num_rows
            if seen + n <= start_row:
                seen += n
                continue
            if seen < start_row:
                table = table.slice(start_row - seen)
            seen += n
            yield table


    def _guarded(self, tables: Iterator[pa.Table], shard: int) -> Iterator[pa.Table]:
        """Errors from deep inside datasets / fsspec become one SourceError naming the file."""
        while True:
            try:
                table = next(tables)
            except StopIteration:
                return
            except Exception as e:
                info = self.shards[shard]
                raise SourceError(f"data file {info.file!r} (shard {shard}, {info.name}): read failed "
                                  f"({type(e).__name__}: {e})") from e
            yield table


class MapStyleSource(Source):
    """A dataset loaded normally (memory-mapped Arrow), cut into fixed-size row ranges."""

    def __init__(self, ds, fingerprint: dict):
        self._arrow = ds.with_format("arrow")
        n = len(ds)
        count = max(1, -(-n // MAP_STYLE_SHARD_ROWS))
        self.shards = [
            ShardInfo(i, "", i, min(MAP_STYLE_SHARD_ROWS, n - i * MAP_STYLE_SHARD_ROWS)) for i in range(count)
        ] if n else [ShardInfo(0, "", 0, 0)]
        self.fingerprint = fingerprint
        self.column_names = ds.column_names

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        lo = shard * MAP_STYLE_SHARD_ROWS
        hi = lo + (self.shards[shard].num_rows or 0)
        pos = lo + start_row
        while pos < hi:  # random access: no prefix to re-read
            end = min(hi, pos + READ_BATCH_ROWS)
            yield self._arrow[pos:end]
            pos = end


def open_source(cfg: StreamConfig) -> Source:
    """Open ``cfg``'s dataset split. Raises ConfigError / SourceError with the reason."""
    import datasets

    if cfg.backend == "local":
        return _open_local(cfg)
    path, data_files = _builder_args(cfg)
    try:
        builder = datasets.load_dataset_builder(path, cfg.name, data_files=data_files)
    except FileNotFoundError as e:
        raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r} / data.data_files "
                          f"{cfg.data_files!r}: {e}") from None
    except ConfigError:
        raise
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: cannot be loaded by datasets "
                          f"({type(e).__name__}: {e})") from None

    resolved = builder.config.data_files
    splits = [str(s) for s in (resolved if resolved else (builder.info.splits or {}))]
    if splits and cfg.split not in splits:
        raise ConfigError(f"data.split: got {cfg.split!r}; this dataset has the splits: {', '.join(splits)}")
    files = [str(f) for f in resolved[cfg.split]] if resolved else []
    if resolved and not files:
        raise SourceError(f"data.data_files {cfg.data_files or cfg.dataset_name_or_path!r}: matches no file for "
                          f"split {cfg.split!r}")
    identities = _map_threads(_file_identity, files)
    fingerprint = {
        "dataset": cfg.dataset_name_or_path, "name": cfg.name, "split": cfg.split, "backend": cfg.backend,
        "streaming": cfg.streaming, "builder": builder.name, "files": identities,
    }

    if not cfg.streaming:
        try:
            builder.download_and_prepare()
            ds = builder.as_dataset(split=cfg.split)
        except Exception as e:
            raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: loading without streaming "
                              f"failed ({type(e).__name__}: {e})") from None
        return _finish_map_style(ds, fingerprint)

    try:
        ids = builder.as_streaming_dataset(split=cfg.split)
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: streaming failed "
                          f"({type(e).__name__}: {e})") from None
    shards: list[ShardInfo] | None = None
    if builder.name == "parquet" and files:
        groups = _map_threads(_parquet_row_groups, files)
        resharded = ids.reshard()
        if resharded.num_shards == sum(len(g) for g in groups):
            ids = resharded
            shards = [ShardInfo(0, f, rg, rows) for f, g in zip(files, groups) for rg, rows in enumerate(g)]
    if shards is None:
        n = ids.num_shards
        names = files if len(files) == n else [""] * n
        shards = [ShardInfo(0, f, None, None) for f in names]
    shards = [ShardInfo(i, s.file, s.part, s.num_rows) for i, s in enumerate(shards)]
    fingerprint["num_shards"] = len(shards)
    fingerprint["shard_rows"] = _digest([s.num_rows for s in shards])
    return StreamingSource(ids, shards, fingerprint)


def _finish_map_style(ds, fingerprint: dict) -> MapStyleSource:
    fingerprint = dict(fingerprint, num_rows=len(ds), shard_rows_each=MAP_STYLE_SHARD_ROWS)
    src = MapStyleSource(ds, fingerprint)
    src.fingerprint["num_shards"] = len(src.shards)
    return src


def _open_local(cfg: StreamConfig) -> Source:
    import datasets

    path = cfg.dataset_name_or_path
    if not os.path.isdir(path):
        raise SourceError(f"data.dataset_name_or_path {path!r}: backend 'local' needs a directory written by "
                          "Dataset.save_to_disk / DatasetDict.save_to_disk")
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {path!r}: not a save_to_disk directory "
                          f"({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.split not in loaded:
            raise ConfigError(f"data.split: got {cfg.split!r}; this dataset has the splits: {', '.join(loaded)}")
        ds = loaded[cfg.split]
    else:
        ds = loaded
    files = sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names
        if f.endswith(".arrow") or f in ("state.json", "dataset_info.json")
    )
    fingerprint = {
        "dataset": path, "name": None, "split": cfg.split, "backend": "local", "streaming": False,
        "files": [_file_identity(f) for f in files],
    }
    return _finish_map_style(ds, fingerprint)
