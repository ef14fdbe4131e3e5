"""Stream state <-> safetensors sidecar files, written atomically; per-checkpoint manifest.

Layout of a checkpoint's stream state::

    checkpoint-N/stream_state/rank-00000.safetensors
    checkpoint-N/stream_state/rank-00001.safetensors
    checkpoint-N/stream_state/manifest.json   (written last, by rank 0: without it the state is incomplete)

Tensors hold the integer cursors and digest chains; ``__metadata__`` holds JSON strings
(format version, kind, fingerprint, topology with ``num_partitions``, per-partition sample digests and
epoch progress for ``inspect``). No pickle anywhere. After a change of ranks or workers
(``data.elastic``) a rank reads the files of the ranks that held its virtual partitions.

Format version 2 has one schema per kind of stream (metadata ``kind``), rows aligned with the tensor
``partition_ids``:

* ``stream``: a cursor per partition: ``cursors`` (one column per ``Cursor.FIELDS``), ``slots`` (open
  shards), ``chains`` (digest of the keys consumed), metadata ``digests`` and ``progress`` per partition;
* ``mixture``: the mixture's own position, ``mixture/positions`` (epoch, draws, consumed),
  ``mixture/source_epochs`` and ``mixture/ended`` (one column per source), plus source i's cursors
  under ``sources/<i>/`` with the same tensors and metadata as a stream's.

Both: a transform's carry per partition under ``extra/<partition>/<name>`` (metadata ``extra``), the
main process's ``turn`` and, when a DataLoader lane interleaves partitions, ``lane_turns``. Version 1
files (a mixture squeezed into stream cursors) are read by :mod:`resumable_stream.state.sidecar_v1`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ..errors import SidecarError
from ..io.safe_files import FileRefused, JSONRefused, atomic_write, parse_json, read_regular_file
from ..limits import (
    MAX_GENERATION,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_OPEN_SHARDS,
    MAX_PARTITIONS,
    MAX_SIDECAR_BYTES,
    MAX_WORLD_SIZE,
    is_int,
)
from .fields import is_hex as _is_hex
from .fields import json_field as _json_field
from .fields import require as _require
from .fields import tensor as _tensor
from .mixture_state import MixturePartitionState
from .partition_state import Cursor, PartitionState
from .sidecar_v1 import V1_CURSOR_FIELDS, check_v1_partition_ids, mixture_from_v1

FORMAT = "resumable-stream"
FORMAT_VERSION = 3
# The format versions this release reads: every one ever written. A sidecar's metadata holds it as a string,
# a manifest as an integer (each exactly so: another type is not a version).
READ_VERSIONS = (1, 2, 3)
KINDS = ("stream", "mixture")
STATE_TYPES = {"stream": PartitionState, "mixture": MixturePartitionState}   # a partition's state, by kind
MANIFEST = "manifest.json"
INDEX = "index.json"         # the dataset index, written by rank 0 next to the rank files
FINGERPRINT = "fingerprint.json"   # the dataset fingerprint of every rank file, written once by rank 0
STATE_DIR = "stream_state"
# generations up to MAX_GENERATION (9 digits), ranks below MAX_WORLD_SIZE (5 digits)
_RANK_FILE = re.compile(r"^rank-(\d{5})(?:\.g[1-9]\d{0,8})?\.safetensors$")
_INDEX_FILE = re.compile(r"^index(?:\.g[1-9]\d{0,8})?\.json$")
_FINGERPRINT_FILE = re.compile(r"^fingerprint(?:\.g[1-9]\d{0,8})?\.json$")
# what a manifest may list beside the rank files: one file of each, confined to the state directory
SHARED_FILES = {"index": (INDEX, _INDEX_FILE), "fingerprint": (FINGERPRINT, _FINGERPRINT_FILE)}
# a mixture's: one dataset index per source, ``index-<label>.json`` (generation N: ``index.gN-<label>.json``, the
# generation before the label so that a label with dots never reads as one), listed under the manifest's
# ``indexes`` by label. Labels are config.py's (letters, digits, _ . -): never a path.
_SOURCE_INDEX_FILE = re.compile(r"^index(?:\.g([1-9]\d{0,8}))?-([A-Za-z0-9_.-]{1,64})\.json$")


def rank_file_name(rank: int, generation: int = 0) -> str:
    """``rank``'s sidecar in a stream_state directory; generations after the first save into the same
    directory get their own names (see :func:`write_manifest`)."""
    return f"rank-{rank:05d}.safetensors" if generation == 0 else f"rank-{rank:05d}.g{generation}.safetensors"


def rank_of_file_name(name: str) -> int | None:
    """The rank a sidecar's file name says (``rank-00001.safetensors``, ``rank-00001.g3.safetensors``: 1);
    None for any other name."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m else None


def index_file_name(generation: int = 0) -> str:
    """The dataset index saved with a generation of the state (rank 0 writes it before the manifest)."""
    return shared_file_name("index", generation)


def shared_file_name(what: str, generation: int = 0) -> str:
    """``index`` or ``fingerprint``: the file of a generation of the state that describes the dataset once for
    every rank (rank 0 writes it before the manifest)."""
    base = SHARED_FILES[what][0]
    return base if generation == 0 else f"{base[:-5]}.g{generation}.json"


def source_index_file_name(label: str, generation: int = 0) -> str:
    """The dataset index of mixture source ``label`` saved with a generation of the state (rank 0)."""
    return f"index-{label}.json" if generation == 0 else f"index.g{generation}-{label}.json"


def _source_index_files(state_dir: str, generation: int) -> dict[str, str]:
    """label -> file name of the mixture source indexes of ``generation`` in ``state_dir``."""
    out = {}
    for name in _listdir(state_dir):
        m = _SOURCE_INDEX_FILE.match(name)
        if m is not None and int(m.group(1) or 0) == generation:
            out[m.group(2)] = name
    return out


def fingerprint_bytes(fingerprint: dict[str, Any]) -> bytes:
    """The canonical bytes of a fingerprint: what ``fingerprint.json`` holds and its digest is taken of."""
    return json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------ atomic writes


# ------------------------------------------------------------------ encode
def encode_state(state: dict[str, Any], fingerprint_digest: str | None = None) -> bytes:
    """A state as sidecar bytes. With ``fingerprint_digest`` (a rank file of a stream_state directory, whose
    ``fingerprint.json`` holds the fingerprint once for every rank) only that digest is written, so the
    file is O(its partitions) however many files the dataset has; else the whole fingerprint."""
    kind = state.get("kind", "stream")
    parts = sorted(state["partitions"])
    states = [state["partitions"][p] for p in parts]
    tensors: dict[str, np.ndarray] = {"partition_ids": np.asarray(parts, dtype=np.int64)}
    metadata: dict[str, str] = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "kind": kind,
        "cursor_fields": json.dumps(list(Cursor.FIELDS)),
        "topology": json.dumps(state["topology"], sort_keys=True),
        "turn": str(state.get("turn", 0)),
    }
    if fingerprint_digest is None:
        metadata["fingerprint"] = fingerprint_bytes(state["fingerprint"]).decode()
    else:
        metadata["fingerprint_digest"] = fingerprint_digest
    state_type = STATE_TYPES[kind]
    states = [state_type.from_dict(ps, f"state of partition {p}") for p, ps in zip(parts, states)]
    state_type.to_arrays(parts, states, "", tensors, metadata)
    extra_meta = {}
    for p, ps in zip(parts, states):   # what a transform carries over (e.g. packed tokens), per partition
        extra = ps.extra
        if extra is not None:
            for name, arr in extra.get("tensors", {}).items():
                tensors[f"extra/{p}/{name}"] = np.ascontiguousarray(arr)
            extra_meta[str(p)] = {"meta": extra.get("meta", {}), "tensors": sorted(extra.get("tensors", {}))}
    metadata["extra"] = json.dumps(extra_meta, sort_keys=True)
    if state.get("lane_turns") is not None:   # only when a DataLoader lane interleaves several partitions
        metadata["lane_turns"] = json.dumps(list(state["lane_turns"]))
    metadata[SEAL_KEY] = _BLANK_SEAL
    return _seal(st_save(tensors, metadata=metadata))


# ------------------------------------------------------------------ decode
def _read_header_metadata(data: bytes, path: str) -> tuple[dict[str, str], int]:
    """(``__metadata__``, header length) of safetensors bytes, or a SidecarError naming the file."""
    if len(data) < 8:
        raise SidecarError(f"sidecar {path!r}: truncated ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise SidecarError(f"sidecar {path!r}: corrupt or truncated (header of {n} bytes, file of {len(data)})")
    if n > MAX_HEADER_BYTES:
        raise SidecarError(f"sidecar {path!r}: corrupt: header of {n} bytes; allowed: at most {MAX_HEADER_BYTES}")
    try:
        header = parse_json(data[8:8 + n])
    except JSONRefused as e:
        raise SidecarError(f"sidecar {path!r}: corrupt header ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SidecarError(f"sidecar {path!r}: no metadata; it was not written by resumable-stream")
    return meta, n


# ------------------------------------------------------------------ self-digest
# Every sidecar carries the blake2b of its own bytes (with this field's value zeroed) in its metadata, so a
# bare file (--resume-from FILE, data.resume_state_path: FILE) is verified like one under a manifest.
SEAL_KEY = "self_blake2b"
_BLANK_SEAL = "0" * 32
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def _seal_field(value: str) -> bytes:
    return f'"{SEAL_KEY}":"{value}"'.encode()   # safetensors writes its metadata as compact JSON


def _seal(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    i = data.index(_seal_field(_BLANK_SEAL), 8, 8 + n)
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    return data[:i] + _seal_field(digest) + data[i + len(_seal_field(digest)):]


def _check_seal(data: bytes, header_len: int, meta: dict[str, str], path: str) -> bool:
    """True when the file carries a self-digest and it matches; False when it has none (an older file)."""
    value = meta.get(SEAL_KEY)
    if value is None:
        return False
    header = data[8:8 + header_len]
    field = _seal_field(value)
    if not _HEX32.match(value) or header.count(field) != 1:
        raise SidecarError(f"sidecar {path!r}: corrupt (field {SEAL_KEY}: {value[:40]!r} is not its digest)")
    blank = data[:8] + header.replace(field, _seal_field(_BLANK_SEAL)) + data[8 + header_len:]
    if hashlib.blake2b(blank, digest_size=16).hexdigest() != value:
        raise SidecarError(f"sidecar {path!r}: corrupt: its bytes do not match its own digest ({SEAL_KEY}); the "
                           "file was damaged or modified after it was written")
    return True


# ------------------------------------------------------------------ field checks
def _check_topology(topology: Any, path: str) -> None:
    _require(isinstance(topology, dict), path, "topology", topology, "a mapping")
    w, n = topology.get("world_size"), topology.get("num_partitions")
    _require(is_int(w, 1, MAX_WORLD_SIZE), path, "topology.world_size", w, f"an integer from 1 to {MAX_WORLD_SIZE}")
    # as when it was written (plan.check_consumers): every rank and DataLoader worker reads a partition
    _require(is_int(n, w, MAX_PARTITIONS), path, "topology.num_partitions", n,
             f"an integer from {w} to {MAX_PARTITIONS} (at least world_size)")
    _require(is_int(topology.get("num_workers"), 0, n // w), path, "topology.num_workers", topology.get("num_workers"),
             f"an integer from 0 to {n // w} (ranks x workers must not exceed num_partitions {n})")
    rank = topology.get("rank")
    _require(rank is None or (is_int(rank) and rank < topology["world_size"]), path, "topology.rank", rank,
             f"null or an integer in [0, {topology['world_size']})")


def _decode_extra(ids: list[int], tensors: dict[str, np.ndarray], meta: dict[str, str], path: str) -> dict[int, dict]:
    """The transform's carry per partition (only partitions that have one)."""
    extra_meta = _json_field(meta, "extra", path, "{}")
    _require(isinstance(extra_meta, dict), path, "extra", extra_meta, "a mapping by partition")
    out = {}
    for p in ids:
        em = extra_meta.get(str(p))
        if em is None:
            continue
        ok = (isinstance(em, dict) and isinstance(em.get("meta"), dict) and isinstance(em.get("tensors"), list)
              and all(isinstance(n, str) for n in em["tensors"]))
        _require(ok, path, f"extra[{p}]", em, "a mapping with meta (a mapping) and tensors (a list of names)")
        missing = [n for n in em["tensors"] if f"extra/{p}/{n}" not in tensors]
        if missing:
            raise SidecarError(f"sidecar {path!r}: partition {p} lacks carried tensors {missing}")
        out[p] = {"meta": em["meta"], "tensors": {n: tensors[f"extra/{p}/{n}"] for n in em["tensors"]}}
    return out


def _mixture_labels(fingerprint: dict, path: str) -> list[str]:
    mixture = fingerprint.get("mixture")
    labels = mixture.get("labels") if isinstance(mixture, dict) else None
    _require(isinstance(labels, list) and len(labels) >= 1 and all(isinstance(x, str) for x in labels), path,
             "fingerprint.mixture.labels", labels, "a list of source labels")
    return labels


def _fingerprint_of(meta: dict[str, str], version: str, shared: tuple[dict[str, Any], str] | None,
                    path: str) -> dict[str, Any]:
    """A sidecar's dataset fingerprint: its own, or (a version 3 rank file) the one of its directory, which
    must have the digest the file recorded."""
    if "fingerprint_digest" not in meta:
        fingerprint = _json_field(meta, "fingerprint", path)
        _require(isinstance(fingerprint, dict), path, "fingerprint", fingerprint, "a mapping")
        return fingerprint
    digest = meta["fingerprint_digest"]
    _require(version not in ("1", "2") and _is_hex(digest, 32) and "fingerprint" not in meta, path,
             "fingerprint_digest", digest, "32 hex digits, in a version 3 file without a fingerprint of its own")
    if shared is None:
        raise SidecarError(f"sidecar {path!r}: a rank file of a stream_state directory: the dataset fingerprint it "
                           f"was saved with is in that directory's {FINGERPRINT} (listed in its {MANIFEST}), which "
                           "is not beside it; load the directory it was saved in, not the file alone")
    if shared[1] != digest:
        raise SidecarError(f"sidecar {path!r}: was saved with dataset fingerprint {digest}, its stream_state "
                           f"directory's {FINGERPRINT} is {shared[1]}: not one save's files")
    return shared[0]


def _check_rank_partitions(topology: dict[str, Any], count: int, path: str) -> None:
    """A rank's file holds that rank's partitions: num_partitions / world_size of them, rounded down or up
    (plan.partition_lanes), so a forged num_partitions cannot size what a load plans."""
    if topology.get("rank") is None:
        return
    n, w = topology["num_partitions"], topology["world_size"]
    low, high = n // w, -(-n // w)
    _require(count in (low, high), path, "tensor partition_ids", f"{count} partitions",
             f"the {low if low == high else f'{low} or {high}'} partitions of rank {topology['rank']} of {w} "
             f"over num_partitions {n}")


def decode_state(data: bytes, path: str = "<bytes>", verified: bool = False,
                 fingerprint: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """The state in sidecar bytes, every field checked. The file's self-digest must match; a file without
    one (written before it existed) is read only when ``verified`` (a manifest's digest covered it).
    ``fingerprint``: (fingerprint, digest) of the stream_state directory the file is in, for a rank file
    that holds only the digest. A version 1 or 2 file is returned in the current form."""
    meta, header_len = _read_header_metadata(data, path)
    if meta.get("format") != FORMAT:
        raise SidecarError(f"sidecar {path!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if version not in [str(v) for v in READ_VERSIONS]:
        raise SidecarError(f"sidecar {path!r}: format version {version!r}; this library reads versions "
                           f"{', '.join(repr(str(v)) for v in READ_VERSIONS)} (upgrade resumable-stream or resume "
                           "with the version that wrote it)")
    if not _check_seal(data, header_len, meta, path) and not verified:
        raise SidecarError(f"sidecar {path!r}: has no self-digest ({SEAL_KEY}), so it cannot be verified: it was "
                           "written by an earlier version of resumable-stream, or that field was damaged. Load it "
                           "through its stream_state or checkpoint directory (whose manifest.json verifies it)")
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors' own parse errors
        raise SidecarError(f"sidecar {path!r}: corrupt or truncated ({e})") from None
    fields = _json_field(meta, "cursor_fields", path)
    expected_fields = list(V1_CURSOR_FIELDS if version == "1" else Cursor.FIELDS)
    _require(fields == expected_fields, path, "cursor_fields", fields, str(expected_fields))
    shared = fingerprint
    if version == "1":     # its kind is told by its fingerprint (always its own)
        fingerprint = _fingerprint_of(meta, version, shared, path)
        kind = "mixture" if "mixture" in fingerprint else "stream"
    else:
        kind = meta.get("kind")
    _require(kind in KINDS, path, "kind", kind, " or ".join(KINDS))
    topology = _json_field(meta, "topology", path)
    _check_topology(topology, path)
    n, lanes = topology["num_partitions"], max(1, topology["num_workers"])
    # the rotations: over this rank's partitions, or its DataLoader lanes (each of at most n partitions)
    turn = _json_field(meta, "turn", path, "0")
    _require(is_int(turn, 0, n - 1), path, "turn", turn, f"an integer in [0, {n})")
    lane_turns = _json_field(meta, "lane_turns", path) if "lane_turns" in meta else None
    _require(lane_turns is None or (isinstance(lane_turns, list) and len(lane_turns) <= lanes), path,
             "lane_turns", lane_turns, f"a list of at most {lanes} (one per DataLoader lane)")
    _require(lane_turns is None or all(is_int(t, 0, n - 1) for t in lane_turns), path, "lane_turns", lane_turns,
             f"integers in [0, {n})")
    if version != "1":
        fingerprint = _fingerprint_of(meta, version, shared, path)
    sources = len(_mixture_labels(fingerprint, path)) if version == "1" and kind == "mixture" else 0
    ids_t = _tensor(tensors, "partition_ids", "int64", 1, path)
    # before the ids become a list: at most an entry per partition (and per source of one, version 1)
    _require(len(ids_t) <= n * (1 + sources), path, "tensor partition_ids", f"{len(ids_t)} entries",
             f"at most {n * (1 + sources)}")
    ids = ids_t.tolist()
    if version == "1":
        check_v1_partition_ids(ids, n, path)
        partitions = PartitionState.from_arrays(ids, tensors, meta, path, blank_digest_ok=kind == "mixture",
                                                max_slots=max(MAX_OPEN_SHARDS, sources))
        if kind == "mixture":
            partitions = mixture_from_v1(partitions, sources, path)
    else:
        _require(len(set(ids)) == len(ids) and all(0 <= p < n for p in ids), path, "tensor partition_ids", ids,
                 f"distinct partitions in [0, {n})")
        if kind == "stream":     # data.growth: follow saves "" as the next digest at the end of the known data
            dataset = fingerprint.get("dataset") if isinstance(fingerprint, dict) else None
            follows = isinstance(dataset, dict) and dataset.get("growth") == "follow"
            partitions = PartitionState.from_arrays(ids, tensors, meta, path, blank_digest_ok=follows)
        else:
            partitions = MixturePartitionState.from_arrays(ids, tensors, meta, path,
                                                           len(_mixture_labels(fingerprint, path)))
    _check_rank_partitions(topology, len(partitions), path)
    for p, extra in _decode_extra(ids, tensors, meta, path).items():
        if p in partitions:   # a carry is per (mixture) partition; version 1 wrote none for source entries
            partitions[p].extra = extra
    partitions = {p: ps.to_dict() for p, ps in partitions.items()}   # the public form, as state_dict() gives
    state = {"format_version": FORMAT_VERSION, "kind": kind, "fingerprint": fingerprint, "topology": topology,
             "turn": turn, "partitions": partitions, "file_format_version": int(version)}   # the last for inspect
    if lane_turns is not None:
        state["lane_turns"] = lane_turns
    return state


# ------------------------------------------------------------------ files and directories
def _read_bytes(path: str, what: str, max_bytes: int) -> bytes:
    try:
        return read_regular_file(path, max_bytes)
    except FileNotFoundError:
        raise SidecarError(f"{what} {path!r}: not found") from None
    except FileRefused as e:
        raise SidecarError(f"{what} {path!r}: refused: {e}") from None
    except OSError as e:
        raise SidecarError(f"{what} {path!r}: cannot be read ({e})") from None


def write_state_file(path: str, state: dict[str, Any]) -> str:
    atomic_write(path, encode_state(state))
    return path


def read_state_file(path: str) -> dict[str, Any]:
    """A sidecar file, verified by its self-digest. A rank file that holds only the digest of its dataset
    fingerprint takes the fingerprint from its stream_state directory (checked against the manifest there)."""
    data = _read_bytes(path, "sidecar", MAX_SIDECAR_BYTES)
    meta, _ = _read_header_metadata(data, path)
    shared = fingerprint_beside(path) if "fingerprint_digest" in meta else None
    return decode_state(data, path, fingerprint=shared)


def fingerprint_beside(path: str) -> tuple[dict[str, Any], str] | None:
    """The fingerprint of the stream_state directory a rank file is in, if the manifest there lists it."""
    state_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(os.path.join(state_dir, MANIFEST)):
        return None
    manifest = read_manifest(state_dir)
    if os.path.basename(path) not in {e.get("file", name) for name, e in manifest["files"].items()}:
        raise SidecarError(f"sidecar {path!r}: is not a file of the save its directory's {MANIFEST} describes (an "
                           "older or unfinished save); load the directory")
    return read_state_fingerprint(state_dir, manifest)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# A save into a directory that holds a state writes the next generation's rank files next to the current
# ones, then replaces manifest.json (one atomic rename) with one that names them, then removes the old
# files: a reader finds either the complete old or the complete new state, whenever the writer is killed.
def generation_of(state_dir: str) -> int:
    """The generation of the state in ``state_dir`` (-1: none, or its manifest does not load)."""
    if not os.path.exists(os.path.join(state_dir, MANIFEST)):
        return -1
    try:
        return read_manifest(state_dir).get("generation", 0)
    except SidecarError:
        return -1


def write_rank_file(state_dir: str, rank: int, state: dict[str, Any], fingerprint_digest: str | None = None) -> str:
    """This rank's sidecar for the next save into ``state_dir``; the save is complete once rank 0 wrote the
    manifest (:func:`write_manifest`) after every rank wrote its file. With ``fingerprint_digest`` the file
    holds only that digest: rank 0 writes the fingerprint once, as the generation's ``fingerprint.json``."""
    path = os.path.join(state_dir, rank_file_name(rank, generation_of(state_dir) + 1))
    atomic_write(path, encode_state(state, fingerprint_digest))
    return path


def write_manifest(state_dir: str, world_size: int) -> str:
    """Rank 0, after every rank wrote its file: record them all. Missing files are an error. Without any
    file of a new save, the current generation's manifest is written again."""
    generation = current = generation_of(state_dir)
    if current < 0 or any(os.path.lexists(os.path.join(state_dir, rank_file_name(r, current + 1)))
                          for r in range(world_size)):
        generation = current + 1
    files = {}
    for r in range(world_size):
        name = rank_file_name(r, generation)
        p = os.path.join(state_dir, name)
        if not os.path.isfile(p):
            raise SidecarError(f"stream state {state_dir!r}: {name} missing; cannot write the manifest")
        data = _read_bytes(p, "sidecar", MAX_SIDECAR_BYTES)
        files[rank_file_name(r)] = {"file": name, "bytes": len(data), "blake2b": _digest(data)}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world_size,
                "generation": generation, "files": files}
    for what in SHARED_FILES:   # the dataset's index and fingerprint saved with this generation: verified before use
        name = shared_file_name(what, generation)
        shared = os.path.join(state_dir, name)
        if os.path.isfile(shared):
            data = _read_bytes(shared, f"dataset {what}", MAX_INDEX_BYTES)
            manifest[what] = {"file": name, "bytes": len(data), "blake2b": _digest(data)}
    indexes = {}
    for label, name in sorted(_source_index_files(state_dir, generation).items()):   # a mixture's, per source
        data = _read_bytes(os.path.join(state_dir, name), f"dataset index of source {label!r}", MAX_INDEX_BYTES)
        indexes[label] = {"file": name, "bytes": len(data), "blake2b": _digest(data)}
    if indexes:
        manifest["indexes"] = indexes
    path = os.path.join(state_dir, MANIFEST)
    atomic_write(path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    current = ({e["file"] for e in files.values()} | {shared_file_name(w, generation) for w in SHARED_FILES}
               | {e["file"] for e in indexes.values()})
    for name in _listdir(state_dir):   # the previous generation (and files of a save that was cut short)
        if (_RANK_FILE.match(name) or any(rx.match(name) for _, rx in SHARED_FILES.values())
                or _SOURCE_INDEX_FILE.match(name)) and name not in current:
            try:
                os.unlink(os.path.join(state_dir, name))
            except OSError:
                pass
    return path


def _check_manifest_entry(name: str, entry: Any, path: str) -> None:
    ok = (isinstance(entry, dict) and is_int(entry.get("bytes"), 0, MAX_SIDECAR_BYTES)
          and _is_hex(entry.get("blake2b"), 32))
    if not ok:
        raise SidecarError(f"manifest {path!r}: corrupt field files[{name!r}]: got {entry!r:.80}; allowed: a mapping "
                           f"with bytes (an integer from 0 to {MAX_SIDECAR_BYTES}) and blake2b (32 hex digits)")
    file = entry.get("file", name)
    m = _RANK_FILE.match(file) if isinstance(file, str) else None
    if m is None or m.group(1) != _RANK_FILE.match(name).group(1):   # confined to this directory
        raise SidecarError(f"manifest {path!r}: corrupt field files[{name!r}].file: got {file!r:.80}; allowed: "
                           f"a file name like {name} or {name[:10]}.gN.safetensors in the same directory")


def read_manifest(state_dir: str) -> dict[str, Any]:
    path = os.path.join(state_dir, MANIFEST)
    if not os.path.lexists(path):
        raise SidecarError(f"stream state {state_dir!r}: no {MANIFEST}; the checkpoint was not completely written "
                           "and is not resumed from")
    try:
        manifest = parse_json(_read_bytes(path, "manifest", MAX_MANIFEST_BYTES))
    except JSONRefused as e:
        raise SidecarError(f"manifest {path!r}: corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SidecarError(f"manifest {path!r}: not a resumable-stream manifest")
    version = manifest.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:   # True and 2.0 are no version
        raise SidecarError(f"manifest {path!r}: format version {version!r:.40}; this library reads versions "
                           f"{', '.join(map(str, READ_VERSIONS))} (upgrade resumable-stream or resume with the "
                           "version that wrote it)")
    world_size, files = manifest.get("world_size"), manifest.get("files")
    if not is_int(world_size, 1, MAX_WORLD_SIZE):
        raise SidecarError(f"manifest {path!r}: corrupt field world_size: got {world_size!r:.80}; allowed: an "
                           f"integer from 1 to {MAX_WORLD_SIZE}")
    if not is_int(manifest.get("generation", 0), 0, MAX_GENERATION):
        raise SidecarError(f"manifest {path!r}: corrupt field generation: got {manifest['generation']!r:.80}; "
                           f"allowed: an integer from 0 to {MAX_GENERATION}")
    # the entries are counted before the names of world_size ranks are made
    if not isinstance(files, dict) or len(files) != world_size \
            or set(files) != {rank_file_name(r) for r in range(world_size)}:
        raise SidecarError(f"manifest {path!r}: corrupt field files: expected entries for "
                           f"rank-00000 .. rank-{world_size - 1:05d} (world_size {world_size})")
    for name, entry in files.items():
        _check_manifest_entry(name, entry, path)
    for what, (base, pattern) in SHARED_FILES.items():
        entry = manifest.get(what)
        if entry is not None and not (isinstance(entry, dict) and is_int(entry.get("bytes"), 0, MAX_INDEX_BYTES)
                                      and _is_hex(entry.get("blake2b"), 32) and isinstance(entry.get("file"), str)
                                      and pattern.match(entry["file"])):
            raise SidecarError(f"manifest {path!r}: corrupt field {what}: got {entry!r:.80}; allowed: a mapping with "
                               f"file ({base} or {base[:-5]}.gN.json in the same directory), bytes (an integer from "
                               f"0 to {MAX_INDEX_BYTES}) and blake2b (32 hex digits)")
    indexes = manifest.get("indexes", {})
    if not isinstance(indexes, dict):
        raise SidecarError(f"manifest {path!r}: corrupt field indexes: got {indexes!r:.80}; allowed: a mapping of "
                           "mixture source labels to their index files")
    for label, entry in indexes.items():
        m = isinstance(entry, dict) and isinstance(entry.get("file"), str) and _SOURCE_INDEX_FILE.match(entry["file"])
        if not (m and m.group(2) == label and is_int(entry.get("bytes"), 0, MAX_INDEX_BYTES)
                and _is_hex(entry.get("blake2b"), 32)):
            raise SidecarError(f"manifest {path!r}: corrupt field indexes[{label!r:.80}]: got {entry!r:.80}; allowed: "
                               f"a mapping with file (index-<label>.json or index.gN-<label>.json of that label, in "
                               f"the same directory), bytes (an integer from 0 to {MAX_INDEX_BYTES}) and blake2b "
                               "(32 hex digits)")
    return manifest


def read_shared_file(state_dir: str, manifest: dict[str, Any], what: str) -> tuple[str, bytes] | None:
    """(path, bytes) of the dataset ``index`` or ``fingerprint`` saved with the state in ``state_dir`` (None
    without one), checked against the manifest's entry: a file the manifest does not list, or that differs
    from its entry, is never used."""
    return _read_listed(state_dir, manifest.get(what), f"dataset {what}")


def _read_listed(state_dir: str, entry: dict[str, Any] | None, what: str) -> tuple[str, bytes] | None:
    """(path, bytes) of the file a (checked) manifest entry names, if it matches the entry's size and digest."""
    if entry is None:
        return None
    file = os.path.join(state_dir, entry["file"])
    data = _read_bytes(file, what, MAX_INDEX_BYTES)
    if len(data) != entry["bytes"] or _digest(data) != entry["blake2b"]:
        raise SidecarError(f"{what} {file!r}: does not match its manifest entry (corrupt or overwritten)")
    return file, data


def read_state_fingerprint(state_dir: str, manifest: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(fingerprint, digest) saved once for every rank file of ``state_dir`` (None: the files carry their own,
    format versions 1 and 2)."""
    saved = read_shared_file(state_dir, manifest, "fingerprint")
    if saved is None:
        return None
    file, data = saved
    try:
        fingerprint = parse_json(data)
    except JSONRefused as e:
        raise SidecarError(f"dataset fingerprint {file!r}: corrupt ({e})") from None
    if not isinstance(fingerprint, dict):
        raise SidecarError(f"dataset fingerprint {file!r}: corrupt: got {type(fingerprint).__name__}; allowed: "
                           "a mapping")
    return fingerprint, _digest(data)


def read_state_index(state_dir: str) -> tuple[str, bytes] | None:
    """The dataset index saved with the state in ``state_dir`` (None without one), checked against the
    manifest's entry (:func:`read_shared_file`)."""
    return read_shared_file(state_dir, read_manifest(state_dir), "index")


def read_source_index(state_dir: str, label: str, manifest: dict[str, Any] | None = None) -> tuple[str, bytes] | None:
    """The dataset index of mixture source ``label`` saved with the state in ``state_dir`` (None without one:
    a single dataset's state, or a mixture's written before mixtures saved their indexes), checked against the
    manifest's entry."""
    manifest = read_manifest(state_dir) if manifest is None else manifest
    return _read_listed(state_dir, manifest.get("indexes", {}).get(label), f"dataset index of source {label!r}")


def state_dir_of(path: str) -> str | None:
    """The stream_state directory at ``path``: itself, or ``path/stream_state``."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or any(_RANK_FILE.match(f) for f in _listdir(path)):
        return path
    sub = os.path.join(path, STATE_DIR)
    if os.path.isdir(sub):
        return sub
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def find_state_dir(path: str) -> str:
    """The stream_state directory of a stream_state dir or a checkpoint dir, or a clear error."""
    if not os.path.isdir(path):
        raise SidecarError(f"stream state {path!r}: not found")
    state_dir = state_dir_of(path)
    if state_dir is None:
        raise SidecarError(f"stream state {path!r}: expected a rank-NNNNN.safetensors file, a stream_state directory "
                           "or a checkpoint directory containing stream_state/")
    return state_dir


def read_rank_state(state_dir: str, manifest: dict[str, Any], rank: int,
                    fingerprint: tuple[dict[str, Any], str] | None = None) -> tuple[dict[str, Any], str]:
    """(state, file) of ``rank`` in a stream_state directory, checked against its manifest entry (read once,
    so what is checked is what is decoded). ``fingerprint``: the directory's (:func:`read_state_fingerprint`,
    read once by a caller that reads several ranks), read here when not given."""
    entry = manifest["files"].get(rank_file_name(rank))
    if entry is None:
        raise SidecarError(f"stream state {state_dir!r}: written by {manifest['world_size']} ranks, has no file for "
                           f"rank {rank}")
    file = os.path.join(state_dir, entry.get("file", rank_file_name(rank)))
    if not os.path.lexists(file):
        raise SidecarError(f"sidecar {file!r}: listed in the manifest but missing")
    data = _read_bytes(file, "sidecar", MAX_SIDECAR_BYTES)
    if len(data) != entry["bytes"] or _digest(data) != entry["blake2b"]:
        raise SidecarError(f"sidecar {file!r}: does not match its manifest entry (corrupt or overwritten)")
    if fingerprint is None:
        fingerprint = read_state_fingerprint(state_dir, manifest)
    return decode_state(data, file, verified=True, fingerprint=fingerprint), file


def resolve_rank_state(path: str, rank: int) -> tuple[dict[str, Any], str]:
    """A sidecar file, a stream_state directory or a checkpoint directory -> (state, file) of this rank."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return read_state_file(path), path
    state_dir = find_state_dir(path)
    return read_rank_state(state_dir, read_manifest(state_dir), rank)
