"""The dataset index: what a job needs to read a parquet dataset without resolving it again.

One JSON document: the config that resolved it (dataset, builder config, data_files, split), the
features ``datasets`` would cast to, and per data file its identity (size plus every version marker
the filesystem gives at no extra request: mtime, ETag, Last-Modified, blob id, LFS sha256), the
digest of its parquet footer and its row-group layout (rows and the byte range of each row group's
column chunks, from the footer). Built once per job (``build_parquet_index``: one metadata request
and one footer read per file), it can be shared between ranks, saved next to the checkpoints and
loaded again, so that no rank resolves the dataset or reads a footer at a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import SourceError, StreamMismatchError
from .limits import MAX_INDEX_BYTES, is_int
from .safe_io import FileRefused, JSONRefused, parse_json, read_regular_file

INDEX_FORMAT = "resumable-stream-index"
INDEX_VERSION = 1
# Bytes read from a file's end to get its footer in one request (a bigger footer takes a second one).
FOOTER_TAIL_BYTES = 64 * 1024
_MAGIC = b"PAR1"


def resolution_key(cfg) -> dict[str, Any]:
    """The config keys that decide which files an index lists: an index is only used for these."""
    key = {"dataset_name_or_path": cfg.dataset_name_or_path, "name": cfg.name,
           "data_files": cfg.data_files, "split": cfg.split}
    for name in ("revision", "data_dir"):     # only when set: indexes saved before the keys still match
        if getattr(cfg, name, None) is not None:
            key[name] = getattr(cfg, name)
    return key


def footer_digest(footer: bytes) -> str:
    return hashlib.blake2b(footer, digest_size=16).hexdigest()


def split_footer(tail: bytes, size: int, path: str) -> int:
    """The length of the footer (metadata + length + magic) that ``tail``, the end of a file of ``size``
    bytes, ends with. Raises SourceError when the bytes are no parquet footer."""
    if len(tail) < 8 or tail[-4:] != _MAGIC:
        raise SourceError(f"data file {path!r}: not a parquet file (no PAR1 magic at its end)")
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length + 4 > size:
        raise SourceError(f"data file {path!r}: corrupt parquet footer (footer of {length} bytes in a file of {size})")
    return length


def row_group_layout(metadata: pq.FileMetaData) -> list[list[int]]:
    """``[rows, first byte, end byte]`` per row group: the span of its column chunks."""
    out = []
    for i in range(metadata.num_row_groups):
        rg = metadata.row_group(i)
        lo, hi = None, 0
        for j in range(rg.num_columns):
            col = rg.column(j)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + col.total_compressed_size)
        out.append([rg.num_rows, lo or 0, hi])
    return out


def parse_footer(footer: bytes, path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(pa.BufferReader(footer))
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None


def file_entry(identity: dict, footer: bytes) -> dict[str, Any]:
    """An index entry: the file's identity plus its footer digest and row-group layout."""
    md = parse_footer(footer, identity["path"])
    return {**identity, "footer": footer_digest(footer), "footer_bytes": len(footer),
            "row_groups": row_group_layout(md)}


def features_of(footer: bytes, path: str) -> dict[str, Any]:
    """The features ``datasets``' parquet builder infers from a file, those of its arrow schema, as a dict
    (``Features.to_dict()``). Plain columns need no ``datasets`` (``local_parquet.simple_features``)."""
    from .local_parquet import simple_features

    try:
        schema = pq.read_schema(pa.BufferReader(footer))
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None
    simple = simple_features(schema)
    if simple is not None:
        return simple
    import datasets

    return datasets.Features.from_arrow_schema(schema).to_dict()


def make_index(cfg, builder: str, features, files: list[dict]) -> dict[str, Any]:
    """``features``: a ``datasets.Features`` (a dict too) or its ``to_dict()``."""
    return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "resolution": resolution_key(cfg),
            "builder": builder, "features": features.to_dict() if hasattr(features, "to_dict") else features,
            "files": files}


def identity_of(entry: dict) -> dict[str, Any]:
    """The identity part of an index entry (what the stream fingerprint lists per file)."""
    return {k: v for k, v in entry.items() if k not in ("row_groups", "footer_bytes", "samples", "shards", "shard_rule")}


# ------------------------------------------------------------------------------ files
def encode_index(index: dict) -> bytes:
    return json.dumps(index, sort_keys=True, separators=(",", ":")).encode()


def decode_index(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check the shape of an index; a malformed one is a SourceError naming ``where``."""
    try:
        index = parse_json(data)
    except JSONRefused as e:
        raise SourceError(f"dataset index {where}: {e}") from None
    problem = _shape_problem(index)
    if problem:
        raise SourceError(f"dataset index {where}: {problem}")
    return index


def _shape_problem(index: Any) -> str | None:
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return f"not a {INDEX_FORMAT} file"
    version = index.get("version")
    if type(version) is not int or version != INDEX_VERSION:   # True and 1.0 are no version
        return f"version {version!r:.40}; this library reads version {INDEX_VERSION}"
    if not isinstance(index.get("resolution"), dict) or not isinstance(index.get("features"), dict):
        return "missing 'resolution' or 'features'"
    files = index.get("files")
    if not isinstance(files, list) or not files:
        return "'files' is not a non-empty list"
    if index.get("builder") == "webdataset":
        from .sources.tar_index import entry_problem

        for i, f in enumerate(files):
            problem = entry_problem(f)
            if problem:
                return f"files[{i}]: {problem}"
        return None
    for i, f in enumerate(files):
        # every number at most an int64 (is_int), a footer and the row groups inside the file
        ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and is_int(f.get("size"))
              and isinstance(f.get("footer"), str) and is_int(f.get("footer_bytes"), 0, f["size"])
              and isinstance(f.get("row_groups"), list)
              and all(isinstance(rg, list) and len(rg) == 3 and all(is_int(x) for x in rg)
                      and rg[1] <= rg[2] <= f["size"] for rg in f["row_groups"]))
        if not ok:
            return f"files[{i}] is malformed (path, size, footer, footer_bytes, row_groups [rows, start, end])"
    return None


def save_index(path: str, index: dict) -> str:
    """Write ``index`` to ``path`` atomically (a reader sees the old file or the new one)."""
    from .sidecar import atomic_write

    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    atomic_write(path, encode_index(index))
    return path


def load_index(path: str) -> dict[str, Any]:
    try:
        data = read_regular_file(path, MAX_INDEX_BYTES)   # a FIFO or device is refused unread
    except FileRefused as e:
        raise SourceError(f"dataset index {path!r}: refused: {e}") from None
    except OSError as e:
        raise SourceError(f"dataset index {path!r}: cannot be read ({type(e).__name__}: {e})") from None
    return decode_index(data, repr(path))


def same_resolution(index: dict, cfg) -> bool:
    return index["resolution"] == resolution_key(cfg)


def check_resolution(index: dict, cfg, where: str) -> None:
    """An index made for other data settings is an error naming the keys that differ."""
    now = resolution_key(cfg)
    saved = index["resolution"]
    diffs = [(f"data.{k}", saved.get(k), now[k]) for k in now if saved.get(k) != now[k]]
    if diffs:
        lines = "\n".join(f"  {k}: index {a!r}, config {b!r}" for k, a, b in diffs)
        raise StreamMismatchError(f"dataset index {where} was built for other data settings; rebuild it with "
                                  f"`resumable-stream index` or drop it. Differences:\n{lines}", diffs)


def unreported_validator(key: str, saved: dict, now: dict) -> bool:
    """Is ``key`` a validator only one side's fsspec reports, with the ETag compared on both sides? fsspec's
    HTTP info() gives Last-Modified in newer releases only (filesystem_spec#1909): fsspec 2025.3.0, the
    one beside LLaMA-Factory 0.9.5 (datasets 4.0.0 caps it), gives size and ETag. A state or index saved
    on the other side of such an upgrade / downgrade is not a different file for that alone."""
    return (key == "last-modified" and (saved.get(key) is None) != (now.get(key) is None)
            and saved.get("etag") is not None and now.get("etag") is not None)


def changed_files(index: dict, identities: list[dict]) -> list[tuple[str, str, Any, Any]]:
    """``(path, key, index value, now)`` for every identity field that differs from the index."""
    out = []
    for entry, now in zip(index["files"], identities):
        saved = identity_of(entry)
        for key in sorted(set(saved) | set(now)):
            if key in ("footer", "layout") and key not in now:
                continue          # not re-read (remote file, no extra request): the ETag / size vouch for it
            if unreported_validator(key, saved, now):
                continue
            if saved.get(key) != now.get(key):
                out.append((entry["path"], key, saved.get(key), now.get(key)))
    return out


def describe_changes(changes: list[tuple[str, str, Any, Any]]) -> str:
    lines = [f"  file modified: {p} ({k}): index {a!r}, now {b!r}" for p, k, a, b in changes[:12]]
    if len(changes) > 12:
        lines.append(f"  ... and {len(changes) - 12} more")
    return "\n".join(lines)


def map_files(fn: Callable[[Any], Any], items: list, progress: Callable[[], None] | None = None) -> list:
    """``fn`` over ``items`` on up to 16 threads (network-bound), in order; ``progress()`` after each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(x):
        r = fn(x)
        if progress is not None:
            progress()
        return r

    if len(items) <= 1:
        return [one(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(one, items))
