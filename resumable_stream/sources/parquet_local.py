"""Local parquet files opened without importing ``datasets`` (~0.45 s of CPU, ~60 MiB), exactly as it would.

For ``dataset_name_or_path: parquet`` with local ``data_files`` all ``datasets`` does is list the files and infer
the features from the first file's schema; this module does those steps with its rules and says None for
anything else (then ``datasets`` does it): :func:`resolve_local_parquet` (``data_files`` patterns as the
packaged builder resolves them; None for a builder config, ``data_dir``, ``revision``, ``storage_options``, a
``:`` in a pattern, no match), :func:`simple_features` / :func:`simple_schema` (plain columns only) and
:func:`cast_like_datasets` (``table_cast`` when no value needs a cast). ``tests/sources/test_local_parquet.py``
compares each with ``datasets`` on the same inputs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePath
from typing import Any

import pyarrow as pa

from ..config.specs import DataSpec

# datasets.data_files.FILES_TO_IGNORE
FILES_TO_IGNORE = ("README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip",
                   "dataset_dict.json")
# datasets.data_files.SANITIZED_DEFAULT_SPLIT
DEFAULT_SPLIT = "train"

# Arrow types whose datasets feature is Value(dtype) and back the same type (datasets' _arrow_to_datasets_dtype)
_SIMPLE_TYPES: dict[pa.DataType, str] = {
    pa.bool_(): "bool", pa.int8(): "int8", pa.int16(): "int16", pa.int32(): "int32", pa.int64(): "int64",
    pa.uint8(): "uint8", pa.uint16(): "uint16", pa.uint32(): "uint32", pa.uint64(): "uint64",
    pa.float16(): "float16", pa.float32(): "float32", pa.float64(): "float64",
    pa.string(): "string", pa.large_string(): "large_string", pa.binary(): "binary",
    pa.large_binary(): "large_binary",
}
_DTYPES = {dtype: t for t, dtype in _SIMPLE_TYPES.items()}


# ------------------------------------------------------------------------------ files
def _split_patterns(data_files: Any) -> dict[str, list[str]] | None:
    """datasets' ``sanitize_patterns`` for the forms we reproduce (a string, a list of strings, a dict of
    split -> string or list of strings); None for others."""
    if isinstance(data_files, str):
        splits = {DEFAULT_SPLIT: [data_files]}
    elif isinstance(data_files, (list, tuple)):
        splits = {DEFAULT_SPLIT: list(data_files)}
    elif isinstance(data_files, dict):
        splits = {str(k): v if isinstance(v, list) else [v] for k, v in data_files.items()}
    else:
        return None
    for patterns in splits.values():
        if not patterns or not all(isinstance(p, str) and p and ":" not in p and not p.startswith("//")
                                   for p in patterns):
            return None
    return splits


def _hidden_parts(path: str) -> int:
    return sum(1 for part in PurePath(path).parts if _is_hidden(part))


def _special_dirs(path: str) -> int:
    return sum(1 for part in PurePath(path).parent.parts if part.startswith("__"))


def _is_hidden(part: str) -> bool:
    return part.startswith(".") and set(part) != {"."}


def _name_regex(part: str) -> re.Pattern:
    """fsspec's glob translation of one path component made of literals, ``*`` and ``?``: ``*`` alone is one or
    more characters, elsewhere (consecutive ones as one) any number, ``?`` one; never a ``/``."""
    if part == "*":
        return re.compile(r"(?s:[^/]+)\Z")
    out: list[str] = []
    for c in part:
        if c == "*":
            if not out or out[-1] != "[^/]*":
                out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(c))
    return re.compile(r"(?s:" + "".join(out) + r")\Z")


def _scanned(pattern: str) -> list[str] | None:
    """What fsspec's glob and datasets' filters make of an absolute, normalized ``pattern`` whose wildcards
    (``*``, ``?``) are all in its last component, read with one ``os.scandir`` (importing fsspec costs more than
    the whole listing); None for any other pattern, or when the directory cannot be listed."""
    if not pattern.startswith("/") or os.path.normpath(pattern) != pattern or "[" in pattern or "**" in pattern:
        return None
    directory, name = os.path.split(pattern)
    if "*" in directory or "?" in directory:
        return None
    if "*" not in name and "?" not in name:
        return [pattern] if os.path.isfile(pattern) else None      # a missing one: datasets' error
    regex = _name_regex(name)
    ignored = set(FILES_TO_IGNORE) - {name}
    try:
        with os.scandir(directory) as entries:
            found = [(e.name, e.is_file(follow_symlinks=False) or (
                e.is_symlink() and os.path.isfile(os.path.realpath(e.path)))) for e in entries]
    except OSError:
        return None
    return sorted(os.path.join(directory, n) for n, is_file in found
                  if is_file and regex.match(n) and n not in ignored and _is_hidden(n) == _is_hidden(name))


def _resolve_pattern(pattern: str, base_path: str) -> list[str]:
    """datasets.data_files.resolve_pattern for a local pattern (no protocol, no ``::``)."""
    if not os.path.isabs(pattern):
        pattern = os.path.join(base_path, pattern)
    scanned = _scanned(pattern)
    if scanned is not None:
        return scanned
    from fsspec.core import url_to_fs

    fs, fs_pattern = url_to_fs(pattern)
    ignored = set(FILES_TO_IGNORE) - {os.path.basename(Path(pattern).as_posix())}
    out = []
    for filepath, info in fs.glob(fs_pattern, detail=True).items():
        if not (info["type"] == "file" or (info.get("islink") and os.path.isfile(os.path.realpath(filepath)))):
            continue
        if os.path.basename(Path(filepath).as_posix()) in ignored:
            continue
        if _special_dirs(filepath) != _special_dirs(fs_pattern):
            continue
        if _hidden_parts(filepath) != _hidden_parts(fs_pattern):
            continue
        out.append(filepath)
    return out


def resolve_local_parquet(data: DataSpec, path: str, data_files: Any, builders: tuple[str, ...] = ("parquet",),
                          storage_options: dict | None = None) -> list[str] | None:
    """The files of ``data.split`` when ``path`` / ``data_files`` (``builder_args(data)``) name local parquet
    files for datasets' packaged parquet builder, as it resolves them; None when out of scope (module doc).
    ``builders``: the builder names resolved so (the registered formats': datasets' rules for data_files
    patterns do not depend on the builder); ``storage_options``: the user's (``datasets`` resolves then)."""
    if (path not in builders or data.name is not None or data.data_dir is not None or data.revision is not None
            or storage_options or data.backend != "hf" or not data.streaming or data_files is None):
        return None
    splits = _split_patterns(data_files)
    if splits is None or data.split not in splits:
        return None
    base_path = Path("").expanduser().resolve().as_posix()
    resolved: dict[str, list[str]] = {}
    for split, patterns in splits.items():
        files: list[str] = []
        for pattern in patterns:
            try:
                found = _resolve_pattern(pattern, base_path)
            except Exception:          # datasets says what is wrong (and how), as before
                return None
            if not found:              # datasets raises or skips it: either way, its answer
                return None
            files.extend(found)
        resolved[split] = files
    return resolved[data.split]


# ------------------------------------------------------------------------------ features
def simple_features(schema: pa.Schema) -> dict[str, dict] | None:
    """``datasets.Features.from_arrow_schema(schema).to_dict()`` when every column is a plain one; None otherwise
    (nested or other types, or the schema carries datasets' own metadata)."""
    if schema.metadata and b"huggingface" in schema.metadata:
        return None
    out = {}
    for f in schema:
        dtype = _SIMPLE_TYPES.get(f.type)
        if dtype is None or f.name in out:
            return None
        out[f.name] = {"dtype": dtype, "_type": "Value"}
    return out


def simple_schema(features: dict) -> pa.Schema | None:
    """``datasets.Features.from_dict(features).arrow_schema`` for features made of plain Values; None otherwise."""
    fields = []
    for name, feature in features.items():
        if not (isinstance(feature, dict) and feature.keys() == {"dtype", "_type"} and feature["_type"] == "Value"
                and feature["dtype"] in _DTYPES):
            return None
        fields.append(pa.field(name, _DTYPES[feature["dtype"]]))
    meta = json.dumps({"info": {"features": {n: {"dtype": f["dtype"], "_type": "Value"}
                                             for n, f in features.items()}}})
    return pa.schema(fields).with_metadata({"huggingface": meta})


def cast_like_datasets(table: pa.Table, schema: pa.Schema) -> pa.Table | None:
    """``datasets.table.table_cast(table, schema)`` when no value needs a cast: the table's columns are the
    schema's fields (names, types, nullability), in this or another order. None when a cast is needed."""
    if table.schema == schema:                 # pyarrow compares without metadata, as table_cast does
        return table if table.schema.metadata == schema.metadata else table.replace_schema_metadata(schema.metadata)
    if len(table.schema) != len(schema) or sorted(table.column_names) != sorted(schema.names) \
            or len(set(schema.names)) != len(schema):
        return None
    if any(table.schema.field(f.name) != f for f in schema):
        return None
    # cast_table_to_schema: the columns in the schema's order, each unchanged (its type is the target's)
    return pa.Table.from_arrays([table.column(f.name) for f in schema], schema=schema)
