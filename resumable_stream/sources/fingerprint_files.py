"""A source's fingerprint (:func:`dataset_fingerprint`, every reader's made here), its files held compactly as
``{"count": n, "digest": d}``: compared by digest, listed (:func:`identities`) only when they differ
(docs/scale.md, docs/internals.md#small-state-at-scale).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import struct
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..config.specs import SourceSpec
from ..io.hub import hub_commits
from ..plan import RowCounts, shard_rows
from .index_table import IDENTITY_ARRAYS, FileTable, identity_arrays

KEYS = ("count", "digest")
_PERSON = b"rs-files-1"      # the digest of this column layout (another layout: another person, never equal)

# (table, {count: digest}) of the tables this process made compact fingerprints of, held weakly
_known: list[tuple[weakref.ref, dict[int, str]]] = []
# loaders of the indexes of the checkpoints being read (innermost last), each decoded when first needed
_saved: list[Callable[[], list[tuple[FileTable, dict[int, str]]]]] = []


class TableIdentities(Sequence):
    """The identities of a table's first ``count`` files, as the dicts a fingerprint listed (made on demand)."""

    def __init__(self, table: FileTable, count: int):
        self.table, self.count = table, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if not -self.count <= i < self.count:
            raise IndexError(f"file {i} of {self.count}")
        return self.table.identity(i % self.count)

    def __iter__(self) -> Iterator[dict]:
        return (self.table.identity(i) for i in range(self.count))

    def columns(self) -> dict[str, np.ndarray]:
        return self.table.identity_arrays(self.count)


def is_compact(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == set(KEYS) and type(value["count"]) is int
            and value["count"] >= 0 and isinstance(value["digest"], str) and len(value["digest"]) == 32)


def compact(table: FileTable, count: int | None = None) -> dict[str, Any]:
    """``{"count", "digest"}`` of the identities of ``table``'s first ``count`` files (all by default); the
    table is remembered (weakly) so that they can be listed when a comparison needs them."""
    n = len(table) if count is None else count
    digests = next((d for ref, d in _known if ref() is table), None)
    if digests is None:
        _known[:] = [(r, d) for r, d in _known if r() is not None]
        digests = {}
        _known.append((weakref.ref(table), digests))
    if n not in digests:
        digests[n] = columns_digest(table.identity_arrays(n))
    return {"count": n, "digest": digests[n]}


def columns_digest(columns: dict[str, np.ndarray]) -> str:
    """The blake2b (16 bytes, hex) of identity columns: each column's name, length and bytes in a canonical
    form (offsets as int64, every NaN mtime the same NaN)."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for name in IDENTITY_ARRAYS:
        a = columns[name]
        if name.endswith("offsets"):
            a = a.astype("<i8")
        elif name == "mtime":
            a = np.where(np.isnan(a), np.nan, a).astype("<f8")
        data = np.ascontiguousarray(a).tobytes()
        h.update(name.encode() + struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest()


def columns(value: Any) -> dict[str, np.ndarray] | None:
    """The identity columns of a fingerprint's files: a list of identities (None when one has a shape a table
    does not hold), the identities of a table, or a compact value whose table is at hand (else None)."""
    if isinstance(value, TableIdentities):
        return value.columns()
    if isinstance(value, list):
        return identity_arrays(value, layout=False)
    listed = identities(value) if is_compact(value) else None
    return None if listed is None else listed.columns()


def digest(value: Any) -> str | None:
    """The digest of a fingerprint's files (see :func:`columns_digest`), None when it has none."""
    if is_compact(value):
        return value["digest"]
    found = columns(value)
    return None if found is None else columns_digest(found)


def identities(value: Any) -> Sequence[dict] | None:
    """The files a fingerprint's ``files`` stands for: a list as it is; a compact value's from a table that
    this process holds or the checkpoint being read saved (None when neither has them)."""
    if not is_compact(value):
        return value if isinstance(value, (list, TableIdentities)) else None
    n, want = value["count"], value["digest"]
    for table, digests in _tables():
        if len(table) >= n:
            if n not in digests:
                digests[n] = columns_digest(table.identity_arrays(n))
            if digests[n] == want:
                return TableIdentities(table, n)
    return None


def _tables() -> Iterator[tuple[FileTable, dict[int, str]]]:
    """The tables this process holds, then those of the checkpoints being read (decoded when first asked)."""
    for ref, digests in list(_known):
        table = ref()
        if table is not None:
            yield table, digests
    for tables in reversed(_saved):
        yield from tables()


@contextlib.contextmanager
def saved_indexes(load: Callable[[], list[FileTable]] | None):
    """While a checkpoint is read: ``load()`` gives the file tables of the indexes it saved, called (once) when a
    compact fingerprint's files are not those of a table this process holds; they are let go after."""
    if load is None:
        yield
        return
    lazy = functools.cache(lambda: [(t, {}) for t in load()])      # decoded once, when first asked
    _saved.append(lazy)
    try:
        yield
    finally:
        _saved.remove(lazy)      # this one (another thread may have read a checkpoint meanwhile)


def expanded(fingerprint: Any) -> Any:
    """``fingerprint`` with every compact ``files`` whose identities are at hand listed as before (a
    self-contained sidecar file carries them)."""
    if not isinstance(fingerprint, dict):
        return fingerprint
    out = {}
    for key, value in fingerprint.items():
        listed = identities(value) if key == "files" and is_compact(value) else None
        out[key] = list(listed) if listed is not None else expanded(value)
    return out


def dataset_fingerprint(spec: SourceSpec, builder: str | None, identities: list[dict] | FileTable,
                        shards: list | None = None, **extra: Any) -> dict:
    """What determines a source's content, the one place it is made: the keys naming the data, the builder, every
    file's identity (a table's: :func:`compact`) and Hub commit, the shard and row counts; ``extra``: a reader's."""
    data = spec.data
    local = data.backend == "local"     # a save_to_disk directory: no builder config, never streamed
    fp: dict[str, Any] = {"dataset": data.dataset_name_or_path, "name": None if local else data.name,
                          "split": data.split, "backend": data.backend, "streaming": False if local else data.streaming}
    if builder is not None:
        fp["builder"] = builder
    table = isinstance(identities, FileTable)
    fp["files"] = compact(identities) if table else identities
    if not local:
        # the Hub commits the files come from (a new commit is then a mismatch naming it); a table's paths are
        # made only when some may be Hub files (a million paths are ~100 MB of str)
        hub = b"hf://datasets/" in identities.arrays()["paths"].tobytes() if table else True
        commits = hub_commits((identities.paths() if table else [i["path"] for i in identities]) if hub else [])
        if commits:
            fp["hub_commits"] = commits
        if data.data_dir is not None:       # only when set: fingerprints saved before the key still match
            fp["data_dir"] = data.data_dir
    if shards is not None:
        fp["num_shards"] = len(shards)
        fp["shard_rows"] = _rows_digest(shard_rows(shards))
    fp.update(extra)
    return fp


def _digest(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


def _rows_digest(rows) -> str:
    """``_digest(list(rows))``; an array of counts (a parquet index's row groups: millions) hashed in chunks, so
    that neither the list nor its JSON is ever whole in memory."""
    if not isinstance(rows, RowCounts):
        return _digest(list(rows))
    h = hashlib.blake2b(digest_size=16)
    h.update(b"[")
    step = 1 << 16
    for lo in range(0, len(rows.array), step):
        h.update((", " if lo else "").encode() + ", ".join(map(str, rows.array[lo:lo + step].tolist())).encode())
    h.update(b"]")
    return h.hexdigest()
