"""Stream state <-> safetensors sidecar files, written atomically; per-checkpoint manifest.

Layout of a checkpoint's stream state::

    checkpoint-N/stream_state/rank-00000.safetensors
    checkpoint-N/stream_state/rank-00001.safetensors
    checkpoint-N/stream_state/manifest.json   (written last, by rank 0: without it the state is incomplete)

Tensors hold the integer cursors and digest chains; ``__metadata__`` holds JSON strings
(format version, fingerprint, topology with ``num_partitions``, per-partition sample digests and
epoch progress for ``inspect``). No pickle anywhere. After a change of ranks or workers
(``data.elastic``) a rank reads the files of the ranks that held its virtual partitions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .errors import SidecarError

FORMAT = "resumable-stream"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.json"         # the dataset index, written by rank 0 next to the rank files
STATE_DIR = "stream_state"
CURSOR_FIELDS = ("epoch", "window", "offset", "next_pos", "rr", "rr_taken", "consumed_before")
_RANK_FILE = re.compile(r"^rank-(\d{5})\.safetensors$")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# ------------------------------------------------------------------ atomic writes
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


# ------------------------------------------------------------------ encode / decode
def encode_state(state: dict[str, Any]) -> bytes:
    parts = sorted(state["partitions"])
    k = len(parts)
    max_slots = max([len(state["partitions"][p]["slots"]) for p in parts] + [1])
    cursors = np.zeros((k, len(CURSOR_FIELDS)), dtype=np.int64)
    slots = np.full((k, max_slots, 2), -1, dtype=np.int64)
    chains = np.zeros((k, 16), dtype=np.uint8)
    digests, progress = {}, {}
    for i, p in enumerate(parts):
        ps = state["partitions"][p]
        cursors[i] = [ps[f] for f in CURSOR_FIELDS]
        for j, (pos, row) in enumerate(ps["slots"]):
            slots[i, j] = (pos, row)
        chains[i] = np.frombuffer(bytes.fromhex(ps["chain"]), dtype=np.uint8)
        digests[str(p)] = {"next_sample": ps["next_sample_digest"], "consumed": ps["consumed_digest"],
                           "consumed_samples": ps["consumed"]}
        progress[str(p)] = {"epoch_start": ps.get("epoch_start"), "epoch_rows": ps.get("epoch_rows")}
    tensors = {
        "partition_ids": np.asarray(parts, dtype=np.int64),
        "cursors": cursors,
        "slots": slots,
        "chains": chains,
    }
    extra_meta = {}
    for p in parts:   # what a transform carries over (e.g. packed tokens), per partition
        extra = state["partitions"][p].get("extra")
        if extra is not None:
            for name, arr in extra.get("tensors", {}).items():
                tensors[f"extra/{p}/{name}"] = np.ascontiguousarray(arr)
            extra_meta[str(p)] = {"meta": extra.get("meta", {}), "tensors": sorted(extra.get("tensors", {}))}
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "cursor_fields": json.dumps(list(CURSOR_FIELDS)),
        "fingerprint": json.dumps(state["fingerprint"], sort_keys=True),
        "topology": json.dumps(state["topology"], sort_keys=True),
        "turn": str(state.get("turn", 0)),
        "digests": json.dumps(digests, sort_keys=True),
        "extra": json.dumps(extra_meta, sort_keys=True),
        "progress": json.dumps(progress, sort_keys=True),
    }
    if state.get("lane_turns") is not None:   # only when a DataLoader lane interleaves several partitions
        metadata["lane_turns"] = json.dumps(list(state["lane_turns"]))
    return st_save(tensors, metadata=metadata)


def _read_header_metadata(data: bytes, path: str) -> dict[str, str]:
    if len(data) < 8:
        raise SidecarError(f"sidecar {path!r}: truncated ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise SidecarError(f"sidecar {path!r}: corrupt or truncated (header of {n} bytes, file of {len(data)})")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise SidecarError(f"sidecar {path!r}: corrupt header (not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise SidecarError(f"sidecar {path!r}: no metadata; it was not written by resumable-stream")
    return meta


def decode_state(data: bytes, path: str = "<bytes>") -> dict[str, Any]:
    meta = _read_header_metadata(data, path)
    if meta.get("format") != FORMAT:
        raise SidecarError(f"sidecar {path!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise SidecarError(f"sidecar {path!r}: format version {version!r}; this library reads version "
                           f"{FORMAT_VERSION} (upgrade resumable-stream or resume with the version that wrote it)")
    try:
        tensors = st_load(data)
        fields = json.loads(meta["cursor_fields"])
        fingerprint = json.loads(meta["fingerprint"])
        topology = json.loads(meta["topology"])
        digests = json.loads(meta["digests"])
        turn = int(meta.get("turn", "0"))
        extra_meta = json.loads(meta.get("extra", "{}"))
        progress = json.loads(meta.get("progress", "{}"))
        lane_turns = json.loads(meta["lane_turns"]) if "lane_turns" in meta else None
        parts, cursors = tensors["partition_ids"], tensors["cursors"]
        slots, chains = tensors["slots"], tensors["chains"]
    except (KeyError, ValueError, TypeError) as e:
        raise SidecarError(f"sidecar {path!r}: corrupt or incomplete ({type(e).__name__}: {e})") from None
    except Exception as e:  # safetensors' own parse errors
        raise SidecarError(f"sidecar {path!r}: corrupt or truncated ({e})") from None
    if list(fields) != list(CURSOR_FIELDS) or cursors.shape != (len(parts), len(CURSOR_FIELDS)):
        raise SidecarError(f"sidecar {path!r}: unexpected cursor layout {fields} {cursors.shape}")
    partitions = {}
    for i, p in enumerate(parts.tolist()):
        d = digests.get(str(p))
        if d is None:
            raise SidecarError(f"sidecar {path!r}: no digests for partition {p}")
        ps = {f: int(v) for f, v in zip(CURSOR_FIELDS, cursors[i].tolist())}
        ps["slots"] = [(int(a), int(b)) for a, b in slots[i].tolist() if a >= 0]
        ps["chain"] = bytes(chains[i].tolist()).hex()
        ps["next_sample_digest"] = d["next_sample"]
        ps["consumed_digest"] = d["consumed"]
        ps["consumed"] = int(d["consumed_samples"])
        pr = progress.get(str(p), {})
        ps["epoch_start"], ps["epoch_rows"] = pr.get("epoch_start"), pr.get("epoch_rows")
        if str(p) in extra_meta:
            em = extra_meta[str(p)]
            missing = [n for n in em["tensors"] if f"extra/{p}/{n}" not in tensors]
            if missing:
                raise SidecarError(f"sidecar {path!r}: partition {p} lacks carried tensors {missing}")
            ps["extra"] = {"meta": em["meta"], "tensors": {n: tensors[f"extra/{p}/{n}"] for n in em["tensors"]}}
        partitions[int(p)] = ps
    state = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "topology": topology,
             "turn": turn, "partitions": partitions}
    if lane_turns is not None:
        state["lane_turns"] = lane_turns
    return state


# ------------------------------------------------------------------ progress (for inspect)
def partition_progress(ps: dict[str, Any]) -> dict[str, Any]:
    """Where one partition stands in its data: its epoch, rows of that epoch consumed, and the fraction
    (None when the epoch's row count or start is unknown, e.g. json shards or an older sidecar)."""
    start, rows = ps.get("epoch_start"), ps.get("epoch_rows")
    done = ps["consumed"] - start if start is not None else None
    fraction = done / rows if done is not None and rows else None
    return {"epoch": ps["epoch"], "epoch_consumed": done, "epoch_rows": rows,
            "epoch_fraction": None if fraction is None else round(fraction, 6)}


def progress_summary(progress: list[dict[str, Any]]) -> dict[str, Any]:
    """min / max / mean over partitions of the epoch, the fraction of the current epoch consumed, and
    epochs completed (epoch + fraction: comparable across partitions in different epochs)."""
    def stats(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {"min": round(min(values), 6), "max": round(max(values), 6),
                "mean": round(sum(values) / len(values), 6)}

    known = [p for p in progress if p["epoch_fraction"] is not None]
    return {"partitions": len(progress),
            "epoch": {"min": min(p["epoch"] for p in progress), "max": max(p["epoch"] for p in progress)}
            if progress else None,
            "epoch_fraction": stats([p["epoch_fraction"] for p in known]),
            "epochs_completed": stats([p["epoch"] + p["epoch_fraction"] for p in known]),
            "unknown_fraction": len(progress) - len(known)}


# ------------------------------------------------------------------ files and directories
def write_state_file(path: str, state: dict[str, Any]) -> str:
    atomic_write(path, encode_state(state))
    return path


def read_state_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SidecarError(f"sidecar {path!r}: not found") from None
    except OSError as e:
        raise SidecarError(f"sidecar {path!r}: cannot be read ({e})") from None
    return decode_state(data, path)


def _file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(state_dir: str, world_size: int) -> str:
    """Rank 0, after every rank wrote its file: record them all. Missing files are an error."""
    files = {}
    for r in range(world_size):
        p = os.path.join(state_dir, rank_file_name(r))
        if not os.path.isfile(p):
            raise SidecarError(f"stream state {state_dir!r}: {rank_file_name(r)} missing; cannot write the manifest")
        files[rank_file_name(r)] = {"bytes": os.path.getsize(p), "blake2b": _file_digest(p)}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world_size, "files": files}
    index = os.path.join(state_dir, INDEX)
    if os.path.isfile(index):    # the dataset index saved with the state (job_source): verified before use
        manifest["index"] = {"file": INDEX, "bytes": os.path.getsize(index), "blake2b": _file_digest(index)}
    path = os.path.join(state_dir, MANIFEST)
    atomic_write(path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    return path


def read_manifest(state_dir: str) -> dict[str, Any]:
    path = os.path.join(state_dir, MANIFEST)
    if not os.path.isfile(path):
        raise SidecarError(f"stream state {state_dir!r}: no {MANIFEST}; the checkpoint was not completely written "
                           "and is not resumed from")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        world_size = int(manifest["world_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise SidecarError(f"manifest {path!r}: corrupt ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT or not isinstance(files, dict) or len(files) != world_size:
        raise SidecarError(f"manifest {path!r}: not a resumable-stream manifest for {world_size} ranks")
    return manifest


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


def verified_rank_file(state_dir: str, manifest: dict[str, Any], rank: int) -> str:
    """``rank``'s file of a stream_state directory, checked against its manifest entry."""
    name = rank_file_name(rank)
    entry = manifest["files"].get(name)
    if entry is None:
        raise SidecarError(f"stream state {state_dir!r}: written by {manifest['world_size']} ranks, has no file for "
                           f"rank {rank}")
    file = os.path.join(state_dir, name)
    if not os.path.isfile(file):
        raise SidecarError(f"sidecar {file!r}: listed in the manifest but missing")
    if os.path.getsize(file) != entry["bytes"] or _file_digest(file) != entry["blake2b"]:
        raise SidecarError(f"sidecar {file!r}: does not match its manifest entry (corrupt or overwritten)")
    return file


def resolve_rank_file(path: str, rank: int) -> str:
    """A sidecar file, a stream_state directory or a checkpoint directory -> this rank's verified file."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    state_dir = find_state_dir(path)
    return verified_rank_file(state_dir, read_manifest(state_dir), rank)
