"""One pass over a JSON-lines file (plain, gzip or zstd): where its rows are, cut into pieces, and where a read
of each piece starts (a sparse line-offset index).

A **row** is a line holding anything but JSON whitespace (as pyarrow's JSON reader counts them). A **piece** is a
run of rows cut at ``PIECE_MAX_BYTES`` of text or ``PIECE_MAX_ROWS`` rows; the index keeps per piece its rows, its
text's byte span and CRC-32, its access point and its compressed end. An **access point** is where decompression
can start: every line (plain), every frame start (zstd), zran points found by ``indexed_gzip`` (gzip: a deflate
block boundary with its bit offset and 32 KiB window) and member starts. A **shard** is a run of pieces read from
one access point (a one-frame zstd file: the whole file).
"""

from __future__ import annotations

import base64
import bisect
import io
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import SourceError
from ..limits import is_int
from .base import NotIndexable, SeekableFile

PIECE_MAX_BYTES = 16 << 20
PIECE_MAX_ROWS = 16384
# a full piece is cut at the next access point when one comes within this many bytes; else at its line's end
POINT_SLACK = 4 << 20
GZIP_SPACING = 1 << 20          # zran points looked for at least this far apart (indexed_gzip's spacing)
GZIP_WINDOW = 32768
READ_CHUNK = 8 << 20            # bytes per read of the file while indexing
INPUT_CHUNK = 256 << 10         # compressed bytes fed at a time: how exactly a piece's compressed end is known
SHARD_RULE = {"max_bytes": PIECE_MAX_BYTES, "max_rows": PIECE_MAX_ROWS}
COMPRESSIONS = ("none", "gzip", "zstd")
_BLANK = b" \t\r\n"
_WHITE_AFTER_NEWLINE = re.compile(rb"\n[\n \t\r]")      # where a blank line may start (memchr-fast)


# CRC-32 and raw inflate by ISA-L (python-isal) where it is installed: the same values as zlib's, ~10x / ~1.5-3x
# faster (a piece's text is checked before it is parsed; .gz text inflated as it is read)
try:
    from isal.isal_zlib import crc32
    from isal.isal_zlib import decompressobj as _isal_decompressobj
    from isal.isal_zlib import error as _isal_error
except ImportError:             # (zlib's)
    from zlib import crc32

    _isal_decompressobj, _isal_error = None, zlib.error
INFLATE_ERRORS = (zlib.error, _isal_error)


def raw_inflater(window: bytes = b""):
    """A decompressor of raw deflate data (no header) whose 32 KiB of text before it is ``window``."""
    make = _isal_decompressobj or zlib.decompressobj
    return make(-15, zdict=window) if window else make(-15)


def compression_of(path: str) -> str | None:
    """``none`` / ``gzip`` / ``zstd`` by the file's name; None: another compression (not read by us)."""
    low = path.lower().split("?", 1)[0]
    if low.endswith(".gz"):
        return "gzip"
    if low.endswith(".zst") or low.endswith(".zstd"):
        return "zstd"
    if low.endswith((".bz2", ".xz", ".lz4", ".zip", ".tar", ".7z", ".br", ".lzma", ".z")):
        return None
    return "none"


# ------------------------------------------------------------------------------ rows in text
def is_blank(line: bytes) -> bool:
    return not line.strip(_BLANK)


def count_rows(text: bytes | memoryview, lo: int = 0, hi: int | None = None) -> int:
    """The rows of ``text[lo:hi]`` (whole lines, the last may lack its newline)."""
    text = bytes(text) if isinstance(text, memoryview) else text
    hi = len(text) if hi is None else hi
    if hi <= lo:
        return 0
    lines = text.count(b"\n", lo, hi) + (text[hi - 1] != 10)
    return lines - len(_blank_starts(text, lo, hi))


def _blank_starts(text: bytes, lo: int, hi: int) -> list[int]:
    """The starts of the blank lines in ``text[lo:hi]`` (``lo`` a line start)."""
    found = set()
    if lo < hi and text[lo] in b"\n \t\r":
        found.add(lo)
    found.update(m.start() + 1 for m in _WHITE_AFTER_NEWLINE.finditer(text, lo, hi))
    out = []
    for start in sorted(found):
        end = text.find(b"\n", start, hi)
        if is_blank(text[start:hi if end < 0 else end]):
            out.append(start)
    return out


def skip_rows(text: bytes, lo: int, rows: int) -> int:
    """The offset in ``text`` of the start of row ``rows`` counted from ``lo`` (a line start); ``len(text)`` when
    there are fewer. Counts newlines only: nothing is parsed."""
    pos, n = lo, 0
    end = len(text)
    while n < rows and pos < end:
        nl = text.find(b"\n", pos)
        nxt = end if nl < 0 else nl + 1
        if not (text[pos] in b" \t\r\n" and is_blank(text[pos:nxt])):
            n += 1
        pos = nxt
    # blank lines before the row are skipped too: the row starts at its own line
    while pos < end and text[pos] in b" \t\r\n":
        nl = text.find(b"\n", pos)
        nxt = end if nl < 0 else nl + 1
        if not is_blank(text[pos:nxt]):
            break
        pos = nxt
    return pos


def row_spans(text: bytes, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of every row of ``text[lo:hi]``, its newline excluded."""
    hi = len(text) if hi is None else hi
    out, pos = [], lo
    while pos < hi:
        nl = text.find(b"\n", pos, hi)
        end = hi if nl < 0 else nl
        if not is_blank(text[pos:end]):
            out.append((pos, end))
        pos = end + 1
    return out


# ------------------------------------------------------------------------------ the pass
class _Cutter:
    """Cuts decompressed text into pieces as it arrives (``feed``), at access points where it can."""

    def __init__(self, plain: bool):
        self.plain = plain
        self.buf = bytearray()
        self.buf_u = 0                # file offset of buf[0]
        self.points: list[list[int]] = []     # [u, c] of every access point seen, rising
        self.pieces: list[list[int]] = []     # [rows, ustart, uend, crc, point, cend]
        self._start = 0               # the current piece: its first byte, rows, crc, access point
        self._rows = 0
        self._crc = 0
        self._point = -1 if plain else 0
        self._pos = 0                 # next byte not yet in a piece (a line start)
        self._full_at: int | None = None
        self._marks: list[tuple[int, int]] = []   # (text fed so far, compressed bytes read by then)

    def _point_at_or_before(self, u: int) -> int:
        return max(0, bisect.bisect_right([p[0] for p in self.points], u) - 1)

    def _compressed_end(self) -> int:
        """The compressed bytes read by the time the text up to ``pos`` was decompressed."""
        if self.plain:
            return self._pos
        keep = [m for m in self._marks if m[0] >= self._pos]
        self._marks = keep
        return keep[0][1]

    def _take(self, hi: int) -> None:
        """Move the whole lines of [pos, hi) (hi a line end or the file's end) into the current piece."""
        if hi <= self._pos:
            return
        lo = self._pos - self.buf_u
        chunk = bytes(self.buf[lo:hi - self.buf_u])
        if self._rows == 0 and self._start == self._pos:
            # blank lines before a piece's first row are not its text
            first = skip_rows(chunk, 0, 0)
            self._start += first
            self._pos += first
            chunk = chunk[first:]
            if not chunk:
                return
        self._rows += count_rows(chunk)
        self._crc = crc32(chunk, self._crc)
        self._pos = hi

    def _close(self) -> None:
        if self._rows:
            self.pieces.append([self._rows, self._start, self._pos, self._crc, self._point, self._compressed_end()])

    def _open(self, at: int, point: int) -> None:
        self._start, self._rows, self._crc, self._point, self._full_at = at, 0, 0, point, None

    def _line_end_after(self, n_rows: int, max_end: int) -> int | None:
        """The end (after its newline) of the line ending the ``n_rows``-th row from pos, or of the last whole
        line before ``max_end``; None when no whole line is buffered."""
        text = self.buf
        lo, hi = self._pos - self.buf_u, min(len(text), max_end - self.buf_u)
        last = text.rfind(b"\n", lo, hi)
        if last < 0:
            return None
        if text.count(b"\n", lo, last + 1) <= n_rows:
            return self.buf_u + last + 1
        pos, n = lo, 0
        while n < n_rows:
            nl = text.find(b"\n", pos, last + 1)
            if not is_blank(bytes(text[pos:nl])):
                n += 1
            pos = nl + 1
        return self.buf_u + pos

    def feed(self, data: bytes, c_now: int, eof: bool = False) -> None:
        """More text (following what came before); ``c_now``: compressed bytes read so far (a bound for what
        decompressing the text fed so far needs). At ``eof`` the last piece is closed."""
        self.buf += data
        end_u = self.buf_u + len(self.buf)
        self._marks.append((end_u, c_now))
        while True:
            full = self._pos - self._start >= PIECE_MAX_BYTES or self._rows >= PIECE_MAX_ROWS
            if full:
                if self._full_at is None:
                    self._full_at = self._pos
                cut = self._cut_point(end_u, eof)
                if cut is None:
                    break                            # no decision yet: more text first
                u, point = cut
                if u > self._pos:                    # the lines that start before the point stay in this piece
                    straddle = self.buf.find(b"\n", u - 1 - self.buf_u) if u > self.buf_u else -1
                    if straddle < 0 and not eof:
                        break
                    self._take(end_u if straddle < 0 else self.buf_u + straddle + 1)
                self._close()
                self._open(self._pos, point)
                continue
            room_rows = PIECE_MAX_ROWS - self._rows
            room_bytes = self._start + PIECE_MAX_BYTES - self._pos
            hi = self._line_end_after(room_rows, self._pos + max(room_bytes, 1))
            if hi is None or hi <= self._pos:
                # the next line alone is longer than what is buffered, or than the room left
                nl = self.buf.find(b"\n", self._pos - self.buf_u)
                if nl >= 0:
                    self._take(self.buf_u + nl + 1)
                    continue
                if eof:
                    self._take(end_u)
                break
            self._take(hi)
        if eof:
            self._take(end_u)
            self._close()
        self._compact()

    def _cut_point(self, end_u: int, eof: bool) -> tuple[int, int] | None:
        """Where the full piece ends: (the next piece's first byte or the access point it starts at, that point's
        number); None while it cannot be known yet."""
        if self.plain:
            return self._pos, -1
        i = bisect.bisect_left([p[0] for p in self.points], self._full_at)
        if i < len(self.points) and self.points[i][0] <= self._full_at + POINT_SLACK:
            return self.points[i][0], i
        if eof or end_u > self._full_at + POINT_SLACK:
            return self._pos, self._point_at_or_before(self._pos)     # no point near: cut at the line's end
        return None

    def _compact(self) -> None:
        drop = min(self._pos, self._start) - self.buf_u
        if drop > (4 << 20):
            del self.buf[:drop]
            self.buf_u += drop

    def point_reached(self, u: int, c: int) -> None:
        if not self.points or u > self.points[-1][0]:
            self.points.append([u, c])


def scan(path: str, size: int, compression: str, fetch: Callable[[int, int], bytes]) -> dict[str, Any]:
    """The layout of a JSON-lines file of ``size`` bytes (``fetch(start, end)``: its bytes): rows, pieces, access
    points (gzip: with their windows). SourceError naming the file for bytes that do not decompress."""
    try:
        if compression == "none":
            return _scan_plain(size, fetch)
        if compression == "zstd":
            return _scan_zstd(size, fetch)
        return _scan_gzip(path, size, fetch)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable {compression} JSON-lines file "
                          f"({type(e).__name__}: {e})") from None


def _layout(cutter: _Cutter, length: int, points: list[list], windows: list[str]) -> dict[str, Any]:
    # the points pieces start from, and every gzip member's start (no window): a read crossing into the next
    # member goes on from there
    used = sorted({p[4] for p in cutter.pieces if p[4] >= 0}
                  | {i for i, w in enumerate(windows) if i > 0 and w == "" and points[i][2] == 0})
    renumber = {old: new for new, old in enumerate(used)}
    for p in cutter.pieces:
        if p[4] >= 0:
            p[4] = renumber[p[4]]
    return {"length": length, "rows": sum(p[0] for p in cutter.pieces), "pieces": cutter.pieces,
            "points": [[*points[i], windows[i] if windows else ""] for i in used]}


def _scan_plain(size: int, fetch: Callable[[int, int], bytes]) -> dict[str, Any]:
    cutter = _Cutter(plain=True)
    pos = 0
    for start, data in _chunks(size, fetch):
        pos = start + len(data)
        cutter.feed(data, pos, eof=pos >= size)
    if size == 0:
        cutter.feed(b"", 0, eof=True)
    return _layout(cutter, pos, [], [])


def _chunks(size: int, fetch: Callable[[int, int], bytes]) -> Iterator[tuple[int, bytes]]:
    """(compressed offset, bytes) of the file, READ_CHUNK at a time."""
    pos = 0
    while pos < size:
        data = fetch(pos, min(size, pos + READ_CHUNK))
        if not data:
            return
        yield pos, data
        pos += len(data)


def _scan_zstd(size: int, fetch: Callable[[int, int], bytes]) -> dict[str, Any]:
    import zstandard

    cutter = _Cutter(plain=False)
    dctx = zstandard.ZstdDecompressor()
    obj, u, frame_start = None, 0, True
    for c0, data in _chunks(size, fetch):
        for k in range(0, len(data), INPUT_CHUNK):
            piece = data[k:k + INPUT_CHUNK]
            c = c0 + k
            while piece:
                if frame_start:
                    cutter.point_reached(u, c)
                    obj, frame_start = dctx.decompressobj(), False
                out = obj.decompress(piece)
                used = len(piece) - len(obj.unused_data) if obj.eof else len(piece)
                u += len(out)
                c += used
                cutter.feed(out, c)
                piece = obj.unused_data if obj.eof else b""
                frame_start = obj.eof
    if obj is not None and not obj.eof:
        raise SourceError("the last zstd frame is cut short")
    cutter.feed(b"", size, eof=True)
    return _layout(cutter, u, [[pu, pc, 0] for pu, pc in cutter.points], [])


class _RangedFile(SeekableFile):
    """A read-only file over ``fetch(start, end)`` (what indexed_gzip reads a remote gzip through)."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]):
        super().__init__()
        self.size, self._fetch, self.pos = size, fetch, 0
        self._chunks: list[tuple[int, bytes]] = []      # the last two chunks read (indexed_gzip steps back a little)

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        chunk = next(((lo, data) for lo, data in self._chunks if lo <= self.pos < lo + len(data)), None)
        if chunk is None:
            # the next chunk starts where the last one ended when the read is inside that gap: no byte twice
            ends = [lo + len(data) for lo, data in self._chunks if lo + len(data) <= self.pos]
            start = self.pos if not ends or max(ends) < self.pos - READ_CHUNK else max(ends)
            chunk = (start, self._fetch(start, min(self.size, max(self.pos + n, start + READ_CHUNK))))
            self._chunks = [*self._chunks[-1:], chunk]
        lo, data = chunk
        got = data[self.pos - lo:self.pos - lo + n]
        buffer[:len(got)] = got
        self.pos += len(got)
        return len(got)


def gzip_header_length(head: bytes, path: str) -> int:
    """The length of the gzip member header ``head`` begins with (RFC 1952)."""
    if len(head) < 10 or head[:3] != b"\x1f\x8b\x08":
        raise SourceError(f"data file {path!r}: not a gzip file (no gzip header at its start)")
    flags, pos = head[3], 10
    if flags & 4:                                          # FEXTRA
        pos += 2 + int.from_bytes(head[pos:pos + 2], "little")
    for bit in (8, 16):                                    # FNAME, FCOMMENT: zero-terminated
        if flags & bit:
            end = head.find(b"\0", pos)
            if end < 0:
                raise SourceError(f"data file {path!r}: a gzip header longer than {len(head)} bytes")
            pos = end + 1
    return pos + (2 if flags & 2 else 0)                   # FHCRC


def _scan_gzip(path: str, size: int, fetch: Callable[[int, int], bytes]) -> dict[str, Any]:
    try:
        import indexed_gzip
    except ImportError:
        raise NotIndexable(f"data file {path!r}: reading a .gz JSON-lines file by its access points needs the "
                           "package indexed_gzip (pip install indexed_gzip)") from None
    raw = _RangedFile(size, fetch)
    cutter = _Cutter(plain=False)
    cutter.point_reached(0, gzip_header_length(fetch(0, min(size, 65536)), path))
    gz = indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=GZIP_SPACING, window_size=GZIP_WINDOW,
                                      readbuf_size=INPUT_CHUNK, buffer_size=1 << 20, drop_handles=False)
    try:
        u = 0
        while True:
            data = gz.read(1 << 20)
            for pu, pc in gz.seek_points():
                cutter.point_reached(pu, pc)
            if not data:
                break
            u += len(data)
            cutter.feed(data, raw.pos)
        cutter.feed(b"", raw.pos, eof=True)
        exported = _gzip_points(_export(gz), path)
        used = {p[4] for p in cutter.pieces}
        if any(tuple(cutter.points[i]) not in exported for i in used if i > 0):
            gz.build_full_index()                          # (a file read in one go made no points on the way)
            exported = _gzip_points(_export(gz), path)
    finally:
        gz.close()
    exported.setdefault(tuple(cutter.points[0]), (0, ""))   # the first member's start: no window
    missing = [cutter.points[i] for i in sorted({p[4] for p in cutter.pieces}) if tuple(cutter.points[i]) not in exported]
    if missing:
        raise SourceError(f"data file {path!r}: indexed_gzip exported no access point at {missing[0]}")
    points = [[u_, c_, *exported[(u_, c_)]] for u_, c_ in cutter.points] if cutter.pieces else []
    return _layout(cutter, u, [p[:3] for p in points], [p[3] for p in points])


def _export(gz) -> bytes:
    out = io.BytesIO()
    gz.export_index(fileobj=out)
    return out.getvalue()


def _gzip_points(blob: bytes, path: str) -> dict[tuple[int, int], tuple[int, str]]:
    """indexed_gzip's exported index (zran.c, ``zran_export_index``, format version 0 or 1): per point
    (uncompressed offset, compressed offset) its bits and its window, zlib-compressed and base64-encoded ("" for a
    point without one: a gzip member's start)."""
    head = struct.Struct("<5sBBQQIII")
    if len(blob) < head.size:
        raise SourceError(f"data file {path!r}: indexed_gzip exported no index")
    magic, version, _, _, _, _, window, count = head.unpack_from(blob, 0)
    if magic != b"GZIDX" or version > 1:
        raise SourceError(f"data file {path!r}: indexed_gzip exported an index this library does not read "
                          f"(version {version})")
    pos, points = head.size, []
    for i in range(count):
        c, u, bits = struct.unpack_from("<QQB", blob, pos)
        pos += 17
        data = i > 0
        if version >= 1:
            data = blob[pos] == 1
            pos += 1
        points.append((u, c, bits, data))
    out = {}
    for u, c, bits, data in points:
        text = ""
        if data:
            text = base64.b64encode(zlib.compress(blob[pos:pos + window], 9)).decode()
            pos += window
        out[(u, c)] = (bits, text)
    return out


def window_of(point: list) -> bytes:
    """The 32 KiB of text before a gzip access point (b"" for a member's start)."""
    return zlib.decompress(base64.b64decode(point[3])) if point[3] else b""


# ------------------------------------------------------------------------------ shards
def shard_cuts(pieces: list[list[int]], compression: str) -> list[int]:
    """The first piece of each shard: a piece that starts reading from an access point of its own (plain text:
    every piece)."""
    return [i for i, p in enumerate(pieces)
            if i == 0 or compression == "none" or p[4] != pieces[i - 1][4]]


def entry_problem(entry: Any) -> str | None:
    """What is wrong with the shape of a JSON-lines entry of an index (None: nothing): numbers inside the file,
    pieces rising without overlap, no more rows than bytes, points rising, each piece's point before it."""
    if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and is_int(entry.get("size"), 0)
            and entry.get("compression") in COMPRESSIONS and is_int(entry.get("length"), 0)
            and is_int(entry.get("rows"), 0) and isinstance(entry.get("pieces"), list)
            and isinstance(entry.get("points"), list) and isinstance(entry.get("shard_rule"), dict)):
        return "not a JSON-lines entry (path, size, compression, length, rows, pieces, points, shard_rule)"
    size, length, plain = entry["size"], entry["length"], entry["compression"] == "none"
    points = entry["points"]
    last_u = last_c = -1
    for p in points:
        if not (isinstance(p, list) and len(p) == 4 and is_int(p[0], 0, length) and is_int(p[1], 0, size)
                and is_int(p[2], 0, 7) and isinstance(p[3], str) and len(p[3]) <= 65536
                and p[0] > last_u and p[1] >= last_c):
            return "a point is not [uncompressed offset, compressed offset, bits, window] rising in the file"
        last_u, last_c = p[0], p[1]
    end, rows = 0, 0
    for p in entry["pieces"]:
        if not (isinstance(p, list) and len(p) == 6 and all(is_int(x, -1) for x in p)):
            return "a piece is not [rows, start, end, crc, point, compressed end]"
        n, start, stop, crc, point, cend = p
        if not (1 <= n <= stop - start and end <= start < stop <= length and 0 <= crc < 2 ** 32
                and stop - start <= PIECE_MAX_BYTES + _LINE_ALLOWANCE):
            return f"a piece [{n}, {start}, {stop}, ...] is not inside the file, after the one before, within the rule"
        if plain and not (point == -1 and cend == stop):
            return "a piece of a plain file has an access point"
        if not plain and not (0 <= point < len(points) and points[point][0] <= start and 0 < cend <= size
                              and cend > points[point][1]):
            return f"a piece [{n}, {start}, {stop}, ...] reads from a point that is not before it"
        end, rows = stop, rows + n
    if rows != entry["rows"]:
        return f"its pieces hold {rows} rows, the entry says {entry['rows']}"
    return None


# a piece holds whole lines: one line longer than the rule's bytes makes a longer piece (bounded by the reads)
_LINE_ALLOWANCE = 1 << 30
