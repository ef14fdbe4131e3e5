"""A stream's state on disk: a sidecar file, or one save of a ``stream_state`` directory.

A directory save (what a checkpoint holds)::

    rank-00000.safetensors ... rank-NNNNN.safetensors   each rank's partitions (cursors, digests, carries)
    fingerprint.json                                    the dataset fingerprint, once (rank 0)
    index.json                                          the dataset index, once (rank 0; parquet sources)
    index-<label>.json                                  a mixture's: each indexed source's, once (rank 0)
    manifest.json                                       rank 0, last: the files of this save and their digests

A rank file holds its partitions and the digest of ``fingerprint.json``, so it is O(its partitions)
however many files the dataset has. Rank 0 writes what describes the dataset once per save, and once
per job: a save whose fingerprint or index did not change since this process last wrote it links the
earlier file instead of writing it again (a hard link; a copy where links are not possible).

Reading a directory checks every file against the manifest, and after a change of ranks or workers
(``data.elastic``) gathers the partitions a rank reads now from the files of the ranks that read them.
Streams only have ``state_dict`` / ``load_state_dict``; their ``save_sidecar`` / ``load_sidecar`` and the
loader's and Trainer integration's saves come here. The file format is :mod:`resumable_stream.state.sidecar`.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any

from ..errors import SidecarError
from ..io.safe_files import atomic_write
from ..plan import partition_owner
from ..sources.index import encode_index
from .sidecar import (
    find_state_dir,
    fingerprint_bytes,
    generation_of,
    rank_file_name,
    read_manifest,
    read_rank_state,
    read_state_file,
    read_state_fingerprint,
    shared_file_name,
    source_index_file_name,
    write_manifest,
    write_rank_file,
    write_state_file,
)

TOPOLOGY_KEYS = ("world_size", "num_workers", "num_partitions")

# (what, blake2b of the bytes) -> (path, size, mtime_ns) of the last file this process wrote with them
_written: dict[tuple[str, str], tuple[str, int, int]] = {}


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ------------------------------------------------------------------ saving
def save(stream: Any, path: str | os.PathLike, state: dict[str, Any], manifest: bool | None = None) -> str:
    """Write ``state`` (``stream``'s, or a loader's over it). ``path``: a ``.safetensors`` file (the whole
    state, fingerprint included), or a stream_state directory (this rank's file of the next save; rank 0
    adds the dataset's fingerprint and index). ``manifest``: complete the save now (default: when
    world_size is 1; a multi-rank job calls :func:`finish` on rank 0 once every rank wrote its file)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        return write_state_file(path, state)
    fp, digest = _encoded_fingerprint(state["fingerprint"])
    file = write_rank_file(path, stream.rank, state, digest)
    if stream.rank == 0:
        write_shared(path, "fingerprint", fp)
        index = stream.source.index
        if index is not None:
            write_shared(path, "index", encode_index(index))
        for label, source_index in getattr(stream.source, "indexes", {}).items():   # a mixture's, one per source
            _write_once(path, f"index-{label}", source_index_file_name(label, generation_of(path) + 1),
                        encode_index(source_index))
    if stream.world_size == 1 if manifest is None else manifest:
        finish(path, stream.world_size)
    return file


_last_fingerprint: tuple[dict, bytes, str] | None = None   # (fingerprint object, its bytes, their digest)


def _encoded_fingerprint(fingerprint: dict[str, Any]) -> tuple[bytes, str]:
    """The bytes and digest of a fingerprint, encoded once for the object every state of a stream carries
    (``StreamBase.state_fingerprint``): a save costs O(its partitions), not O(the dataset's files)."""
    global _last_fingerprint
    if _last_fingerprint is None or _last_fingerprint[0] is not fingerprint:
        data = fingerprint_bytes(fingerprint)
        _last_fingerprint = (fingerprint, data, _digest(data))
    return _last_fingerprint[1], _last_fingerprint[2]


def finish(state_dir: str, world_size: int) -> str:
    """Rank 0, after every rank wrote its file: the manifest that completes the save."""
    return write_manifest(state_dir, world_size)


def write_shared(state_dir: str, what: str, data: bytes) -> str:
    """The dataset's ``fingerprint`` or ``index`` for the next save into ``state_dir``: a link to the file this
    process last wrote with the same bytes when there is one (unchanged since), else written."""
    return _write_once(state_dir, what, shared_file_name(what, generation_of(state_dir) + 1), data)


def _write_once(state_dir: str, what: str, name: str, data: bytes) -> str:
    """``data`` as ``state_dir/name``: linked to the file of this ``what`` this process last wrote with the same
    bytes when it is unchanged, else written."""
    target = os.path.join(state_dir, name)
    key = (what, _digest(data))
    known = _written.get(key)
    if not (known is not None and _link(known, target)):
        atomic_write(target, data)
    st = os.stat(target)
    _written[key] = (target, st.st_size, st.st_mtime_ns)
    return target


def _link(known: tuple[str, int, int], target: str) -> bool:
    """Hard-link ``known``'s file to ``target`` (atomically replacing it) if that file is still the one written."""
    source, size, mtime_ns = known
    try:
        st = os.stat(source)
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns) or st.st_mode & 0o777 != _new_file_mode():
            return False    # changed since, or a new file would get other permissions (the umask changed)
        if os.path.abspath(source) == os.path.abspath(target):
            return True
        tmp = os.path.join(os.path.dirname(target), f".tmp-{secrets.token_hex(8)}")   # as atomic_write's
        os.link(source, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def _new_file_mode() -> int | None:
    """The permissions a file written now gets (sidecar.atomic_write: 0o666 less the umask), read from
    /proc so that the process umask is never changed, even for a moment; None where /proc has no Umask."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


# ------------------------------------------------------------------ reading
def read(stream: Any, path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(state, description) of ``stream``'s partitions from a sidecar file, a stream_state directory or a
    checkpoint directory. Same topology: this rank's file. After a change of ranks or workers
    (``data.elastic``): the partitions this rank reads now, gathered from the files of the ranks that read
    them, every file checked against the manifest and the stream's fingerprint. The stream takes the saved
    num_partitions when data.num_partitions is null."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return read_state_file(path), f"sidecar {path!r}"
    state_dir = find_state_dir(path)
    manifest = read_manifest(state_dir)
    fingerprint = read_state_fingerprint(state_dir, manifest)    # once for every rank file (format version 3)
    first_rank = stream.rank if rank_file_name(stream.rank) in manifest["files"] else 0
    first, first_file = read_rank_state(state_dir, manifest, first_rank, fingerprint)
    where = f"sidecar {first_file!r}"
    stream.check_saved_identity(first, where)
    if stream.adopt_topology(first["topology"], where):
        return first, where
    # elastic: gather this rank's partitions from the ranks that read them before
    mine = set(stream.partitions)
    saved_world = int(manifest["world_size"])
    owners = sorted({partition_owner(p, stream.num_partitions, saved_world) for p in stream.partitions})
    states = [first]
    for r in owners:
        if r != first_rank:
            state, file = read_rank_state(state_dir, manifest, r, fingerprint)
            if fingerprint is None:    # older files carry their own fingerprints: each is checked
                stream.check_saved_identity(state, f"sidecar {file!r}")
            states.append(state)
    where = f"stream state {state_dir!r} (ranks {owners} of {saved_world})"
    return merge(states, mine, state_dir), where


def merge(states: list[dict[str, Any]], partitions: set[int], state_dir: str) -> dict[str, Any]:
    """One state of ``partitions`` gathered from rank states of one save (elastic resume): each partition is
    taken from the rank that held it; the ranks must agree on the topology. The rotations start afresh."""
    first = states[0]
    merged: dict[int, Any] = {}
    for state in states:
        topo = state["topology"]
        if any(topo[k] != first["topology"][k] for k in TOPOLOGY_KEYS):
            raise SidecarError(f"stream state {state_dir!r}: rank {topo.get('rank')} has topology {topo}, rank "
                               f"{first['topology'].get('rank')} {first['topology']}: not one run's checkpoint")
        merged.update({p: ps for p, ps in state["partitions"].items() if p in partitions})
    topology = {k: first["topology"][k] for k in TOPOLOGY_KEYS}
    return {"format_version": first["format_version"], "kind": first["kind"], "fingerprint": first["fingerprint"],
            "topology": {**topology, "rank": None}, "turn": 0, "partitions": merged}


def load(stream: Any, path: str | os.PathLike) -> None:
    """Restore ``stream`` from a sidecar file, a stream_state directory or a checkpoint directory."""
    state, where = read(stream, path)
    stream.load_state_dict(state, where=where)
