"""A parquet dataset index's files, columnar (:class:`FileTable`: a read-only sequence of the JSON form's dicts,
~12 bytes per row group), and its binary message (:func:`pack_index`, checked by :func:`unpack_index`):
docs/scale.md.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..limits import MAX_INT64
from .parquet_footer import PARQUET_LAYOUT_KEYS

MAGIC = b"RSINDEX1"
# The keys of a parquet entry that have their own column; any other key is an identity marker (mtime, ETag,
# Last-Modified, blob id, sha256) kept as JSON. mtime, in every local file's entry, has a float column.
_COLUMNS = ("path", "size", "footer", "footer_bytes", "row_groups")
# The columns of the files' identities (what a dataset fingerprint stands for), in this order
IDENTITY_ARRAYS = ("path_offsets", "paths", "extra_offsets", "extras", "size", "mtime", "footer")
_U32_MAX = (1 << 32) - 1
MAX_PATH_BYTES = 4096
# (name, dtype or None: chosen per message among '<u4' / '<i8'): the arrays of a message, in this order
_ARRAYS = (("path_offsets", None), ("paths", "|u1"), ("extra_offsets", None), ("extras", "|u1"),
           ("size", "<i8"), ("mtime", "<f8"), ("footer", "|u1"), ("footer_bytes", None), ("group_offsets", None),
           ("rows", None), ("start", None), ("end", None))


class IndexTableError(ValueError):
    """A message or table that is not a well-formed index (the caller names where it came from)."""


def _fits(values: np.ndarray) -> str:
    """The smaller dtype that holds every value of ``values`` (non-negative)."""
    return "<u4" if not len(values) or int(values.max()) <= _U32_MAX else "<i8"


class FileTable(Sequence):
    """The ``files`` of a parquet index, columnar (see the module docstring); ``table[i]`` is entry ``i`` as the
    JSON form has it. Made with :meth:`from_entries` or :func:`unpack_index`, never edited."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self._a = arrays
        self._n = len(arrays["size"])

    # ------------------------------------------------------------------ building
    @classmethod
    def from_entries(cls, entries: list[dict]) -> FileTable | None:
        """The table of ``entries`` (checked parquet entries), or None when one has a shape the table does not
        hold (then the list stays as it is)."""
        arrays = identity_arrays(entries)
        if arrays is None or not entries:
            return None
        footer_bytes, counts = [], []
        groups: list[list[int]] = []
        for e in entries:
            footer_bytes.append(e["footer_bytes"])
            counts.append(len(e["row_groups"]))
            groups.extend(e["row_groups"])
        spans = np.asarray(groups, dtype=np.int64).reshape(-1, 3)
        if len(spans) and spans.min() < 0:
            return None
        fb = np.asarray(footer_bytes, dtype=np.int64)
        arrays.update({"footer_bytes": fb.astype(_fits(fb)), "group_offsets": _cumulative(counts)})
        for j, name in enumerate(("rows", "start", "end")):
            arrays[name] = spans[:, j].astype(_fits(spans[:, j]))
        return cls(arrays)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        entry = self.identity(i)
        i = i + self._n if i < 0 else i
        entry["footer_bytes"] = int(self._a["footer_bytes"][i])
        entry["row_groups"] = self.row_groups(i)
        return entry

    def identity(self, i: int) -> dict[str, Any]:
        """Entry ``i`` but its layout keys (``identity_of``): what the dataset fingerprint lists per file."""
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"file {i} of an index of {self._n}")
        a = self._a
        entry: dict[str, Any] = {"path": self.path(i), "size": int(a["size"][i])}
        mtime = float(a["mtime"][i])
        if mtime == mtime:       # NaN: none
            entry["mtime"] = mtime
        lo, hi = a["extra_offsets"][i], a["extra_offsets"][i + 1]
        if hi > lo:
            entry.update(json.loads(a["extras"][lo:hi].tobytes()))
        entry["footer"] = a["footer"][16 * i:16 * i + 16].tobytes().hex()
        return entry

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileTable):
            theirs = other.arrays()
            return len(other) == self._n and all(np.array_equal(self._a[k], theirs[k]) for k in self._a)
        return isinstance(other, list) and len(other) == self._n and list(self) == other

    __hash__ = None       # type: ignore[assignment]

    def paths(self) -> list[str]:
        raw, offsets = self._a["paths"].tobytes(), self._a["path_offsets"].tolist()
        return [raw[lo:hi].decode() for lo, hi in zip(offsets, offsets[1:])]

    def path(self, i: int) -> str:
        lo, hi = self._a["path_offsets"][i], self._a["path_offsets"][i + 1]
        return self._a["paths"][lo:hi].tobytes().decode()

    def row_groups(self, i: int) -> list[list[int]]:
        lo, hi = self._a["group_offsets"][i], self._a["group_offsets"][i + 1]
        a = self._a
        return np.stack([a["rows"][lo:hi], a["start"][lo:hi], a["end"][lo:hi]], axis=1).astype(np.int64).tolist()

    def json_text(self) -> str:
        """``json.dumps(list(self), sort_keys=True, separators=(",", ":"))``, made from the arrays (the dicts of
        a million files would take ten times as long)."""
        a = self._a
        groups = [f"[{r},{s},{e}]" for r, s, e in zip(a["rows"].tolist(), a["start"].tolist(), a["end"].tolist())]
        bounds, extra_offsets = a["group_offsets"].tolist(), a["extra_offsets"].tolist()
        footers = a["footer"].tobytes().hex()
        out = []
        for i, (path, size, mtime, fb) in enumerate(zip(self.paths(), a["size"].tolist(), a["mtime"].tolist(),
                                                          a["footer_bytes"].tolist())):
            if extra_offsets[i + 1] > extra_offsets[i]:       # a remote file's markers: keys sort among the others
                out.append(json.dumps(self[i], sort_keys=True, separators=(",", ":")))
                continue
            when = "" if mtime != mtime else f'"mtime":{mtime!r},'
            out.append(f'{{"footer":"{footers[32 * i:32 * i + 32]}","footer_bytes":{fb},{when}"path":'
                       f'{json.dumps(path)},"row_groups":[{",".join(groups[bounds[i]:bounds[i + 1]])}],"size":{size}}}')
        return "[" + ",".join(out) + "]"

    @property
    def num_row_groups(self) -> int:
        return len(self._a["rows"])

    def group_rows(self) -> np.ndarray:
        """Rows per row group, all files' in index order (one shard each): a read-only view."""
        view = self._a["rows"].view()
        view.flags.writeable = False
        return view

    def group_of(self, shard: int) -> tuple[int, int]:
        """(file, row group in that file) of the ``shard``-th row group of the index."""
        offsets = self._a["group_offsets"]
        file = int(np.searchsorted(offsets, shard, side="right")) - 1
        return file, shard - int(offsets[file])

    def group_span(self, shard: int) -> tuple[int, int]:
        """[first byte, end byte) of the ``shard``-th row group in its file."""
        return int(self._a["start"][shard]), int(self._a["end"][shard])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._a.values())

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(self._a)

    def identity_arrays(self, count: int | None = None) -> dict[str, np.ndarray]:
        """The identity columns (:data:`IDENTITY_ARRAYS`) of the first ``count`` files (all by default): what
        :func:`identity_arrays` makes of their identities, as views of the table's arrays."""
        n = self._n if count is None else count
        if not 0 <= n <= self._n:
            raise IndexError(f"{n} files of an index of {self._n}")
        a = self._a
        paths_end, extras_end = int(a["path_offsets"][n]), int(a["extra_offsets"][n])
        return {"path_offsets": a["path_offsets"][:n + 1], "paths": a["paths"][:paths_end],
                "extra_offsets": a["extra_offsets"][:n + 1], "extras": a["extras"][:extras_end],
                "size": a["size"][:n], "mtime": a["mtime"][:n], "footer": a["footer"][:16 * n]}


def identity_arrays(entries: list[dict], layout: bool = True) -> dict[str, np.ndarray] | None:
    """The identity columns of ``entries`` (index entries; ``layout=False``: their identities, as a dataset
    fingerprint lists them, which then hold no layout key): paths, other identity keys as compact JSON, sizes,
    mtimes (NaN: none) and footer digests. None when one has a shape a table does not hold."""
    paths, extras, sizes, mtimes, footers = [], [], [], [], []
    for e in entries:
        footer, path, size = e.get("footer"), e.get("path"), e.get("size")
        if not (isinstance(footer, str) and len(footer) == 32 and footer == footer.lower()
                and isinstance(path, str) and type(size) is int and 0 <= size <= MAX_INT64):
            return None
        if not layout and any(k in e for k in PARQUET_LAYOUT_KEYS):
            return None
        try:
            footers.append(bytes.fromhex(footer))
            paths.append(path.encode())
        except (ValueError, UnicodeEncodeError):
            return None
        extra = {k: v for k, v in e.items() if k not in _COLUMNS}
        mtime = extra.pop("mtime", None)
        if mtime is not None and not (type(mtime) is float and np.isfinite(mtime)):
            return None
        if any(isinstance(v, (dict, list)) for v in extra.values()):
            return None
        extras.append(json.dumps(extra, sort_keys=True, separators=(",", ":")).encode() if extra else b"")
        sizes.append(size)
        mtimes.append(np.nan if mtime is None else mtime)
    return {"path_offsets": _offsets(paths), "paths": np.frombuffer(b"".join(paths), np.uint8),
            "extra_offsets": _offsets(extras), "extras": np.frombuffer(b"".join(extras), np.uint8),
            "size": np.asarray(sizes, dtype=np.int64), "mtime": np.asarray(mtimes, dtype=np.float64),
            "footer": np.frombuffer(b"".join(footers), np.uint8)}


def json_default(value: Any) -> list:
    """``json.dumps``' ``default`` for what may hold a table: its entries as a list (the JSON form)."""
    if isinstance(value, FileTable):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _offsets(parts: list[bytes]) -> np.ndarray:
    return _cumulative([len(p) for p in parts])


def _cumulative(lengths: list[int]) -> np.ndarray:
    """Offsets 0, l0, l0+l1, ... in the smaller dtype that holds them."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out.astype(_fits(out))


# ------------------------------------------------------------------------------ the binary message
def pack_index(index: dict) -> bytes:
    """``index`` (its ``files`` a :class:`FileTable`) as one message: magic, header, arrays."""
    table = index["files"]
    if not isinstance(table, FileTable):
        raise TypeError("pack_index: the index's files are not a FileTable")
    arrays = table.arrays()
    header = {"index": {k: v for k, v in index.items() if k != "files"}, "files": len(table),
              "row_groups": table.num_row_groups, "dtypes": {k: arrays[k].dtype.str for k, _ in _ARRAYS}}
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    out = [MAGIC, *framed(head)]
    for name, _ in _ARRAYS:
        out += framed(np.ascontiguousarray(arrays[name]).tobytes())
    return b"".join(out)


def is_packed(data: bytes) -> bool:
    return data[:len(MAGIC)] == MAGIC


def framed(data: bytes) -> list[bytes]:
    """``data`` as a frame of a message: its length (8 bytes, little-endian), then itself."""
    return [struct.pack("<Q", len(data)), data]


class Frames:
    """The length-prefixed frames of a message from ``pos`` on, each length checked against what is left."""

    def __init__(self, data: memoryview, pos: int = len(MAGIC)):
        self.data, self.pos = data, pos

    def take(self, what: str) -> memoryview:
        if self.pos + 8 > len(self.data):
            raise IndexTableError(f"truncated before the length of {what}")
        (n,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        if n > len(self.data) - self.pos:
            raise IndexTableError(f"{what}: length {n} runs past the end of the message ({len(self.data)} bytes)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out


def unpack_index(data: bytes, parse_header) -> dict:
    """The index in message ``data`` (checked: lengths, dtypes, offsets, spans inside their files, paths);
    ``parse_header``: the bounded JSON parser for its header. Raises IndexTableError saying what is wrong."""
    if not is_packed(data):
        raise IndexTableError("not a packed dataset index (no magic)")
    cur = Frames(memoryview(data))
    header = parse_header(bytes(cur.take("the header")))
    if not (isinstance(header, dict) and isinstance(header.get("index"), dict) and isinstance(header.get("dtypes"), dict)):
        raise IndexTableError("malformed header")
    n, m = header.get("files"), header.get("row_groups")
    if not (type(n) is int and 1 <= n and type(m) is int and 0 <= m):
        raise IndexTableError(f"malformed counts (files {n!r:.20}, row groups {m!r:.20})")
    arrays: dict[str, np.ndarray] = {}
    for name, fixed in _ARRAYS:
        dtype = header["dtypes"].get(name)
        allowed = (fixed,) if fixed else ("<u4", "<i8")
        if dtype not in allowed:
            raise IndexTableError(f"{name}: dtype {dtype!r:.20}; allowed: {', '.join(allowed)}")
        raw = cur.take(name)
        dt = np.dtype(dtype)
        if len(raw) % dt.itemsize:
            raise IndexTableError(f"{name}: {len(raw)} bytes is no whole number of {dtype}")
        arrays[name] = np.frombuffer(raw, dtype=dt)
    if cur.pos != len(data):
        raise IndexTableError(f"{len(data) - cur.pos} bytes after the last array")
    _check(arrays, n, m)
    return {**header["index"], "files": FileTable(arrays)}


def _check(a: dict[str, np.ndarray], n: int, m: int) -> None:
    """Every count, offset and span of the arrays of a message, before any is used."""
    want = {"path_offsets": n + 1, "extra_offsets": n + 1, "size": n, "mtime": n, "footer": 16 * n,
            "footer_bytes": n, "group_offsets": n + 1, "rows": m, "start": m, "end": m}
    for name, length in want.items():
        if len(a[name]) != length:
            raise IndexTableError(f"{name}: {len(a[name])} values; the header says {length}")
    for offsets, blob in (("path_offsets", "paths"), ("extra_offsets", "extras"), ("group_offsets", None)):
        o = a[offsets].astype(np.int64)
        end = len(a[blob]) if blob else m
        if o[0] != 0 or o[-1] != end or (np.diff(o) < 0).any():
            raise IndexTableError(f"{offsets}: not increasing from 0 to {end}")
    lengths = np.diff(a["path_offsets"].astype(np.int64))
    if (lengths == 0).any() or (lengths > MAX_PATH_BYTES).any():
        raise IndexTableError(f"paths: an empty one, or one over {MAX_PATH_BYTES} bytes")
    if (a["paths"] == 0).any():
        raise IndexTableError("paths: a NUL byte")
    try:
        a["paths"].tobytes().decode()
    except UnicodeDecodeError as e:
        raise IndexTableError(f"paths: not UTF-8 ({e})") from None
    size = a["size"]
    if (size < 0).any() or (a["footer_bytes"].astype(np.int64) > size).any():
        raise IndexTableError("size / footer_bytes: negative, or a footer larger than its file")
    mtime = a["mtime"]
    if np.isinf(mtime).any():
        raise IndexTableError("mtime: not finite")
    start, end = a["start"].astype(np.int64), a["end"].astype(np.int64)
    file_size = np.repeat(size, np.diff(a["group_offsets"].astype(np.int64)))
    if (start > end).any() or (end > file_size).any() or (a["rows"].astype(np.int64) > MAX_INT64).any():
        bad = int(np.flatnonzero((start > end) | (end > file_size))[0])
        raise IndexTableError(f"row group {bad}: span {int(start[bad])}..{int(end[bad])} is not inside its file "
                              f"of {int(file_size[bad])} bytes")
    offsets, blob = a["extra_offsets"], a["extras"]
    for i in np.flatnonzero(np.diff(offsets.astype(np.int64))).tolist():
        try:
            extra = json.loads(blob[int(offsets[i]):int(offsets[i + 1])].tobytes())
        except ValueError:
            extra = None
        if not (isinstance(extra, dict) and not set(extra) & {*_COLUMNS, "mtime"}
                and all(isinstance(v, (str, int, float, bool)) or v is None for v in extra.values())):
            raise IndexTableError(f"file {i}: malformed identity keys")
