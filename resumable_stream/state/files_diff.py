"""Which data files of a saved fingerprint differ from this run's, each named (removed, added, resized, modified,
the order; after a move, by content). Equal digests of compact lists are the same files; else only the files
whose identity columns differ (found with numpy) are made into dicts and compared."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sources import fingerprint_files
from ..sources.index import unreported_validator
from .relocation import is_relocation, relocated_files_diff, relocation_note

Diff = tuple[str, Any, Any]


@dataclass(frozen=True)
class FilesCompared:
    """``diffs``: the files that differ, named; ``moved``: the note of a relocation (``relocation.announce``);
    ``named``: False when the identities of a side are not at hand (the one diff is then the two values)."""

    diffs: list[Diff]
    moved: tuple | None = None
    named: bool = True


# (saved digest, now digest) -> their comparison: a resume compares the same two file sets more than once
# (reading the state, then loading it), and a digest is the files it stands for
_compared: dict[tuple[str, str], FilesCompared] = {}
_COMPARED_MAX = 8


def is_files(value: Any) -> bool:
    return isinstance(value, list) or fingerprint_files.is_compact(value)


def compare_files(saved: Any, now: Any) -> FilesCompared | None:
    """The files of two fingerprints compared (None when one of the values is neither form of files)."""
    if isinstance(saved, list) and isinstance(now, list):
        return _compare_lists(saved, now)           # as it always was
    if not (is_files(saved) and is_files(now)):
        return None
    if fingerprint_files.is_compact(saved):
        columns_a, digest_a = None, saved["digest"]
    else:        # a list written before: its columns (None: a shape a table does not hold), their digest
        columns_a = fingerprint_files.columns(saved)
        digest_a = None if columns_a is None else fingerprint_files.columns_digest(columns_a)
    digest_b = fingerprint_files.digest(now)
    if digest_a is not None and digest_a == digest_b:
        return FilesCompared([])
    key = (digest_a, digest_b) if digest_a is not None and digest_b is not None else None
    if key in _compared:
        return _compared[key]
    a, b = fingerprint_files.identities(saved), fingerprint_files.identities(now)
    if a is None or b is None:
        return FilesCompared([("files", saved, now)], named=False)
    rows = _differing_rows(columns_a if columns_a is not None else fingerprint_files.columns(a),
                           fingerprint_files.columns(b))
    result = _compare_lists(list(a), list(b)) if rows is None else \
        FilesCompared(_files_diff([a[i] for i in rows], [b[i] for i in rows]))
    if key is not None:
        if len(_compared) >= _COMPARED_MAX:
            _compared.pop(next(iter(_compared)))
        _compared[key] = result
    return result


def _compare_lists(saved: Sequence[dict], now: Sequence[dict]) -> FilesCompared:
    if is_relocation(saved, now):
        return FilesCompared(relocated_files_diff(saved, now), relocation_note(saved, now))
    return FilesCompared(_files_diff(saved, now))


def _files_diff(saved: Sequence[dict], now: Sequence[dict]) -> list[Diff]:
    old = {f["path"]: f for f in saved}
    new = {f["path"]: f for f in now}
    out = []
    for path in sorted(set(old) - set(new)):
        out.append((f"file removed: {path}", old[path], None))
    for path in sorted(set(new) - set(old)):
        out.append((f"file added: {path}", None, new[path]))
    for path in sorted(set(old) & set(new)):
        a, b = old[path], new[path]
        for key in sorted(set(a) | set(b)):
            if key != "path" and a.get(key) != b.get(key) and not unreported_validator(key, a, b):
                what = "resized" if key == "size" else "modified"
                out.append((f"file {what}: {path} ({key})", a.get(key), b.get(key)))
    if not out and [f["path"] for f in saved] != [f["path"] for f in now]:
        out.append(("file order", [f["path"] for f in saved], [f["path"] for f in now]))
    return out


def _differing_rows(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray] | None) -> list[int] | None:
    """The files whose identity columns differ, when both sides have columns and list the same paths in the
    same order (None otherwise: compared entry by entry). Every file whose identity differs is among them."""
    if a is None or b is None or len(a["size"]) != len(b["size"]):
        return None
    if not (np.array_equal(a["path_offsets"].astype(np.int64), b["path_offsets"].astype(np.int64))
            and np.array_equal(a["paths"], b["paths"])):
        return None
    mtime_a, mtime_b = a["mtime"], b["mtime"]
    differ = (a["size"] != b["size"]) | ~((mtime_a == mtime_b) | (np.isnan(mtime_a) & np.isnan(mtime_b)))
    differ |= (a["footer"].reshape(-1, 16) != b["footer"].reshape(-1, 16)).any(axis=1)
    differ |= _blobs_differ(a["extra_offsets"], a["extras"], b["extra_offsets"], b["extras"])
    return np.flatnonzero(differ).tolist()


def _blobs_differ(offsets_a: np.ndarray, blob_a: np.ndarray, offsets_b: np.ndarray, blob_b: np.ndarray) -> np.ndarray:
    """Per row, whether its bytes in two (offsets, blob) string tables differ."""
    offsets_a, offsets_b = offsets_a.astype(np.int64), offsets_b.astype(np.int64)
    len_a, len_b = np.diff(offsets_a), np.diff(offsets_b)
    differ = len_a != len_b
    same = np.flatnonzero(~differ & (len_a > 0))
    if len(same):
        lengths = len_a[same]
        unequal = blob_a[_spans(offsets_a[same], lengths)] != blob_b[_spans(offsets_b[same], lengths)]
        if unequal.any():
            rows = np.searchsorted(np.cumsum(lengths), np.flatnonzero(unequal), side="right")
            differ[same[np.unique(rows)]] = True
    return differ


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] .. starts[i] + lengths[i] - 1`` of every row, one after the other."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))
