"""A saved state <-> the bytes of a safetensors sidecar: every field checked when read, no pickle
(docs/internals.md, "Sidecar schema", "What a sidecar's digest guarantees"). Version 1 of the released format
(:data:`FORMAT`); development builds' files (format ``resumable-stream``, versions 1-3) are refused, naming them."""

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
from ..limits import MAX_HEADER_BYTES, MAX_INDEX_BYTES, MAX_PARTITIONS, MAX_WORLD_SIZE, is_int
from .names import FINGERPRINT, MANIFEST
from .partition_state import Cursor, MixturePartitionState, PartitionState
from .partition_state import is_hex as _is_hex
from .partition_state import json_field as _json_field
from .partition_state import require as _require
from .partition_state import tensor as _tensor

FORMAT = "resumable-stream-state"    # sidecars and manifests; the format of the dataset index is its own
FORMAT_VERSION = 1                   # a sidecar's metadata holds it as a string, a manifest as an integer
DEVELOPMENT_FORMAT = "resumable-stream"   # what the development builds of 0.1.0 wrote (versions 1-3): refused
KINDS = ("stream", "mixture")
MAX_RETIRED = 1024          # sources a mixture may have removed and kept the cursors of
STATE_TYPES = {"stream": PartitionState, "mixture": MixturePartitionState}   # a partition's state, by kind


def fingerprint_bytes(fingerprint: dict[str, Any]) -> bytes:
    """The canonical bytes of a fingerprint: what ``fingerprint.json`` holds and its digest is taken of."""
    return json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------ encode
def encode_state(state: dict[str, Any], fingerprint_digest: str | None = None,
                 fingerprint: dict[str, Any] | None = None) -> bytes:
    """A nested state as sidecar bytes; with ``fingerprint_digest`` only that digest instead of the fingerprint (a
    rank file, O(its partitions)); ``fingerprint``: written instead of the stream part's (in another form of it)."""
    stream = state["stream"]
    kind = stream.get("kind", "stream")
    parts = sorted(stream["partitions"])
    tensors: dict[str, np.ndarray] = {"partition_ids": np.asarray(parts, dtype=np.int64)}
    metadata: dict[str, str] = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "kind": kind,
        "cursor_fields": json.dumps(list(Cursor.FIELDS)),
        "topology": json.dumps(stream["topology"], sort_keys=True),
        "turn": str(stream.get("turn", 0)),
    }
    if fingerprint_digest is None:
        fingerprint = stream["fingerprint"] if fingerprint is None else fingerprint
        metadata["fingerprint"] = fingerprint_bytes(fingerprint).decode()
    else:
        metadata["fingerprint_digest"] = fingerprint_digest
    state_type = STATE_TYPES[kind]
    states = [state_type.from_dict(stream["partitions"][p], f"state of partition {p}") for p in parts]
    state_type.to_arrays(parts, states, "", tensors, metadata)
    carried = {}
    for p, carry in sorted((state.get("transform") or {}).items()):   # e.g. packed tokens, per partition
        for name, arr in carry.get("tensors", {}).items():
            tensors[f"transform/{p}/{name}"] = np.ascontiguousarray(arr)
        carried[str(p)] = {"meta": carry.get("meta", {}), "tensors": sorted(carry.get("tensors", {}))}
    metadata["transform"] = json.dumps(carried, sort_keys=True)
    if state.get("indexes"):     # a growing dataset's index, carried by a state a trainer keeps (not a directory's)
        labels = list(state["indexes"])
        for n, label in enumerate(labels):
            tensors[f"indexes/{n}"] = np.frombuffer(bytes(state["indexes"][label]), dtype=np.uint8)
        metadata["indexes"] = json.dumps(labels)
    if state.get("loader") is not None:
        loader = state["loader"]
        metadata["loader"] = json.dumps({"turns": {str(r): t for r, t in loader.get("turns", {}).items()},
                                         "lane_turns": {str(r): list(t) for r, t in loader.get("lane_turns", {}).items()}},
                                        sort_keys=True)
    metadata[SEAL_KEY] = _BLANK_SEAL
    return _seal(_canonical(st_save(tensors, metadata=metadata)))


def _canonical(data: bytes) -> bytes:
    """safetensors bytes with the header's keys sorted (safetensors writes its metadata in hash order, which
    changes from one process to the next): the same state is the same bytes, on every rank and in every run."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)          # the data section stays 8-byte aligned, as safetensors keeps it
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


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


def _check_seal(data: bytes, header_len: int, meta: dict[str, str], path: str) -> None:
    """The file's self-digest is there and matches its bytes."""
    value = meta.get(SEAL_KEY)
    header = data[8:8 + header_len]
    field = _seal_field(value) if isinstance(value, str) else b""
    if value is None or not HEX32.match(value) or header.count(field) != 1:
        raise SidecarError(f"sidecar {path!r}: corrupt (field {SEAL_KEY}: {str(value)[:40]!r} is not its digest)")
    blank = data[:8] + header.replace(field, _seal_field(_BLANK_SEAL)) + data[8 + header_len:]
    if hashlib.blake2b(blank, digest_size=16).hexdigest() != value:
        raise SidecarError(f"sidecar {path!r}: corrupt: its bytes do not match its own digest ({SEAL_KEY}); the "
                           "file was damaged or modified after it was written")


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


def _decode_transform(ids: list[int], tensors: dict[str, np.ndarray], meta: dict[str, str],
                      path: str) -> dict[int, dict]:
    """The transform's carry per partition (only partitions that have one)."""
    carried = _json_field(meta, "transform", path, "{}")
    _require(isinstance(carried, dict) and all(k.isdigit() and int(k) in ids for k in carried), path, "transform",
             carried, "a mapping by partition (of the partitions this file holds)")
    out = {}
    for p in ids:
        em = carried.get(str(p))
        if em is None:
            continue
        ok = (isinstance(em, dict) and isinstance(em.get("meta"), dict) and isinstance(em.get("tensors"), list)
              and all(isinstance(n, str) for n in em["tensors"]))
        _require(ok, path, f"transform[{p}]", em, "a mapping with meta (a mapping) and tensors (a list of names)")
        missing = [n for n in em["tensors"] if f"transform/{p}/{n}" not in tensors]
        if missing:
            raise SidecarError(f"sidecar {path!r}: partition {p} lacks carried tensors {missing}")
        out[p] = {"meta": em["meta"], "tensors": {n: tensors[f"transform/{p}/{n}"] for n in em["tensors"]}}
    return out


def _decode_loader(meta: dict[str, str], topology: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The loader's rotation per rank: ``turns`` (the DataLoader lane of the next batch) and ``lane_turns`` (per
    lane, the partition of its next batch), of this file's rank or, in a job's state, of every rank."""
    if "loader" not in meta:
        return None
    loader = _json_field(meta, "loader", path)
    w, n, lanes = topology["world_size"], topology["num_partitions"], max(1, topology["num_workers"])
    ranks = {str(r) for r in range(w)} if topology["rank"] is None else {str(topology["rank"])}
    ok = isinstance(loader, dict) and set(loader) == {"turns", "lane_turns"} and all(
        isinstance(loader[k], dict) and set(loader[k]) <= ranks for k in loader)
    _require(ok, path, "loader", loader, f"a mapping with turns and lane_turns, each by rank ({len(ranks)} at most)")
    for r, t in loader["turns"].items():
        _require(is_int(t, 0, lanes - 1), path, f"loader.turns[{r}]", t, f"an integer in [0, {lanes})")
    for r, ts in loader["lane_turns"].items():
        _require(isinstance(ts, list) and len(ts) <= lanes and all(is_int(t, 0, n - 1) for t in ts), path,
                 f"loader.lane_turns[{r}]", ts, f"a list of at most {lanes} integers in [0, {n})")
    return {"turns": {int(r): t for r, t in loader["turns"].items()},
            "lane_turns": {int(r): ts for r, ts in loader["lane_turns"].items()}}


def _mixture_slots(fingerprint: dict, path: str) -> int:
    """The source columns of a mixture state: its sources', then those a change of mixture removed (kept)."""
    mixture = fingerprint.get("mixture")
    labels = mixture.get("labels") if isinstance(mixture, dict) else None
    _require(isinstance(labels, list) and len(labels) >= 1 and all(isinstance(x, str) for x in labels), path,
             "fingerprint.mixture.labels", labels, "a list of source labels")
    retired = mixture.get("retired", [])
    _require(isinstance(retired, list) and len(retired) <= MAX_RETIRED and all(isinstance(x, str) for x in retired),
             path, "fingerprint.mixture.retired", retired, f"a list of at most {MAX_RETIRED} source labels")
    return len(labels) + len(retired)


def _fingerprint_of(meta: dict[str, str], shared: tuple[dict[str, Any], str] | None, path: str) -> dict[str, Any]:
    """A sidecar's dataset fingerprint: its own, or (a rank file) the one of its directory, which must have the
    digest the file recorded."""
    if "fingerprint_digest" not in meta:
        fingerprint = _json_field(meta, "fingerprint", path)
        _require(isinstance(fingerprint, dict), path, "fingerprint", fingerprint, "a mapping")
        return fingerprint
    digest = meta["fingerprint_digest"]
    _require(_is_hex(digest, 32) and "fingerprint" not in meta, path, "fingerprint_digest", digest,
             "32 hex digits, in a file without a fingerprint of its own")
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


def check_format(fmt: Any, version: Any, path: str, what: str = "sidecar") -> None:
    """A file's ``format`` / ``format_version`` are this release's (a manifest's version an int, a sidecar's a
    string); the development builds' are refused, naming them."""
    if fmt == DEVELOPMENT_FORMAT:
        raise SidecarError(f"{what} {path!r}: format {DEVELOPMENT_FORMAT!r} version {str(version)[:20]}, written by a "
                           "development build of resumable-stream 0.1.0 before its first release; this release reads "
                           f"only {FORMAT!r} version {FORMAT_VERSION}: start the data afresh (without this state), or "
                           "finish the run with the build that wrote it")
    if fmt != FORMAT:
        raise SidecarError(f"{what} {path!r}: format {str(fmt)[:40]!r}, expected {FORMAT!r}; not a resumable-stream "
                           "state")
    expected = str(FORMAT_VERSION) if what == "sidecar" else FORMAT_VERSION
    if type(version) is not type(expected) or version != expected:   # True, 1.0 or "1" in a manifest: no version
        number = int(version) if isinstance(version, str) and version.isdigit() and len(version) < 10 else version
        newer = is_int(number) and number > FORMAT_VERSION
        raise SidecarError(f"{what} {path!r}: format version {version!r:.20}; this release reads version "
                           f"{FORMAT_VERSION}" + (" (a newer resumable-stream wrote it: upgrade to resume from it)"
                                                  if newer else " (corrupt field format_version)"))


def decode_state(data: bytes, path: str = "<bytes>",
                 fingerprint: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """The nested state in sidecar bytes, every field checked and the self-digest matched. ``fingerprint``: (fingerprint,
    digest) of the directory, for a rank file holding only the digest."""
    meta, header_len = read_header_metadata(data, path)
    check_format(meta.get("format"), meta.get("format_version"), path)
    _check_seal(data, header_len, meta, path)
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors' own parse errors
        raise SidecarError(f"sidecar {path!r}: corrupt or truncated ({e})") from None
    fields = _json_field(meta, "cursor_fields", path)
    _require(fields == list(Cursor.FIELDS), path, "cursor_fields", fields, str(list(Cursor.FIELDS)))
    kind = meta.get("kind")
    _require(kind in KINDS, path, "kind", kind, " or ".join(KINDS))
    topology = _json_field(meta, "topology", path)
    _check_topology(topology, path)
    n = topology["num_partitions"]
    turn = _json_field(meta, "turn", path, "0")      # the stream's own rotation over its partitions
    _require(is_int(turn, 0, n - 1), path, "turn", turn, f"an integer in [0, {n})")
    loader = _decode_loader(meta, topology, path)
    fingerprint = _fingerprint_of(meta, fingerprint, path)
    ids_t = _tensor(tensors, "partition_ids", "int64", 1, path)
    _require(len(ids_t) <= n, path, "tensor partition_ids", f"{len(ids_t)} entries", f"at most {n}")
    ids = ids_t.tolist()     # at most one per partition: bounded before it becomes a list
    _require(len(set(ids)) == len(ids) and all(0 <= p < n for p in ids), path, "tensor partition_ids", ids,
             f"distinct partitions in [0, {n})")
    if kind == "stream":     # data.growth: follow saves "" as the next digest at the end of the known data
        dataset = fingerprint.get("dataset")
        follows = isinstance(dataset, dict) and dataset.get("growth") == "follow"
        partitions = PartitionState.from_arrays(ids, tensors, meta, path, blank_digest_ok=follows)
    else:
        partitions = MixturePartitionState.from_arrays(ids, tensors, meta, path, _mixture_slots(fingerprint, path))
    _check_rank_partitions(topology, len(partitions), path)
    stream = {"format_version": FORMAT_VERSION, "kind": kind, "fingerprint": fingerprint, "topology": topology,
              "turn": turn, "partitions": {p: ps.to_dict() for p, ps in partitions.items()}}
    out = {"stream": stream, "transform": _decode_transform(ids, tensors, meta, path), "loader": loader}
    indexes = _decode_indexes(tensors, meta, path)
    if indexes:
        out["indexes"] = indexes
    return out


def _decode_indexes(tensors: dict[str, np.ndarray], meta: dict[str, str], path: str) -> dict[str | None, bytes]:
    """The dataset indexes a state carries (``data.growth``), by source label (None: a single dataset's), as their
    bytes: the stream decodes and checks each (``sources.index.decode_index``)."""
    if "indexes" not in meta:
        return {}
    labels = _json_field(meta, "indexes", path)
    _require(isinstance(labels, list) and len(labels) <= MAX_RETIRED and len(set(map(str, labels))) == len(labels)
             and all(x is None or isinstance(x, str) for x in labels), path, "indexes", labels,
             f"a list of at most {MAX_RETIRED} distinct source labels (null: the dataset's)")
    out = {}
    for n, label in enumerate(labels):
        t = _tensor(tensors, f"indexes/{n}", "uint8", 1, path)
        _require(len(t) <= MAX_INDEX_BYTES, path, f"tensor indexes/{n}", f"{len(t)} bytes", f"at most {MAX_INDEX_BYTES}")
        out[label] = t.tobytes()
    return out
