"""JSON lines (``.jsonl`` / ``.json`` lines, plain, ``.gz`` or ``.zst``), indexed: read by byte ranges from a sparse
line-offset index (:mod:`.jsonl_index`), each piece's text checked against its CRC-32 before it is parsed, rows
equal to ``load_dataset("json", ..., streaming=True)``'s (:mod:`.jsonl_rows`). A line that does not parse is a
bad sample (``__bad_sample__`` says why; the row count never changes). docs/formats.md says what a shard and a
resume cost.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import pyarrow as pa

from ..config.specs import SourceSpec
from ..errors import (
    IncompleteFileError,
    SourceError,
    StreamMismatchError,
)
from ..io.net import RetryPolicy
from ..io.ranged import WrongBytes
from ..observe.metrics import record_retry, record_row_group
from . import jsonl_index, jsonl_rows
from .base import FetchesAhead, NotIndexable, ScannedReader, fetcher, shards_of_runs
from .fingerprint_files import dataset_fingerprint
from .index import identity_of
from .parquet import prefetch_depth
from .parquet_rows import decoder_pool

log = logging.getLogger(__name__)

HEAD_BYTES = 64 << 10          # the bytes at each end of a local file re-read on resume (``head`` identity)


# ------------------------------------------------------------------------------ index
def head_digest(path: str, size: int, fetch: Callable[[int, int], bytes]) -> str:
    """CRC-32s of a file's first and last HEAD_BYTES: what a local file is re-checked on (a same-size, same-mtime
    rewrite), at the cost of two reads."""
    first = fetch(0, min(size, HEAD_BYTES))
    last = fetch(max(0, size - HEAD_BYTES), size) if size > HEAD_BYTES else b""
    return f"{zlib.crc32(first):08x}{zlib.crc32(last):08x}"


def index_file(path: str, retry: RetryPolicy | None, identity: dict, whole: bool = False) -> dict:
    """One file's index entry: its ``identity``, one pass over it (``jsonl_index.scan``) and its ``head``.
    ``whole`` (``data.growth``): IncompleteFileError for a file not complete yet: text whose last line has no
    newline, or compressed data cut short."""
    if not isinstance(identity.get("size"), int):
        raise SourceError(f"data file {path!r}: its size is unknown; a JSON-lines file needs one to be indexed")
    compression = jsonl_index.compression_of(path)
    if compression is None:
        raise SourceError(f"data file {path!r}: a compression this library does not index (allowed: none, .gz, "
                          ".zst)")
    fetch = fetcher(path, retry, identity, "to index it")
    size = identity["size"]
    if ".json." in path.lower().split("?", 1)[0] + "." and _starts_an_array(fetch(0, min(size, 65536)), compression):
        raise NotIndexable(f"data file {path!r}: a JSON array, not JSON lines")
    if whole and compression == "none" and size and fetch(size - 1, size) != b"\n":
        raise IncompleteFileError(f"data file {path!r}: its last line has no newline (still being written)")
    try:
        layout = jsonl_index.scan(path, size, compression, fetch)
    except SourceError as e:
        if whole and compression != "none" and not isinstance(e, NotIndexable):
            raise IncompleteFileError(f"{e} (still being written?)") from None
        raise
    entry = {**identity, "compression": compression, **layout, "shard_rule": dict(jsonl_index.SHARD_RULE)}
    if "://" not in path or path.startswith("file://"):      # a remote file is re-checked by its size and ETag
        entry["head"] = head_digest(path, size, fetch)
    return entry


def _starts_an_array(head: bytes, compression: str) -> bool:
    """Whether the text of a ``.json`` file whose first bytes are ``head`` begins a JSON array (``datasets`` reads
    it whole, not as lines)."""
    try:
        if compression == "gzip":
            head = zlib.decompressobj(47).decompress(head, 4096)
        elif compression == "zstd":
            import zstandard

            head = zstandard.ZstdDecompressor().decompressobj().decompress(head)[:4096]
    except Exception:      # noqa: BLE001 - not even its start decompresses: the pass says why
        return False
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


class _FeaturesAhead:
    """The first try of :func:`builder_features` runs on a thread beside the indexing pass; ``result()`` takes
    it and, when it failed on a network fault, tries again here under the step's retries (resolving the file is
    requests of its own: fsspec's glob and exists). The thread makes one try only, so a pass that fails leaves
    nothing running behind it."""

    def __init__(self, first, path: str, retry: RetryPolicy | None):
        self.first, self.path, self.retry = first, path, retry

    def result(self):
        tries = [self.first.result]

        def attempt():
            return tries.pop()() if tries else builder_features(self.path, self.retry)

        if self.retry is None:
            return attempt()
        return self.retry.call(attempt, f"inferring the features of {self.path!r}", [self.path])


def builder_features(path: str, retry: RetryPolicy | None):
    """The features ``datasets``' json builder infers from the file at ``path`` (its first chunk): the builder
    itself is asked, streaming over that one file, as ``load_dataset(..., streaming=True)`` would. None when it
    infers none (a line of the chunk does not parse; datasets 4.x while streaming)."""
    import datasets

    options = {"storage_options": dict(retry.storage_options)} if retry is not None and retry.remote else {}
    builder = datasets.load_dataset_builder("json", data_files={"train": [path]}, **options)
    try:
        features = builder.as_streaming_dataset(split="train").features
    except Exception:      # noqa: BLE001 - inferred from its good lines instead (infer_features)
        return None
    from datasets.packaged_modules.json import json as json_module

    traces = getattr(json_module, "AGENT_TRACES_FEATURES", None)
    if traces is not None and features == traces:
        raise NotIndexable(f"data file {path!r}: agent traces (datasets converts whole files of them), not rows of "
                           "JSON lines")
    return features


def infer_features(spec: SourceSpec, entry: dict, retry: RetryPolicy | None):
    """The features of the data: the json builder's (``builder_features``), else those it infers from the first
    file's first piece without its lines that do not parse."""
    features = builder_features(entry["path"], retry)
    return features if features is not None else _features_of_good_lines(entry, retry)


def _features_of_good_lines(entry: dict, retry: RetryPolicy | None):
    """What the builder infers from the first file's first chunk without its lines that do not parse (which
    the builder refuses whole, and we read as bad samples): the builder itself, on those lines."""
    import tempfile

    import datasets

    path = entry["path"]
    first = entry["pieces"][0] if entry["pieces"] else None
    if first is None:
        raise SourceError(f"data file {path!r}: holds no rows; the features are inferred from the first file")
    fetch = fetcher(path, retry, entry, "to infer the features")
    if entry["compression"] == "none":
        chunk = fetch(first[1], first[2])
    else:
        chunk = _Text(entry, first[4], fetch).upto(first[2], first[5])
    good = [line for line in chunk.splitlines()
            if not jsonl_index.is_blank(line) and jsonl_rows.line_problem(line) is None]
    if not good:
        raise SourceError(f"data file {path!r}: no line of its first {first[0]} rows is a JSON object; the "
                          "features are inferred from them")
    with tempfile.TemporaryDirectory() as d:
        sample = f"{d}/first.jsonl"
        with open(sample, "wb") as f:
            f.write(b"\n".join(good))
        builder = datasets.load_dataset_builder("json", data_files={"train": [sample]})
        features = builder.as_streaming_dataset(split="train").features
    if features is None:
        # datasets 4.x infers no features while streaming JSON (it reads each block with the types pyarrow finds
        # there): those of the first block, as its IterableDataset resolves them from its first rows
        import pyarrow.json as paj

        block = b"\n".join(good)
        table = paj.read_json(io.BytesIO(block), read_options=paj.ReadOptions(block_size=len(block) + 1))
        features = datasets.Features.from_arrow_schema(table.schema)
    return features


# ------------------------------------------------------------------------------ text from an access point
def _shifted(data: bytes, shift: int, carry: int | None) -> tuple[memoryview, int]:
    """``data`` (following the byte ``carry``; None: its first byte is the carry) read from bit ``shift`` of
    ``carry`` on: a deflate stream that starts inside a byte, moved onto byte boundaries for zlib (Python's zlib
    has no ``inflatePrime``); and the new carry. Shifted 64 bits at a time, by numpy (the GIL let go), in place and
    _SHIFT_WORDS at a time (the temporary stays in the CPU's cache): whole-array temporaries, fresh pages each, cost
    ~3.5x the time (~0.8 us a row of the corpora benchmark's ``.json.gz``), as much as a sixth of the inflate."""
    import numpy as np

    raw = len(data) + (carry is not None)
    if raw < 2:
        return memoryview(b""), data[-1] if data else carry
    n = raw // 8 + 2
    words = np.empty(n, dtype="<u8")
    as_bytes = words.view(np.uint8)
    as_bytes[raw:] = 0
    if carry is None:
        as_bytes[:raw] = np.frombuffer(data, dtype=np.uint8)
    else:
        as_bytes[0] = carry
        as_bytes[1:raw] = np.frombuffer(data, dtype=np.uint8)
    right, left = np.uint64(shift), np.uint64(64 - shift)
    high = np.empty(min(_SHIFT_WORDS, n - 1), dtype="<u8")
    for a in range(0, n - 1, _SHIFT_WORDS):       # word k = (k >> shift) | (k + 1 << 64 - shift), k + 1 not yet moved
        b = min(a + _SHIFT_WORDS, n - 1)
        part, top = words[a:b], high[:b - a]
        np.left_shift(words[a + 1:b + 1], left, out=top)
        np.right_shift(part, right, out=part)
        np.bitwise_or(part, top, out=part)
    return memoryview(as_bytes)[:raw - 1], data[-1]


_SHIFT_WORDS = 1 << 15        # 256 KiB of words shifted at a time


def readahead_pool():
    """This process's threads fetching a shard's next piece while the piece before it decodes (not the decode pool:
    a decode waiting on a fetch queued behind decodes could wait forever); a forked worker makes its own."""
    from concurrent.futures import ThreadPoolExecutor

    if not _READAHEAD or _READAHEAD[0][0] != os.getpid():
        _READAHEAD[:] = [(os.getpid(), ThreadPoolExecutor(READAHEAD_THREADS, thread_name_prefix="rs-readahead"))]
    return _READAHEAD[0][1]


_READAHEAD: list = []
READAHEAD_THREADS = 4
READAHEAD_PIECES = 2      # pieces of a shard asked for ahead of the one decoding (one more may still be held: _Ranges)


class _Ranges:
    """A file's compressed bytes read in order, with the next pieces' ranges fetched ahead (at most READAHEAD_PIECES
    ahead of the one decoding, under the same fetch: retries, request budget, checked answers). A read never asks for a
    byte a fetch ahead holds or is getting: no byte is fetched twice. With ``budget`` (the source's prefetcher), the
    bytes of a range fetched ahead count against ``data.prefetch_memory_mb`` until the reader takes them or they are
    dropped; a range that does not fit is not fetched ahead (the reader fetches it when its decode starts)."""

    def __init__(self, fetch: Callable[[int, int], bytes], budget=None):
        self._fetch = fetch
        self._budget = budget
        self._ahead: list[tuple[int, int, Any]] = []       # (start, end, future), in file order

    def ahead(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` in the background, from where the last fetch ahead ends if it is further on."""
        if self._ahead:
            start = max(start, self._ahead[-1][1])
        if end > start and len(self._ahead) <= READAHEAD_PIECES:
            if self._budget is not None and not self._budget.reserve(end - start):
                return
            self._ahead.append((start, end, readahead_pool().submit(self._fetch, start, end)))

    def _release(self, start: int, end: int, future) -> None:
        """Its bytes are no longer held ahead once its fetch is over (a cancelled one at once)."""
        if self._budget is not None:
            future.add_done_callback(lambda _f, budget=self._budget, n=end - start: budget.release(n))

    def fetch(self, start: int, end: int) -> bytes:
        if self._ahead:
            first = self._ahead[0][0]
            if start == first:
                taken = self._ahead.pop(0)
                try:
                    return taken[2].result()
                finally:
                    self._release(*taken)              # the reader's now
            if start < first:
                return self._fetch(start, min(end, first))
            self.close()                               # a read elsewhere (not one in order): drop what was ahead
        return self._fetch(start, end)

    def close(self) -> None:
        """Cancel what was fetched ahead and not read (a fetch under way ends on its own; its bytes are dropped)."""
        for taken in self._ahead:
            taken[2].cancel()
            self._release(*taken)
        self._ahead.clear()


class _Inflate:
    """Raw deflate from a gzip access point of the index (its bit offset and window), by zlib, fed the compressed
    bytes as they are fetched; at a member's end it goes on from the next member's start (a point of the index)."""

    def __init__(self, entry: dict, point: int, fetch: Callable[[int, int], bytes]):
        self.size, self.fetch = entry["size"], fetch
        self._members = {p[0]: p for p in entry["points"] if p[2] == 0 and not p[3]}   # by their text offset
        self._start(entry["points"][point])

    def _start(self, p: list) -> None:
        window = jsonl_index.window_of(p)
        self.made = p[0]                               # the text offset the output reaches
        self._shift = 8 - p[2] if p[2] else 0
        self._c = p[1] - 1 if p[2] else p[1]           # the next compressed byte to fetch
        self._fed_from, self._fed = self._c, 0         # the byte the inflate's input starts at; its bytes so far
        self._carry: int | None = None
        self._d = jsonl_index.raw_inflater(window)

    def _next_member(self) -> None:
        """At a member's end where the index has no point: the next member's header is found after the 8-byte
        trailer (its byte known to within one where the input was shifted: the deflate data ends inside a byte),
        and the inflate starts again after it."""
        used = self._fed - len(self._d.unconsumed_tail) - len(self._d.unused_data)
        first = self._fed_from + used                  # the trailer's start, or (shifted) the byte before it
        if first + 8 + 10 > self.size:
            raise WrongBytes(f"the gzip data ends at text byte {self.made}, before the piece's end")
        head = self.fetch(first + 8, min(self.size, first + 8 + 1 + 1024))
        for k in ((0, 1) if self._shift else (0,)):
            if head[k:k + 3] == b"\x1f\x8b\x08":
                break
        else:
            raise WrongBytes(f"the gzip data ends at text byte {self.made}, and no gzip member follows")
        try:
            length = jsonl_index.gzip_header_length(head[k:], "")
        except SourceError:
            raise WrongBytes(f"the gzip member after text byte {self.made} has a header longer than 1 KiB, or none") \
                from None
        self._start([self.made, first + 8 + k + length, 0, ""])

    def more(self, c_end: int, want: int) -> bytes:
        """More text, at most ``want`` bytes (a piece's text ends where it asks: no copy to cut it there): the
        compressed bytes up to ``c_end`` at first, then INPUT_CHUNK at a time."""
        if self._d.eof:
            nxt = self._members.get(self.made)
            if nxt is None:
                self._next_member()
            else:
                self._start(nxt)
        data = self._d.unconsumed_tail        # input left over when the last call had made what it asked for
        if not data:
            if self._c >= self.size:
                raise WrongBytes(f"the gzip data ends at text byte {self.made}, before the piece's end")
            end = min(self.size, c_end if c_end > self._c else self._c + jsonl_index.INPUT_CHUNK)
            data = self.fetch(self._c, end)
            self._c += len(data)
            if self._shift and data:
                data, self._carry = _shifted(data, self._shift, self._carry)
            self._fed += len(data)
        try:
            out = self._d.decompress(data, want)
        except jsonl_index.INFLATE_ERRORS as e:
            raise WrongBytes(f"the gzip data does not inflate ({e})") from None
        self.made += len(out)
        return out


class _Compressed:
    """The compressed bytes of a file from an offset on, as a file object for zstandard's stream reader: a read
    fetches what it asks for, and at least up to ``hint`` (what the index says the next piece needs: one ranged
    read, not one per INPUT_CHUNK)."""

    def __init__(self, fetch: Callable[[int, int], bytes], at: int, size: int):
        self.fetch, self.at, self.size, self.hint = fetch, at, size, 0

    def read(self, n: int = -1) -> bytes:
        if self.at >= self.size:
            return b""
        end = min(self.size, max(self.at + max(n, 1), self.hint))
        data = self.fetch(self.at, end)
        self.at += len(data)
        return data


class _Text:
    """The decompressed text of one file from an access point on, handed out piece by piece (``upto``) or skipped
    (``skip``: decompressed into a scratch buffer and dropped, never parsed)."""

    def __init__(self, entry: dict, point: int, fetch: Callable[[int, int], bytes], budget=None):
        self.entry, self.fetch = entry, fetch
        self.kind = entry["compression"]
        if self.kind == "none":
            return
        p = entry["points"][point]
        self.u = p[0]
        self._rest = b""                   # (gzip) text inflated past what was handed out
        self._ranges = _Ranges(fetch, budget)
        fetch = self._ranges.fetch
        if self.kind == "zstd":
            import zstandard

            self._source = _Compressed(fetch, p[1], entry["size"])
            # its read_size: what each fetch past the index's hint asks for
            self._reader = zstandard.ZstdDecompressor().stream_reader(
                self._source, read_size=jsonl_index.INPUT_CHUNK, read_across_frames=True, closefd=False)
        else:
            self._inflate = _Inflate(entry, point, fetch)

    def _zstd_into(self, out: memoryview, u_end: int, c_end: int) -> None:
        """Fill ``out`` with the next text (exactly its length)."""
        import zstandard

        self._source.hint = c_end
        got = 0
        try:
            while got < len(out):
                n = self._reader.readinto(out[got:])
                if not n:
                    raise WrongBytes(f"the zstd data ends at text byte {self.u + got}, the index says {u_end}")
                got += n
        except zstandard.ZstdError as e:       # bytes that are not the index's
            raise WrongBytes(f"the zstd data does not decompress ({e})") from None

    def upto(self, u_end: int, c_end: int, ends_ahead: list[int] | None = None) -> bytes | bytearray:
        """The text from where the last call ended (the point's offset at first) to ``u_end``; the compressed
        bytes fetched go up to ``c_end`` (what the index says suffices), then a little more at a time if not.
        ``ends_ahead``: the next pieces' compressed ends, whose bytes are fetched meanwhile."""
        n = u_end - self.u
        for start, end in zip([c_end, *(ends_ahead or [])], ends_ahead or []):
            self._ranges.ahead(start, end)
        if self.kind == "zstd":
            out = bytearray(n)                 # decompressed into its place: no copy
            self._zstd_into(memoryview(out), u_end, c_end)
        else:
            parts, have = ([self._rest] if self._rest else []), len(self._rest)
            while have < n:
                more = self._inflate.more(c_end, n - have)
                parts.append(more)
                have += len(more)
            joined = parts[0] if len(parts) == 1 else b"".join(parts)
            out, self._rest = (joined, b"") if have == n else (joined[:n], joined[n:])
        self.u = u_end
        return out

    def skip(self, u_end: int, c_end: int) -> None:
        """Go on to text byte ``u_end``, decompressing what comes before it and dropping it."""
        if self.kind != "zstd":
            self.upto(u_end, c_end)
            return
        scratch = memoryview(bytearray(min(u_end - self.u, 4 << 20)))
        while self.u < u_end:
            part = scratch[:min(len(scratch), u_end - self.u)]
            self._zstd_into(part, u_end, c_end)
            self.u += len(part)

    def close(self) -> None:
        if self.kind != "none":
            self._ranges.close()


@dataclass
class _Reading:
    """A shard being read: its next piece and the text decoder standing there (what a fetch ahead hands the
    reader with its first table, so that a one-frame file is never decompressed twice)."""

    shard: int
    piece: int                  # the next piece (index in the file's pieces)
    text: _Text | None
    table: pa.Table | None = None
    first_row: int = 0          # the shard's row the table starts at

    @property
    def nbytes(self) -> int:
        return self.table.nbytes if self.table is not None else 0

    @property
    def num_rows(self) -> int:
        return self.table.num_rows if self.table is not None else 0


# ------------------------------------------------------------------------------ the source
class JsonLinesSource(FetchesAhead):
    """Indexed JSON-lines files: one shard per run of pieces read from one access point (picklable)."""

    exact_rows = True       # a shard's rows are the index's count, checked against what each piece parses to

    def __init__(self, spec: SourceSpec, index: dict, retry: RetryPolicy, footers: dict | None = None):
        self.index = index
        self._files = index["files"]
        self._retry = retry if retry.remote else None
        self._rows = jsonl_rows.Blocks(index["features"])
        # features the lines way makes (jsonl_rows): a piece is handed on as its lines, parsed as they are used
        self._features_json = json.dumps(index["features"], separators=(",", ":")).encode()
        self._lines = jsonl_rows.Conformer(index["features"]).fast
        runs = []                       # (file, first piece, end piece, rows before each piece in the shard)
        for f, entry in enumerate(self._files):
            pieces = entry["pieces"]
            cuts = [*jsonl_index.shard_cuts(pieces, entry["compression"]), len(pieces)]
            for a, b in zip(cuts, cuts[1:]):
                if a < b:
                    runs.append((f, a, b))
        self._runs = runs
        self._before: dict[int, list[int]] = {}
        self.shards = shards_of_runs(self._files, runs,
                                     lambda r: sum(p[0] for p in self._files[r[0]]["pieces"][r[1]:r[2]]))
        self.fingerprint = dataset_fingerprint(spec, index["builder"],
                                               [identity_of(f, JsonLinesReader.layout_keys) for f in self._files],
                                               self.shards)
        self.column_names = list(index["features"])
        self._fetch_ahead(self._fetch_shard, prefetch_depth(spec.read, retry.remote), spec.read.prefetch_memory_mb,
                          self._shard_bytes, remote=retry.remote, decoded=self._shard_text,
                          first_depth=spec.read.interleave_shards,
                          # a local piece's fetch is mostly its decode (inflating a .gz piece: ~50-100 ms, reading
                          # it: ~2 ms) on the prefetch threads: the depth covers the whole fetch
                          whole_call=not retry.remote)

    # ------------------------------------------------------------------ where rows are
    def _offsets(self, shard: int) -> list[int]:
        """Rows of the shard before each of its pieces (and its total)."""
        known = self._before.get(shard)
        if known is None:
            f, a, b = self._runs[shard]
            known = self._before[shard] = [0, *accumulate(p[0] for p in self._files[f]["pieces"][a:b])]
        return known

    def _locate(self, shard: int, row: int) -> tuple[int, int]:
        """(piece, row inside it) of the shard's row ``row``."""
        _, a, _ = self._runs[shard]
        before = self._offsets(shard)
        k = bisect.bisect_right(before, row) - 1
        return a + k, row - before[k]

    # ------------------------------------------------------------------ prefetch
    def _shard_bytes(self, shard: int) -> int:
        """The compressed bytes a fetch ahead of ``shard`` transfers: its first piece's, from its access point."""
        f, a, _ = self._runs[shard]
        entry = self._files[f]
        piece, _ = self._locate(shard, min(self._starts.get(shard, 0), self.shards[shard].num_rows - 1))
        p = entry["pieces"][piece]
        if entry["compression"] == "none":
            return p[2] - p[1]
        return p[5] - entry["points"][p[4]][1]

    def _shard_text(self, shard: int) -> int:
        """What a fetch ahead of ``shard`` holds once decoded: its first piece's text and a line offset per row."""
        f, _, _ = self._runs[shard]
        piece, _ = self._locate(shard, min(self._starts.get(shard, 0), self.shards[shard].num_rows - 1))
        rows, start, end = self._files[f]["pieces"][piece][:3]
        return end - start + 24 * rows

    def _fetch_shard(self, shard: int) -> _Reading:
        start = min(self._starts.get(shard, 0), max(0, self.shards[shard].num_rows - 1))
        reading = self._open(shard, start)
        record_row_group(reading.num_rows)
        return reading

    # ------------------------------------------------------------------ reading
    def _open(self, shard: int, row: int) -> _Reading:
        """The shard read from row ``row``: the table of the rest of that row's piece, and where to go on."""
        f, a, b = self._runs[shard]
        entry = self._files[f]
        piece, inside = self._locate(shard, row)
        first_row = row
        path = entry["path"]

        def attempt() -> _Reading:
            text = None
            if entry["compression"] != "none":
                text = _Text(entry, entry["pieces"][a][4], fetcher(path, self._retry, entry), self._prefetch)
                if piece > a:          # decompress and skip the pieces before the row's: nothing of them parsed
                    prev = entry["pieces"][piece - 1]
                    text.skip(entry["pieces"][piece][1], prev[5])
            reading = _Reading(shard, piece, text)
            # the next piece's bytes are asked for now: they come while this one decodes and the reader takes it
            reading.table = self._piece_table(entry, reading, inside, b)
            reading.first_row = first_row
            return reading

        for tries in range(2):
            try:
                return attempt()
            except WrongBytes as e:
                if tries == 0:
                    log.warning("data file %r (shard %d): %s; reading it once more from the source", path, shard, e)
                    record_retry("wrong_bytes")
                    continue
                raise StreamMismatchError(
                    f"data file {path!r} (shard {shard}): {e}, on two reads; the file changed since the dataset "
                    "index was made, or the server answers with other bytes (rebuild the index if it changed)",
                    [(f"file modified: {path} (text)", "the index's CRC-32", "other bytes")]) from None
        raise AssertionError("unreachable")

    def _piece_table(self, entry: dict, reading: _Reading, inside: int, ahead_to: int = 0) -> pa.Table:
        """The next piece's rows from its row ``inside`` on (its text checked first); moves ``reading`` on. With
        ``ahead_to`` (the shard's end piece), the next pieces' compressed bytes are fetched meanwhile."""
        rows, start, end, crc, _, cend = entry["pieces"][reading.piece]
        if reading.text is None:
            text = fetcher(entry["path"], self._retry, entry)(start, end)
        else:
            text = reading.text.upto(end, cend, self._ends_ahead(entry, reading.piece, ahead_to))
            if reading.text.u - len(text) != start:    # text of the piece starts at its first row
                text = text[start - (reading.text.u - len(text)):]
        if jsonl_index.crc32(text) != crc:
            raise WrongBytes(f"the text of rows {rows} at bytes {start}-{end} does not match the index's CRC-32")
        lo = jsonl_index.skip_rows(text, 0, inside) if inside else 0
        piece = reading.piece
        path = entry["path"]
        row0 = sum(p[0] for p in entry["pieces"][:piece]) + inside

        def where(i: int) -> str:
            return f"data file {path!r}: row {row0 + i} (line of bytes from {start + lo}.. of the text)"

        offsets = jsonl_rows.row_starts(text, lo, rows - inside) if self._lines else None
        if offsets is not None:
            table = jsonl_rows.lines_table(text, offsets, path, row0, self._features_json)
        elif self._lines:
            raise WrongBytes(f"the text of bytes {start}-{end} does not hold the {rows} rows the index says")
        else:
            table = self._rows.table(text, lo, rows - inside, where)
        reading.piece += 1
        return table

    @staticmethod
    def _ends_ahead(entry: dict, piece: int, end_piece: int) -> list[int]:
        """The compressed ends of the READAHEAD_PIECES pieces after ``piece`` (before ``end_piece``) whose bytes end
        further on than the one before (pieces may end in the same input chunk)."""
        pieces, ends = entry["pieces"], [entry["pieces"][piece][5]]
        for k in range(piece + 1, end_piece):
            if pieces[k][5] > ends[-1]:
                ends.append(pieces[k][5])
                if len(ends) > READAHEAD_PIECES:
                    break
        return ends[1:]

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        info = self.shards[shard]
        if start_row >= (info.num_rows or 0):
            return
        reading = self._first(shard, start_row)
        f, _, b = self._runs[shard]
        entry = self._files[f]
        ahead = None
        try:
            table, at = reading.table, reading.first_row
            if at < start_row:
                table = table.slice(start_row - at)
            # the next piece (a one-frame file's shard holds many) is decoded on a worker thread meanwhile
            if reading.piece < b:
                ahead = decoder_pool().submit(self._checked_next, shard, entry, reading)
            yield table
            while ahead is not None:
                table = ahead.result()
                ahead = decoder_pool().submit(self._checked_next, shard, entry, reading) if reading.piece < b else None
                yield table
        finally:
            if ahead is not None and not ahead.cancel():
                try:
                    ahead.result()
                except Exception:      # noqa: BLE001 - a piece nobody reads
                    pass
            if reading.text is not None:
                reading.text.close()

    def _checked_next(self, shard: int, entry: dict, reading: _Reading) -> pa.Table:
        """The next piece's table; a piece whose text fails its check is read again from the shard's point."""
        piece = reading.piece
        try:
            return self._piece_table(entry, reading, 0, self._runs[shard][2])
        except WrongBytes as e:
            log.warning("data file %r: %s; reading it once more from the source", entry["path"], e)
        if reading.text is not None:
            reading.text.close()
        rows_before = self._offsets(shard)[piece - self._runs[shard][1]]
        again = self._open(shard, rows_before)
        reading.piece, reading.text = again.piece, again.text
        return again.table

    def _first(self, shard: int, start_row: int) -> _Reading:
        ahead = self._taken(shard)
        if ahead is not None and ahead.first_row <= start_row < ahead.first_row + ahead.num_rows:
            return ahead
        if ahead is not None and ahead.text is not None:
            ahead.text.close()                          # not the row asked for: what it fetched ahead is dropped
        return self._opened(shard, start_row, self._open)


class JsonLinesReader(ScannedReader):
    """The registry's jsonl entry (``config/formats.py``): JSON-lines files indexed by :mod:`.jsonl_index`."""

    # the compression, the decompressed length, rows, pieces and points, the cut rule: layout, not identity
    layout_keys = ("compression", "length", "rows", "pieces", "points", "shard_rule")
    # the CRCs of a local file's first and last 64 KiB, re-read on resume (a remote one has none: its ETag vouches)
    content_keys = ("head",)
    index_reads_files = True

    scan = staticmethod(index_file)

    def infer_features(self, spec: SourceSpec, entry: dict, footer: bytes | None, retry: RetryPolicy | None):
        return infer_features(spec, entry, retry)

    def features_ahead(self, spec: SourceSpec, path: str, retry: RetryPolicy | None):
        """The json builder's inference on the first file, on a thread while the files are indexed."""
        from concurrent.futures import ThreadPoolExecutor

        import tqdm

        # datasets' thread_map enters tqdm's ensure_lock even with its bar off, and deletes the class's lock after a
        # call that found none: two threads in it at once (this one and the caller's) race to delete one lock
        # ("type object 'tqdm' has no attribute '_lock'", seen in a fresh LLaMA-Factory process). A lock made
        # here, before the thread, is found and kept by both.
        tqdm.tqdm.get_lock()
        pool = ThreadPoolExecutor(1, thread_name_prefix="rs-features")
        try:
            return _FeaturesAhead(pool.submit(builder_features, path, retry), path, retry)
        finally:
            pool.shutdown(wait=False)

    def entry_problem(self, entry: dict) -> str | None:
        problem = jsonl_index.entry_problem(entry)
        if problem is None and not isinstance(entry.get("head", ""), str):
            return "a JSON-lines entry whose 'head' is no string"
        return problem

    def local_check(self, path: str, identity: dict, retry: RetryPolicy | None, entry: dict) -> dict:
        try:
            return {"head": head_digest(path, identity["size"], fetcher(path, None, identity, "to check it"))}
        except (OSError, SourceError, StreamMismatchError) as e:
            return {"head": f"unreadable ({type(e).__name__}: {e})"}

    def indexable(self, builder: Any) -> bool:
        """JSON lines read whole: no ``field``, utf-8, no features or encoding of the user's."""
        config = builder.config
        return (getattr(config, "field", None) is None and getattr(config, "encoding", "utf-8") == "utf-8"
                and getattr(config, "encoding_errors", None) is None and getattr(config, "features", None) is None)

    def reads_files(self, files: list[str]) -> bool:
        """Every file's compression is one we index (none, .gz, .zst)."""
        return all(jsonl_index.compression_of(f) is not None for f in files)

    def open_indexed(self, spec: SourceSpec, index: dict, retry: RetryPolicy,
                     footers: dict[str, bytes] | None = None) -> JsonLinesSource:
        return JsonLinesSource(spec, index, retry, footers)


READER = JsonLinesReader()
