"""One sequential pass over a WebDataset tar: which samples it holds and where their bytes are.

Samples are grouped as ``datasets``' webdataset builder groups them (its ``base_plus_ext``; directories, links,
hidden and suffix-less names left out); per member the index keeps its suffix, data offset and size, and a
reader checks the ustar header before each member's data again. Member names are only ever strings, never
paths. ``tarfile`` parses the headers over a forward-only reader that refuses any read over
``MAX_HEADER_READ`` (a forged extended header sizes no allocation and cannot feed tarfile's pax parser more than
it parses quickly); a sparse member is marked ``SPARSE``: a bad sample, never read (docs/webdataset.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Callable
from typing import Any

from ..errors import IncompleteFileError, SourceError
from ..limits import is_int
from .base import SeekableFile

BLOCK = tarfile.BLOCKSIZE
# The longest extended header (pax records, a GNU long name) we read: real ones are a few hundred bytes, a
# name of PATH_MAX (4096) fits. tarfile's pax parser is quadratic before CPython 3.11.10 / 3.12.6: on 3.11.7 a
# forged 8 KiB header takes 0.1-0.2 s (0.4 s after a global header naming GNU.sparse.size), 256 KiB 111 s
# (docs/webdataset.md has the measurement).
MAX_HEADER_READ = 8 << 10
# The mark of a sparse member in the index (a fourth field): its stored bytes are not its content.
SPARSE = "sparse"
# Bytes per ranged read while scanning a remote tar.
SCAN_CHUNK = 8 << 20
# A shard is a run of consecutive samples of one tar, cut at whichever comes first: a read unit like a
# parquet row group (one ranged read of ~16 MiB), and few enough samples that one window re-reads little.
SHARD_MAX_BYTES = 16 << 20
SHARD_MAX_SAMPLES = 4096
SHARD_RULE = {"max_bytes": SHARD_MAX_BYTES, "max_samples": SHARD_MAX_SAMPLES}

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")     # datasets' (webdataset's) base_plus_ext


def base_plus_ext(name: str) -> tuple[str | None, str | None]:
    """(key, suffix) of a member name as the webdataset builder splits it; (None, None) when it has none.
    The suffix holds no ``/``, so a name whose last part has no ``.`` has none: answered before the pattern,
    which backtracks quadratically over such a name (a pax name of ~1 MiB of ``a/a/...`` took hours)."""
    if "." not in name[name.rfind("/") + 1:]:
        return None, None
    m = _KEY.match(name)
    return (m.group(1), m.group(2)) if m else (None, None)


class _Forward(SeekableFile):
    """What ``tarfile`` reads a tar through: forward only, each read bounded, bytes from ``fetch(start, end)``
    in chunks of ``chunk`` (a local file: its own reads and seeks)."""

    def __init__(self, path: str, size: int, fetch: Callable[[int, int], bytes], chunk: int):
        super().__init__()
        self.path, self.size, self._fetch, self._chunk = path, size, fetch, chunk
        self._lo, self._data = 0, b""
        self.ended = False        # a read came up short: the file ends before what tarfile asked for

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = super().seek(offset, whence)
        if target < self._lo:
            raise SourceError(f"data file {self.path!r}: malformed tar (a header points back to byte {target})")
        return target

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > MAX_HEADER_READ:
            raise SourceError(f"data file {self.path!r}: malformed tar header at byte {self.pos} (an extended "
                              f"header of {n} bytes; at most {MAX_HEADER_READ} are read)")
        out = b""
        while n > 0 and self.pos < self.size:
            if not (self._lo <= self.pos < self._lo + len(self._data)):
                self._lo = self.pos - self.pos % self._chunk
                self._data = self._fetch(self._lo, min(self.size, self._lo + self._chunk))
                if not self._data:
                    break
            piece = self._data[self.pos - self._lo:self.pos - self._lo + n]
            out += piece
            self.pos += len(piece)
            n -= len(piece)
        self.ended = self.ended or n > 0
        return out


def scan_tar(path: str, size: int, fetch: Callable[[int, int], bytes], chunk: int = SCAN_CHUNK,
             whole: bool = False) -> list[list]:
    """The samples of the tar at ``path`` of ``size`` bytes: ``[key, [[suffix, data offset, size], ...]]`` in
    file order (a sparse member: ``[suffix, data offset, bytes stored, SPARSE]``). Raises SourceError naming the
    file for a malformed or compressed tar, or a duplicate member. A tar cut short inside a member gives the
    samples up to that one (its size runs past the end: a bad sample). ``whole``: a tar that is not complete
    (cut inside a member or a header, or without its two end-of-archive blocks: still being written) raises
    IncompleteFileError instead."""
    reader = _Forward(path, size, fetch, chunk)
    samples: list[list] = []

    def incomplete(why: str) -> IncompleteFileError:
        return IncompleteFileError(f"data file {path!r}: not a complete tar ({why}; a tar being written is "
                                   "complete once it ends with two zero blocks)")

    try:
        tar = tarfile.open(fileobj=reader, mode="r:")        # "r:": uncompressed only (ranged reads need it)
        for info in tar:
            tar.members = []                                 # one pass: keep nothing of what tarfile saw
            # tar.offset: where tarfile reads the next header; behind the data (a negative size) it reads the
            # same headers again, for ever
            if info.size < 0 or tar.offset < info.offset_data:
                raise SourceError(f"data file {path!r}: malformed tar header at byte {info.offset} (a member of "
                                  f"{info.size} bytes, the next header at byte {tar.offset}; allowed: a size "
                                  "of 0 or more, the next header after the member's data)")
            # a sparse member's size is the file's, holes included; the tar stores less: up to the next header
            stored = tar.offset - info.offset_data if info.issparse() else info.size
            if whole and tar.offset > size:
                raise incomplete(f"member {info.name[:200]!r} is cut short by the end of the file at byte {size}")
            cut = info.offset_data + stored > size
            if not info.isreg() or info.name.rsplit("/", 1)[-1].startswith((".", "__")):
                continue
            key, suffix = base_plus_ext(info.name)
            if key is None:
                continue
            member = [suffix, info.offset_data, stored, *([SPARSE] if info.issparse() else [])]
            if samples and samples[-1][0] == key:
                if any(m[0] == suffix for m in samples[-1][1]):
                    raise SourceError(f"data file {path!r}: member {info.name!r} appears twice in sample {key!r} "
                                      "(datasets' webdataset builder refuses it too)")
                samples[-1][1].append(member)
            else:
                samples.append([key, [member]])
            if cut:
                return samples                               # a truncated last member: nothing after it
        # tarfile ends an archive quietly at a header it cannot parse: only zero blocks (or nothing) may follow
        reader.seek(tar.offset)
        last = reader.read(BLOCK)
        if last.strip(b"\0"):
            if whole and reader.ended:
                raise incomplete(f"it ends inside a header at byte {tar.offset}")
            raise SourceError(f"data file {path!r}: malformed tar header at byte {tar.offset} (not a tar "
                              "header, and not the end of the archive)")
        if whole and last + reader.read(BLOCK) != bytes(2 * BLOCK):
            raise incomplete(f"no end-of-archive blocks after its last member, at byte {tar.offset}")
    except SourceError:
        raise
    except (tarfile.TarError, EOFError, ValueError, UnicodeError, RecursionError) as e:
        if whole and reader.ended:
            raise incomplete(f"it ends at byte {size}, inside a header or a member") from None
        if not samples and isinstance(e, tarfile.ReadError) and reader.tell() <= BLOCK:
            raise SourceError(f"data file {path!r}: not an uncompressed tar ({e}); WebDataset shards are read "
                              "by byte ranges, so .tar.gz and other compressed archives are not indexed") from None
        raise SourceError(f"data file {path!r}: malformed tar near byte {reader.tell()} "
                          f"({type(e).__name__}: {e})") from None
    return samples


def cut_shards(samples: list[list]) -> list[int]:
    """The first sample of each shard (SHARD_RULE)."""
    starts: list[int] = []
    size = count = 0
    for i, (_, members) in enumerate(samples):
        if not starts or count >= SHARD_MAX_SAMPLES or size >= SHARD_MAX_BYTES:
            starts.append(i)
            size = count = 0
        count += 1
        size += sum(m[2] for m in members)
    return starts


def layout_digest(samples: list[list]) -> str:
    return hashlib.blake2b(json.dumps(samples, separators=(",", ":")).encode(), digest_size=16).hexdigest()


def tar_entry(identity: dict, samples: list[list]) -> dict[str, Any]:
    """An index entry: the file's identity plus its layout digest, samples and shard cuts."""
    return {**identity, "layout": layout_digest(samples), "samples": samples, "shards": cut_shards(samples),
            "shard_rule": dict(SHARD_RULE)}


def entry_problem(entry: Any) -> str | None:
    """What is wrong with the shape of a tar entry of an index (None: nothing). Offsets must rise through the
    file and stay inside it, so a forged index cannot make a reader fetch outside a member's bytes."""
    if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and is_int(entry.get("size"))
            and isinstance(entry.get("layout"), str) and isinstance(entry.get("samples"), list)
            and isinstance(entry.get("shards"), list) and isinstance(entry.get("shard_rule"), dict)):
        return "not a tar entry (path, size, layout, samples, shards, shard_rule)"
    last = 0
    for sample in entry["samples"]:
        if not (isinstance(sample, list) and len(sample) == 2 and isinstance(sample[0], str)
                and isinstance(sample[1], list) and sample[1]):
            return "a sample is not [key, members]"
        for m in sample[1]:
            if not (isinstance(m, list) and (len(m) == 3 or len(m) == 4 and m[3] == SPARSE)
                    and isinstance(m[0], str) and is_int(m[1], BLOCK)
                    and is_int(m[2], 0) and m[1] >= last + BLOCK and m[1] <= entry["size"]):
                return (f"a member of sample {sample[0][:80]!r} is not [suffix, offset, size] (or [..., "
                        f"{SPARSE!r}]) rising in the file")
            last = m[1] + m[2]
    shards = entry["shards"]
    if entry["samples"] and not (shards and shards[0] == 0 and all(is_int(s) for s in shards)
                                 and all(a < b for a, b in zip(shards, shards[1:]))
                                 and shards[-1] < len(entry["samples"])):
        return "'shards' are not rising sample numbers from 0"
    if not entry["samples"] and shards:
        return "'shards' of a tar without samples"
    # a shard is one read held in memory: no bigger than SHARD_RULE cuts them (a forged index could say one)
    cuts = [*shards, len(entry["samples"])]
    for a, b in zip(cuts, cuts[1:]):
        held = sum(m[2] for _, members in entry["samples"][a:b - 1] for m in members)
        if b - a > SHARD_MAX_SAMPLES or held >= SHARD_MAX_BYTES:
            return (f"the shard from sample {a} holds {b - a} samples, {held} bytes before its last; allowed: at "
                    f"most {SHARD_MAX_SAMPLES} samples and under {SHARD_MAX_BYTES} bytes before the last")
    return None


def header_problem(block: bytes, size: int) -> str | None:
    """Why ``block`` is not the ustar header of a regular member of ``size`` bytes (None: it is)."""
    try:
        info = tarfile.TarInfo.frombuf(bytes(block), "utf-8", "surrogateescape")
    except tarfile.TarError as e:
        return f"no tar header ({e})"
    if not info.isreg() or info.size != size:
        return f"a header of {info.size} bytes where the index has {size}"
    return None
