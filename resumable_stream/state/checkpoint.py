"""The stream_state directory and sidecar files: a saved state on disk (docs/internals.md, "States and
checkpoints", "Saving over a state"). It takes values (a nested state, the dataset's fingerprint and indexes, a
rank and a world size) and gives values back; it never sees a stream. The bytes of one state are :mod:`.sidecar`'s,
the file names :mod:`.names`', which checkpoint of an output_dir resumes :mod:`.output_dir`'s."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import SidecarError
from ..io.safe_files import FileRefused, JSONRefused, atomic_write, parse_json, read_regular_file
from ..limits import (
    MAX_GENERATION,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SIDECAR_BYTES,
    MAX_WORLD_SIZE,
    is_int,
)
from ..plan import partition_owner
from ..sources import fingerprint_files
from ..sources.index import decode_index, encode_message
from ..sources.index_table import FileTable, is_packed
from .names import (
    MANIFEST,
    RANK_FILE,
    SHARED_FILES,
    SOURCE_INDEX_FILE,
    STATE_DIR,
    rank_file_name,
    shared_file_name,
    source_index_file_name,
)
from .partition_state import is_hex as _is_hex
from .sidecar import (
    FORMAT,
    FORMAT_VERSION,
    check_format,
    decode_state,
    encode_state,
    fingerprint_bytes,
    read_header_metadata,
)

log = logging.getLogger(__name__)
TOPOLOGY_KEYS = ("world_size", "num_workers", "num_partitions")
# the stream layer's function making its part of a gathered state from one rank's part and the gathered partitions
StreamPart = Callable[[dict[str, Any], dict[int, Any]], dict[str, Any]]

# (what, blake2b of the bytes) -> (path, size, mtime_ns) of the last file this process wrote with them
_written: dict[tuple[str, str], tuple[str, int, int]] = {}


# ------------------------------------------------------------------ saving
def save(path: str | os.PathLike, state: dict[str, Any], rank: int, world_size: int,
         indexes: dict[str | None, dict] | None = None, manifest: bool | None = None) -> str:
    """Write a nested state of ``rank`` of ``world_size`` to a ``.safetensors`` file (the whole state) or a
    stream_state directory (this rank's file; rank 0 adds the fingerprint and ``indexes``: the dataset's under None,
    a mixture source's under its label). ``manifest``: complete the save now (default: with one rank; else rank 0
    calls :func:`finish` once every rank wrote its file)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        return write_state_file(path, state)
    fp, digest = _encoded_fingerprint(state["stream"]["fingerprint"])
    file = write_rank_file(path, rank, state, digest)
    if rank == 0:
        generation = generation_of(path) + 1
        _write_once(path, "fingerprint", shared_file_name("fingerprint", generation, _extension(fp)), fp)
        for label, index in sorted((indexes or {}).items(), key=lambda kv: kv[0] or ""):
            if label is None:      # packed (index_table) when its files are a table, else JSON
                _write_index(path, "index", index, lambda ext: shared_file_name("index", generation, ext))
            else:
                _write_index(path, f"index-{label}", index,
                             lambda ext, label=label: source_index_file_name(label, generation, ext))
    if world_size == 1 if manifest is None else manifest:
        finish(path, world_size)
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


def _extension(data: bytes) -> str:
    """An index file's: ``bin`` for a packed one (``index_table.pack_index``), ``json`` for the JSON form."""
    return "bin" if is_packed(data) else "json"


# what -> (files table, the index's other keys as JSON, extension, digest of its bytes) of the index this process
# last wrote: while neither changed, a save links that file without packing the index again
_written_index: dict[str, tuple[weakref.ref, str, str, str]] = {}


def _write_index(state_dir: str, what: str, index: dict[str, Any], name_of: Callable[[str], str]) -> str:
    """A dataset index (``encode_message``: packed for a table) as the file ``name_of(extension)`` names."""
    files = index["files"]
    rest = json.dumps({k: v for k, v in index.items() if k != "files"}, sort_keys=True, default=str)
    last = _written_index.get(what)
    if isinstance(files, FileTable) and last is not None and last[0]() is files and last[1] == rest:
        return _write_once(state_dir, what, name_of(last[2]), lambda: encode_message(index), last[3])
    data = encode_message(index)
    digest = _digest(data)
    target = _write_once(state_dir, what, name_of(_extension(data)), data, digest)
    if isinstance(files, FileTable):
        _written_index[what] = (weakref.ref(files), rest, _extension(data), digest)
    return target


def _write_once(state_dir: str, what: str, name: str, data: bytes | Callable[[], bytes],
                digest: str | None = None) -> str:
    """``data`` (or what ``data()`` makes) as ``state_dir/name``: a link to the file this process last wrote with the
    same ``digest`` when it is unchanged, else written. A generation has one file of each name (.json or .bin)."""
    stem = name.rsplit(".", 1)[0]
    for other in (f"{stem}.json", f"{stem}.bin"):
        if other != name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(state_dir, other))
    target = os.path.join(state_dir, name)
    key = (what, _digest(data) if digest is None else digest)
    known = _written.get(key)
    if not (known is not None and _link(known, target)):
        atomic_write(target, data() if callable(data) else data)
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
class SavedState:
    """A saved state at a path: a sidecar file, or the newest save of a stream_state directory (every file checked
    against its manifest). ``first``: the file, or the rank asked for (else rank 0's), whose stream part the caller
    checks before it takes :meth:`gather`."""

    def __init__(self, path: str | os.PathLike, rank: int = 0):
        path = os.fspath(path)
        self.path = path
        if os.path.isfile(path):
            self.state_dir, self.manifest, self.fingerprint = None, None, None
            self.first, self.first_file = read_state_file(path), path
        else:
            self.state_dir = find_state_dir(path)
            self.manifest = read_manifest(self.state_dir)
            self.fingerprint = read_state_fingerprint(self.state_dir, self.manifest)
            first = rank if rank_file_name(rank) in self.manifest["files"] else 0
            self.first, self.first_file = read_rank_state(self.state_dir, self.manifest, first, self.fingerprint)
        self.where = f"sidecar {self.first_file!r}"

    @property
    def stream(self) -> dict[str, Any]:
        """The stream part of :attr:`first` (kind, fingerprint, topology, partitions)."""
        return self.first["stream"]

    def identities(self):
        """A context in which the files of a compact fingerprint can be listed (:func:`saved_identities`)."""
        return saved_identities(self.path)

    def gather(self, partitions: Iterable[int], stream_part: StreamPart) -> tuple[dict[str, Any], str]:
        """(state, description) of ``partitions`` after a change of ranks or workers, each from the state that holds it
        (``stream_part``: see :func:`merge`)."""
        mine = set(partitions)
        saved = self.stream["topology"]
        if saved["rank"] is None or self.state_dir is None:       # one state: all it has, or a clear error
            return merge([self.first], mine, self.where, stream_part), self.where
        world = int(self.manifest["world_size"])
        owners = sorted({partition_owner(p, saved["num_partitions"], world) for p in mine})
        states = [self.first] + [read_rank_state(self.state_dir, self.manifest, r, self.fingerprint)[0]
                                 for r in owners if r != saved["rank"]]
        where = f"stream state {self.state_dir!r} (ranks {owners} of {world})"
        return merge(states, mine, where, stream_part), where


class SavedIndexes:
    """What a checkpoint being resumed saved of its dataset, read on demand on the rank that opens the dataset: each
    source's index (checked against the manifest) and the furthest epoch begun. A bare sidecar file saved none."""

    def __init__(self, state_path: str | os.PathLike):
        self.path = os.fspath(state_path)

    def where(self, label: str | None = None) -> str:
        return f"of {self.path!r}" + (f" (source {label!r})" if label is not None else "")

    def index(self, label: str | None = None) -> dict[str, Any] | None:
        """The dataset index saved with the state (``label``: mixture source ``label``'s), or None."""
        state_dir = _manifest_dir(self.path)
        if state_dir is None:
            return None
        saved = read_state_index(state_dir) if label is None else read_source_index(state_dir, label)
        return None if saved is None else decode_index(saved[1], repr(saved[0]))

    def furthest_epoch(self, source: int | None = None) -> int | None:
        """The furthest epoch any partition of the state has begun (every rank file read: O(partitions));
        ``source``: of that source of a mixture (each has its own epochs). None for a bare sidecar file."""
        if os.path.isfile(self.path):
            return None
        state_dir = find_state_dir(self.path)
        manifest = read_manifest(state_dir)
        fingerprint = read_state_fingerprint(state_dir, manifest)
        furthest = 0
        for rank in range(int(manifest["world_size"])):
            state, _ = read_rank_state(state_dir, manifest, rank, fingerprint)
            for ps in state["stream"]["partitions"].values():   # a decoded partition: {"epoch": ..., ...}
                if source is not None:                           # a mixture's: {"mixture": ..., "sources": [...]}
                    ps = ps["sources"][source] if source < len(ps["sources"]) else None
                if ps is None or not is_int(ps.get("epoch")):
                    raise SidecarError(f"stream state {state_dir!r}: rank {rank} has a partition without an epoch of "
                                       f"source {source}; data.growth needs the epoch of every partition")
                furthest = max(furthest, ps["epoch"])
        return furthest


def merge(states: list[dict[str, Any]], partitions: set[int], where: str, stream_part: StreamPart,
          every: bool = False) -> dict[str, Any]:
    """One state of ``partitions`` gathered from states of one save (elastic resume, or the job's state from its
    ranks'), each partition and carry from the state that held it; the loader part keeps the merged ranks'
    rotations by rank. The stream's part is the stream layer's to make: ``stream_part(first rank's part, gathered
    partitions)`` (``stream.base.gathered_part``). ``every``: all of ``partitions`` must be there."""
    first = states[0]["stream"]
    merged: dict[int, Any] = {}
    carries: dict[int, Any] = {}
    rotations: dict[str, dict[int, Any]] = {"turns": {}, "lane_turns": {}}
    for state in states:
        topo = state["stream"]["topology"]
        if any(topo[k] != first["topology"][k] for k in TOPOLOGY_KEYS):
            raise SidecarError(f"{where}: rank {topo.get('rank')} has topology {topo}, rank "
                               f"{first['topology'].get('rank')} {first['topology']}: not one run's checkpoint")
        if state["stream"]["fingerprint"] != first["fingerprint"] or state["stream"]["kind"] != first["kind"]:
            raise SidecarError(f"{where}: rank {topo.get('rank')} was saved with another dataset fingerprint or kind "
                               f"than rank {first['topology'].get('rank')}: not one run's checkpoint")
        for p, ps in state["stream"]["partitions"].items():
            if p in partitions:
                if p in merged:
                    raise SidecarError(f"{where}: partition {p} is held by two rank files of one save")
                merged[p] = ps
        carries.update({p: c for p, c in (state.get("transform") or {}).items() if p in partitions})
        for key, by_rank in rotations.items():
            by_rank.update((state.get("loader") or {}).get(key) or {})
    missing = sorted(partitions - set(merged))
    if every and missing:
        raise SidecarError(f"{where}: holds no state of partitions {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                           " that this rank reads; load the stream_state or checkpoint directory it was saved in so "
                           "they are gathered from every rank's file")
    return {"stream": stream_part(first, merged), "transform": carries,
            "loader": rotations if rotations["turns"] else None}


def saved_identities(path: str | os.PathLike):
    """A context in which the files a compact fingerprint of the state at ``path`` stands for can be listed: its saved
    indexes, decoded only when a comparison needs them."""
    state_dir = _manifest_dir(path)
    if state_dir is None:
        return fingerprint_files.saved_indexes(None)

    def tables() -> list:
        manifest = read_manifest(state_dir)
        found = [read_shared_file(state_dir, manifest, "index")] + [
            read_source_index(state_dir, label, manifest) for label in manifest.get("indexes", {})]
        indexes = [decode_index(data, repr(file)) for file, data in filter(None, found)]
        return [index["files"] for index in indexes if isinstance(index["files"], FileTable)]

    return fingerprint_files.saved_indexes(tables)


# ------------------------------------------------------------------ files, manifests, directories
def _manifest_dir(path: str | os.PathLike) -> str | None:
    """The stream_state directory of a sidecar file or directory at ``path`` when it has a manifest, else None."""
    path = os.path.abspath(os.fspath(path))
    state_dir = state_dir_of(os.path.dirname(path) if os.path.isfile(path) else path) if os.path.exists(path) else None
    return state_dir if state_dir is not None and os.path.isfile(os.path.join(state_dir, MANIFEST)) else None


def _source_index_files(state_dir: str, generation: int) -> dict[str, str]:
    """label -> file name of the mixture source indexes of ``generation`` in ``state_dir``."""
    out = {}
    for name in _listdir(state_dir):
        m = SOURCE_INDEX_FILE.match(name)
        if m is not None and int(m.group(1) or 0) == generation:
            out[m.group(2)] = name
    return out


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
    """A sidecar file of the whole state: its fingerprint lists the files' identities (``fingerprint_files``
    held compactly: listed from the table they stand for), so that the file alone names a file that changed."""
    atomic_write(path, encode_state(state, fingerprint=fingerprint_files.expanded(state["stream"]["fingerprint"])))
    return path


def read_state_file(path: str) -> dict[str, Any]:
    """A sidecar file, verified by its self-digest. A rank file that holds only the digest of its dataset
    fingerprint takes the fingerprint from its stream_state directory (checked against the manifest there)."""
    data = _read_bytes(path, "sidecar", MAX_SIDECAR_BYTES)
    meta, _ = read_header_metadata(data, path)
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
    """This rank's sidecar for the next save into ``state_dir`` (complete once rank 0 wrote the manifest). With
    ``fingerprint_digest`` it holds only that digest (rank 0 writes ``fingerprint.json`` once)."""
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
            # on several nodes the usual cause: each node writes into a directory of its own
            raise SidecarError(f"stream state {state_dir!r}: {name} missing; cannot write the manifest. Every rank "
                               "writes its file there and rank 0 records them all, so with several nodes "
                               "train.output_dir must be one directory every node sees (a shared filesystem)")
        data = _read_bytes(p, "sidecar", MAX_SIDECAR_BYTES)
        files[rank_file_name(r)] = {"file": name, "bytes": len(data), "blake2b": _digest(data)}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world_size,
                "generation": generation, "files": files}
    for what in SHARED_FILES:   # the dataset's index and fingerprint saved with this generation: verified before use
        for extension in ("bin", "json"):
            name = shared_file_name(what, generation, extension)
            shared = os.path.join(state_dir, name)
            if os.path.isfile(shared):
                manifest[what] = {"file": name, **_size_and_digest(shared, f"dataset {what}")}
                break
    indexes = {}
    for label, name in sorted(_source_index_files(state_dir, generation).items()):   # a mixture's, per source
        indexes[label] = {"file": name, **_size_and_digest(os.path.join(state_dir, name),
                                                           f"dataset index of source {label!r}")}
    if indexes:
        manifest["indexes"] = indexes
    path = os.path.join(state_dir, MANIFEST)
    atomic_write(path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    current = ({e["file"] for e in files.values()} | {manifest[w]["file"] for w in SHARED_FILES if w in manifest}
               | {e["file"] for e in indexes.values()})
    for name in _listdir(state_dir):   # the previous generation (and files of a save that was cut short)
        if (RANK_FILE.match(name) or any(rx.match(name) for _, rx in SHARED_FILES.values())
                or SOURCE_INDEX_FILE.match(name)) and name not in current:
            try:
                os.unlink(os.path.join(state_dir, name))
            except OSError:
                pass
    return path


finish = write_manifest     # rank 0, once every rank wrote its file: the manifest completes the save


def _size_and_digest(path: str, what: str) -> dict[str, Any]:
    """``{"bytes", "blake2b"}`` of a dataset file: from what this process wrote when unchanged since (a 196 MB index
    is not hashed again), else read."""
    st = os.stat(path)
    for (_, digest), (target, size, mtime_ns) in list(_written.items()):
        if os.path.abspath(target) == os.path.abspath(path) and (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
            return {"bytes": size, "blake2b": digest}
    data = _read_bytes(path, what, MAX_INDEX_BYTES)
    return {"bytes": len(data), "blake2b": _digest(data)}


def _check_manifest_entry(name: str, entry: Any, path: str) -> None:
    ok = (isinstance(entry, dict) and is_int(entry.get("bytes"), 0, MAX_SIDECAR_BYTES)
          and _is_hex(entry.get("blake2b"), 32))
    if not ok:
        raise SidecarError(f"manifest {path!r}: corrupt field files[{name!r}]: got {entry!r:.80}; allowed: a mapping "
                           f"with bytes (an integer from 0 to {MAX_SIDECAR_BYTES}) and blake2b (32 hex digits)")
    file = entry.get("file", name)
    m = RANK_FILE.match(file) if isinstance(file, str) else None
    if m is None or m.group(1) != RANK_FILE.match(name).group(1):   # confined to this directory
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
    if not isinstance(manifest, dict):
        raise SidecarError(f"manifest {path!r}: not a resumable-stream manifest")
    check_format(manifest.get("format"), manifest.get("format_version"), path, "manifest")
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
            names = (f"{base[:-5]}.json, {base[:-5]}.bin, {base[:-5]}.gN.json or {base[:-5]}.gN.bin" if what == "index"
                     else f"{base} or {base[:-5]}.gN.json")
            raise SidecarError(f"manifest {path!r}: corrupt field {what}: got {entry!r:.80}; allowed: a mapping with "
                               f"file ({names} in the same directory), bytes (an integer from "
                               f"0 to {MAX_INDEX_BYTES}) and blake2b (32 hex digits)")
    indexes = manifest.get("indexes", {})
    if not isinstance(indexes, dict):
        raise SidecarError(f"manifest {path!r}: corrupt field indexes: got {indexes!r:.80}; allowed: a mapping of "
                           "mixture source labels to their index files")
    for label, entry in indexes.items():
        m = isinstance(entry, dict) and isinstance(entry.get("file"), str) and SOURCE_INDEX_FILE.match(entry["file"])
        if not (m and m.group(2) == label and is_int(entry.get("bytes"), 0, MAX_INDEX_BYTES)
                and _is_hex(entry.get("blake2b"), 32)):
            raise SidecarError(f"manifest {path!r}: corrupt field indexes[{label!r:.80}]: got {entry!r:.80}; allowed: "
                               f"a mapping with file (index-<label>.json / .bin or index.gN-<label>.json / .bin of that label, in "
                               f"the same directory), bytes (an integer from 0 to {MAX_INDEX_BYTES}) and blake2b "
                               "(32 hex digits)")
    return manifest


def read_shared_file(state_dir: str, manifest: dict[str, Any], what: str) -> tuple[str, bytes] | None:
    """(path, bytes) of the dataset ``index`` or ``fingerprint`` saved in ``state_dir`` (None without one); a file
    the manifest does not list or that differs from its entry is never used."""
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
    """(fingerprint, digest) saved once for every rank file of ``state_dir``; None when the rank files carry
    their own (whole files, e.g. ``peek --save-state`` of one rank of several, then ``finish``)."""
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
    """The index of mixture source ``label`` saved in ``state_dir`` (None without one), checked against the manifest."""
    manifest = read_manifest(state_dir) if manifest is None else manifest
    return _read_listed(state_dir, manifest.get("indexes", {}).get(label), f"dataset index of source {label!r}")


def state_dir_of(path: str) -> str | None:
    """The stream_state directory at ``path``: itself, or ``path/stream_state``."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or any(RANK_FILE.match(f) for f in _listdir(path)):
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
    """(state, file) of ``rank`` in a stream_state directory, checked against its manifest entry (read once, so what
    is checked is what is decoded). ``fingerprint``: the directory's, read here when not given."""
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
    return decode_state(data, file, fingerprint=fingerprint), file


def resolve_rank_state(path: str, rank: int) -> tuple[dict[str, Any], str]:
    """A sidecar file, a stream_state directory or a checkpoint directory -> (state, file) of this rank."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return read_state_file(path), path
    state_dir = find_state_dir(path)
    return read_rank_state(state_dir, read_manifest(state_dir), rank)
