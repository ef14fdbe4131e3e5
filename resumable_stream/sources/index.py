"""The dataset index: what a job needs to read an indexed dataset without resolving it again (the config that
resolved it, the features, the format that reads it, and per file its identity and layout). Built once per job
(``resolve.build_index``), shared between ranks and saved with the checkpoints, so that no rank resolves the
dataset or reads a footer at a restart.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..config.formats import INDEX_READER_KEY, format_of_index
from ..config.specs import DataSpec
from ..errors import ConfigError, SourceError, StreamMismatchError
from ..io.safe_files import FileRefused, JSONRefused, atomic_write, parse_json, read_regular_file
from ..limits import MAX_INDEX_BYTES, is_int
from .index_table import (
    MAX_PATH_BYTES,
    FileTable,
    IndexTableError,
    is_packed,
    json_default,
    pack_index,
    unpack_index,
)
from .parquet_footer import PARQUET_LAYOUT_KEYS

INDEX_FORMAT = "resumable-stream-index"
INDEX_VERSION = 1


def resolution_key(data: DataSpec) -> dict[str, Any]:
    """The config keys that decide which files an index lists: an index is only used for these."""
    key = {"dataset_name_or_path": data.dataset_name_or_path, "name": data.name,
           "data_files": data.data_files, "split": data.split}
    for name in ("revision", "data_dir"):     # only when set: indexes saved before the keys still match
        if getattr(data, name) is not None:
            key[name] = getattr(data, name)
    return key


def make_index(data: DataSpec, builder: str, reader: str, features, files: list[dict]) -> dict[str, Any]:
    """``reader``: the registered format that reads the files; ``features``: a ``datasets.Features`` (a dict
    too) or its ``to_dict()``."""
    return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "resolution": resolution_key(data),
            "builder": builder, INDEX_READER_KEY: reader, "features": features.to_dict() if hasattr(features, "to_dict") else features,
            "files": files}


def identity_of(entry: dict, layout_keys: tuple[str, ...] = PARQUET_LAYOUT_KEYS) -> dict[str, Any]:
    """The identity part of an index entry (what the stream fingerprint lists per file): all but the layout
    keys of its format (``IndexedReader.layout_keys``)."""
    return {k: v for k, v in entry.items() if k not in layout_keys}


# ------------------------------------------------------------------------------ files
_FILES_HERE = "\0files of the table\0"     # a string no index holds (its JSON escapes the NULs)


def encode_index(index: dict) -> bytes:
    """The JSON form of ``index`` (its files as a list, however they are held)."""
    files = index.get("files")
    if not isinstance(files, FileTable):
        return json.dumps(index, sort_keys=True, separators=(",", ":"), default=json_default).encode()
    # the files' JSON made from the table's arrays, put in their place
    text = json.dumps({**index, "files": _FILES_HERE}, sort_keys=True, separators=(",", ":"))
    return text.replace(json.dumps(_FILES_HERE), files.json_text(), 1).encode()


def compact_index(index: dict) -> dict[str, Any]:
    """``index`` with its files columnar (:class:`FileTable`) when its format's entries fit one (parquet); else
    ``index`` itself. The same entries either way: only the memory they take changes."""
    files = index.get("files")
    if not isinstance(files, list) or index.get(INDEX_READER_KEY) != "parquet":
        return index
    table = FileTable.from_entries(files)
    return index if table is None else {**index, "files": table}


def encode_message(index: dict) -> bytes:
    """``index`` as one binary message (``index_table.pack_index``) when its files are columnar, else its JSON
    form: what rank 0 broadcasts."""
    index = compact_index(index)
    return pack_index(index) if isinstance(index["files"], FileTable) else encode_index(index)


def decode_index(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check the shape of an index, in its JSON form or a binary message (:func:`encode_message`); a
    malformed one is a SourceError naming ``where``. A parquet index comes back columnar (``compact_index``)."""
    try:
        if is_packed(data):
            index = unpack_index(data, parse_json)      # every length, offset and span checked there
            reader = index.get(INDEX_READER_KEY)
            problem = (_shape_problem({**index, "files": [index["files"][0]]}) if reader == "parquet" else
                       f"a packed index of format {reader!r:.40}; allowed: parquet")
        else:
            index = parse_json(data)
            problem = _shape_problem(index)
    except (JSONRefused, IndexTableError) as e:
        raise SourceError(f"dataset index {where}: {e}") from None
    if problem:
        raise SourceError(f"dataset index {where}: {problem}")
    return compact_index(index)


def _shape_problem(index: Any) -> str | None:
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return f"not a {INDEX_FORMAT} file"
    version = index.get("version")
    if type(version) is not int or version != INDEX_VERSION:   # True and 1.0 are no version
        return f"version {version!r:.40}; this library reads version {INDEX_VERSION}"
    if not isinstance(index.get(INDEX_READER_KEY), str):
        return f"missing {INDEX_READER_KEY!r} (the name of the format that reads the files)"
    if not isinstance(index.get("resolution"), dict) or not isinstance(index.get("features"), dict):
        return "missing 'resolution' or 'features'"
    files = index.get("files")
    if not isinstance(files, list) or not files:
        return "'files' is not a non-empty list"
    try:
        reader = format_of_index(index).load()
    except ConfigError as e:       # a format this process has not registered
        return str(e)
    for i, f in enumerate(files):
        if not (isinstance(f, dict) and isinstance(f.get("path"), str) and is_int(f.get("size"))):
            return f"files[{i}] is malformed (no path and size)"
        if not 0 < len(f["path"].encode("utf-8", "surrogatepass")) <= MAX_PATH_BYTES or "\0" in f["path"]:
            return f"files[{i}] has path {f['path']!r:.80}; allowed: 1 to {MAX_PATH_BYTES} bytes, no NUL"
        problem = reader.entry_problem(f)      # the format's layout (parquet: footer and row groups)
        if problem:
            return f"files[{i}] is {problem}"
    return None


def save_index(path: str, index: dict) -> str:
    """Write ``index`` to ``path`` atomically (a reader sees the old file or the new one)."""
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


def same_resolution(index: dict, data: DataSpec) -> bool:
    return index["resolution"] == resolution_key(data)


def check_resolution(index: dict, data: DataSpec, where: str) -> None:
    """An index made for other data settings is an error naming the keys that differ."""
    now = resolution_key(data)
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
    reader = format_of_index(index).load()
    out = []
    for entry, now in zip(index["files"], identities):
        saved = identity_of(entry, reader.layout_keys)
        for key in sorted(set(saved) | set(now)):
            if key in reader.content_keys and key not in now:
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


