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
import re
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ..errors import SidecarError
from ..io.safe_files import JSONRefused, parse_json
from ..limits import (
    MAX_HEADER_BYTES,
    MAX_OPEN_SHARDS,
    MAX_PARTITIONS,
    MAX_WORLD_SIZE,
    is_int,
)
from .fields import is_hex as _is_hex
from .fields import json_field as _json_field
from .fields import require as _require
from .fields import tensor as _tensor
from .mixture_state import MixturePartitionState
from .names import (
    FINGERPRINT,
    MANIFEST,
)
from .partition_state import Cursor, PartitionState
from .sidecar_v1 import V1_CURSOR_FIELDS, check_v1_partition_ids, mixture_from_v1

FORMAT = "resumable-stream"
FORMAT_VERSION = 3
# The format versions this release reads: every one ever written. A sidecar's metadata holds it as a string,
# a manifest as an integer (each exactly so: another type is not a version).
READ_VERSIONS = (1, 2, 3)
KINDS = ("stream", "mixture")
STATE_TYPES = {"stream": PartitionState, "mixture": MixturePartitionState}   # a partition's state, by kind


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
def read_header_metadata(data: bytes, path: str) -> tuple[dict[str, str], int]:
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
HEX32 = re.compile(r"^[0-9a-f]{32}$")


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
    if not HEX32.match(value) or header.count(field) != 1:
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
    meta, header_len = read_header_metadata(data, path)
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




