"""Which data files of a saved fingerprint differ from this run's, each named (removed, added, resized, modified,
the order), and relocated data: the same files under another root, compared by relative path, size and content
identity (docs/relocating-data.md). Equal digests of compact lists are the same files; else only the files whose
identity columns differ (found with numpy) are made into dicts and compared."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sources import fingerprint_files
from ..sources.index import unreported_validator

log = logging.getLogger(__name__)

# A single-part S3 upload's ETag: the MD5 of the content ('"<32 hex>"'); a multipart one ends in "-<parts>".
_MD5_ETAG = re.compile(r'^"?[0-9a-f]{32}"?$')


def dataset_root(paths: list[str]) -> str:
    """The deepest directory (or URL prefix) that holds every path: what the relative paths are relative to."""
    return "/".join(os.path.commonprefix([p.rstrip("/").split("/")[:-1] for p in paths]))   # by component


def relative_paths(paths: list[str]) -> list[str]:
    root = dataset_root(paths)
    return [p[len(root):].lstrip("/") if root else p for p in paths]


def content_identity(entry: dict[str, Any]) -> dict[str, Any]:
    """The fields of a file identity that hold wherever the same bytes are stored."""
    out = {"size": entry.get("size"), **{k: entry[k] for k in ("footer", "sha256") if entry.get(k) is not None}}
    etag = entry.get("etag")
    if entry.get("path", "").startswith("s3://") and isinstance(etag, str) and _MD5_ETAG.match(etag):
        out["md5"] = etag.strip('"')
    return out


def identity_kind(entry: dict[str, Any]) -> str:
    """What vouches for a file's content beyond its size (shown by ``resumable-stream inspect``)."""
    content = content_identity(entry)
    kinds = [name for key, name in (("footer", "parquet footer digest"), ("sha256", "LFS sha256"),
                                    ("md5", "S3 ETag (MD5)")) if key in content]
    if kinds:
        return " + ".join(kinds)
    markers = [k for k in ("etag", "mtime", "last-modified", "blob_id") if entry.get(k) is not None]
    return ("size + " + " + ".join(markers) + " (not comparable after a move)") if markers else "size only"


def is_relocation(saved: list[dict], now: list[dict]) -> bool:
    """The same relative paths, in the same order, under another root."""
    old, new = [f.get("path", "") for f in saved], [f.get("path", "") for f in now]
    return (len(old) == len(new) > 0 and old != new and dataset_root(old) != dataset_root(new)
            and relative_paths(old) == relative_paths(new))


def relocated_files_diff(saved: list[dict], now: list[dict]) -> list[tuple[str, Any, Any]]:
    """Differences between the files of a relocated dataset: per file (named by its new path), every field
    of its content identity that both places know and that differs."""
    out = []
    for a, b in zip(saved, now):
        ca, cb = content_identity(a), content_identity(b)
        for key in sorted(set(ca) & set(cb)):
            if ca[key] != cb[key]:
                what = "resized" if key == "size" else "modified"
                out.append((f"file {what}: {b['path']} ({key}; was {a['path']})", ca[key], cb[key]))
    return out


def describe_files(files: Any, full: bool) -> dict[str, Any]:
    """The identities of a fingerprint's files for ``inspect``: the root, files per kind of identity, with ``full``
    every file (compact lists from their index; without it, their count and digest)."""
    compact = fingerprint_files.is_compact(files)
    key = (files["count"], files["digest"], full) if compact else None
    if key in _described:            # inspect describes the same files for every rank
        return _described[key]
    listed = fingerprint_files.identities(files)
    if listed is None and compact:
        return {**files, "identity": "not listed: the dataset index they stand for is not at hand"}
    out = _describe_listed(list(listed or []), full)
    if key is not None:
        _described.clear()
        _described[key] = out
    return out


_described: dict[tuple, dict[str, Any]] = {}


def _describe_listed(files: list[dict], full: bool) -> dict[str, Any]:
    paths = [f.get("path", "") for f in files]
    kinds = dict(Counter(identity_kind(f) for f in files))
    out: dict[str, Any] = {"root": dataset_root(paths), "count": len(files), "identity": kinds}
    if full:
        out["files"] = [{"relative_path": rel, "size": f.get("size"), "identity": identity_kind(f),
                         **{k: v for k, v in f.items() if k not in ("path", "size")}}
                        for rel, f in zip(relative_paths(paths), files)]
    return out


_announced: set[tuple[str, str]] = set()


def relocation_note(saved: Sequence[dict], now: Sequence[dict]) -> tuple[str, str, int, list[str]]:
    """(old root, new root, files, those only their size vouches for) of a move: what :func:`announce` logs."""
    weak = [b["path"] for a, b in zip(saved, now) if set(content_identity(a)) & set(content_identity(b)) == {"size"}]
    return dataset_root([f["path"] for f in saved]), dataset_root([f["path"] for f in now]), len(now), weak


def announce(note: tuple[str, str, int, list[str]]) -> None:
    """Log a move (once per process), and which files only their size vouches for."""
    old_root, new_root, count, weak = note
    if (old_root, new_root) in _announced:
        return
    _announced.add((old_root, new_root))
    log.info("data relocated: %s -> %s (%d files, compared by relative path, size and content identity)",
             old_root, new_root, count)
    if weak:
        shown = ", ".join(weak[:3]) + (f" and {len(weak) - 3} more" if len(weak) > 3 else "")
        log.warning("data relocated from %s to %s: %d file(s) have no content identity comparable across "
                    "the move (no parquet footer digest, LFS sha256 or S3 MD5 ETag): only their size is "
                    "checked, a same-size edit is caught only if it changes the next sample: %s",
                    old_root, new_root, len(weak), shown)


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
