"""The registry of the formats we index and read ourselves; everything else goes to ``datasets``' readers.

An entry names how a format is recognised (builder names, extensions) and its
:class:`~resumable_stream.sources.base.IndexedReader` (a module path imported on first use, so that this
module imports nothing heavy). A new format is one module plus one :func:`register` call; see
docs/internals.md, "How to add a source"."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, shown

# The index key that names the format that reads it.
INDEX_READER_KEY = "reader"

# Single files ``datasets``' packaged builders read (not indexed by us), by extension.
DATASETS_EXTENSIONS = {
    ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
    ".csv": "csv", ".tsv": "csv", ".txt": "text", ".arrow": "arrow",
}
DATASETS_BUILDERS = tuple(dict.fromkeys(DATASETS_EXTENSIONS.values()))


@dataclass(frozen=True)
class SourceFormat:
    """One registry entry. ``reader``: ``"package.module:attribute"`` or the reader object."""

    name: str                          # what the index says it is ("reader": name)
    builders: tuple[str, ...]          # datasets' builder names whose resolved files it reads
    extensions: tuple[str, ...]        # a single file ending so is one of its files
    reader: Any = field(repr=False, default=None)

    def load(self) -> Any:
        """The reader (imported on first use)."""
        if not isinstance(self.reader, str):
            return self.reader
        module, _, attr = self.reader.partition(":")
        return getattr(importlib.import_module(module), attr)


_BUILTIN = (
    SourceFormat("parquet", ("parquet",), (".parquet",), "resumable_stream.sources.parquet:READER"),
    SourceFormat("webdataset", ("webdataset",), (".tar",), "resumable_stream.sources.webdataset:READER"),
    SourceFormat("jsonl", ("json",), (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst"),
                 "resumable_stream.sources.jsonl:READER"),
)

_lock = threading.Lock()
_formats: dict[str, SourceFormat] = {f.name: f for f in _BUILTIN}


def register(fmt: SourceFormat) -> SourceFormat:
    """Add ``fmt`` (a ConfigError if its name, a builder or an extension is already another format's)."""
    with _lock:
        for other in _formats.values():
            if other.name == fmt.name:
                raise ConfigError(f"source format {shown(fmt.name)}: already registered")
            clash = set(other.builders) & set(fmt.builders) or set(other.extensions) & set(fmt.extensions)
            if clash:
                raise ConfigError(f"source format {shown(fmt.name)}: {', '.join(sorted(clash))} already belongs to "
                                  f"format {shown(other.name)}")
        _formats[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format added by :func:`register` (the built-in ones stay)."""
    with _lock:
        if any(f.name == name for f in _BUILTIN):
            raise ConfigError(f"source format {shown(name)}: built in, cannot be removed")
        _formats.pop(name, None)


def formats() -> list[SourceFormat]:
    with _lock:
        return list(_formats.values())


def names() -> list[str]:
    return sorted(f.name for f in formats())


def format_named(name: Any) -> SourceFormat:
    """The format called ``name``; a ConfigError listing the registered ones otherwise."""
    for f in formats():
        if f.name == name:
            return f
    raise ConfigError(f"source format {shown(name)}: not registered; registered formats: {', '.join(names())}")


def format_of_index(index: dict) -> SourceFormat:
    """The format an index says it is (``reader``)."""
    reader = index.get(INDEX_READER_KEY)
    if not isinstance(reader, str):
        raise ConfigError(f"dataset index: {INDEX_READER_KEY!r} got {shown(reader)}; allowed: the name of the "
                          f"registered format that reads its files ({', '.join(names())})")
    return format_named(reader)


def format_for_builder(builder: str | None) -> SourceFormat | None:
    """The registered format that reads the files of ``datasets``' builder ``builder`` (None: datasets does)."""
    return next((f for f in formats() if builder in f.builders), None)


def indexed_builders() -> tuple[str, ...]:
    return tuple(b for f in formats() for b in f.builders)


def extensions() -> dict[str, str]:
    """File extension -> the builder that reads such a file: registered formats' and datasets' own."""
    out = dict(DATASETS_EXTENSIONS)
    for f in formats():
        out.update((ext, f.builders[0]) for ext in f.extensions if f.builders)
    return out


def builder_for_path(path: str) -> str | None:
    """The builder for a single file path / URL, by extension (None if not a known file type)."""
    low = path.lower().split("?", 1)[0]
    known = extensions()
    for ext in sorted(known, key=len, reverse=True):
        if low.endswith(ext):
            return known[ext]
    return None
