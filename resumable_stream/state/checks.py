"""Resume checks: does a saved state belong to this stream? Each difference is named, old vs new."""

from __future__ import annotations

from typing import Any

from ..errors import StreamMismatchError
from ..sources.index import unreported_validator
from .relocation import is_relocation, relocated_files_diff, warn_relocated

# Fingerprint entries that map to config keys users can change, shown under those names.
_ORDER_KEYS = {"seed": "shuffle_seed", "buffer_size": "buffer_size", "shuffle": "shuffle",
               "interleave": "interleave_shards", "block_rows": "block_rows"}


def _files_diff(saved: list[dict], now: list[dict]) -> list[tuple[str, Any, Any]]:
    old = {f["path"]: f for f in saved}
    new = {f["path"]: f for f in now}
    out = []
    for path in sorted(set(old) - set(new)):
        out.append((f"file removed: {path}", old[path], None))
    for path in sorted(set(new) - set(old)):
        out.append((f"file added: {path}", None, new[path]))
    for path in sorted(set(old) & set(new)):
        a, b = old[path], new[path]
        for key in sorted(set(a) | set(b)):
            if key != "path" and a.get(key) != b.get(key) and not unreported_validator(key, a, b):
                what = "resized" if key == "size" else "modified"
                out.append((f"file {what}: {path} ({key})", a.get(key), b.get(key)))
    if not out and [f["path"] for f in saved] != [f["path"] for f in now]:
        out.append(("file order", [f["path"] for f in saved], [f["path"] for f in now]))
    return out


def fingerprint_diff(saved: dict, now: dict, prefix: str = "", moves: list[tuple[list, list]] | None = None,
                     source: str | None = None) -> list[tuple[str, Any, Any]]:
    """Every difference, named. Files under another root with the same relative paths are compared by
    content identity (see relocation.py) and appended to ``moves`` when given. ``source``: the mixture source
    being compared, named after each of its file differences."""
    out: list[tuple[str, Any, Any]] = []
    files_a, files_b = saved.get("files"), now.get("files")
    moved = isinstance(files_a, list) and isinstance(files_b, list) and is_relocation(files_a, files_b)
    if moved and moves is not None:
        moves.append((files_a, files_b))
    for key in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(key), now.get(key)
        name = f"{prefix}{key}"
        if key == "files" and isinstance(a, list) and isinstance(b, list):
            files = relocated_files_diff(a, b) if moved else _files_diff(a, b)
            out.extend(files if source is None else [(f"{w} of source {source!r}", x, y) for w, x, y in files])
        elif key == "dataset" and moved and isinstance(a, str) and isinstance(b, str):
            continue          # dataset_name_or_path names the old / new location of the same files
        elif isinstance(a, dict) and isinstance(b, dict):
            out.extend(fingerprint_diff(a, b, prefix=f"{name}.", moves=moves,
                                        source=str(key) if prefix == "sources." else source))
        elif a != b:
            out.append((name, a, b))
    return out


def _describe(diffs: list[tuple[str, Any, Any]]) -> str:
    lines = []
    for what, a, b in diffs[:12]:
        for short, key in _ORDER_KEYS.items():
            if what == f"order.{short}":
                what = f"data.{key}"
        lines.append(f"  {what}: saved {a!r}, now {b!r}")
    if len(diffs) > 12:
        lines.append(f"  ... and {len(diffs) - 12} more")
    return "\n".join(lines)


def _revision_hint(diffs: list[tuple[str, Any, Any]]) -> str:
    """What to do when a Hub repo moved to another commit since the state was saved."""
    moved = [(what.split("hub_commits.", 1)[1], a, b) for what, a, b in diffs if "hub_commits." in what]
    return "".join(f" The Hub repo {repo!r} is at commit {b!r} now, the run started on {a!r}: set data.revision: "
                   f"{a} to resume on the data it started with." for repo, a, b in moved if a and b)


def check_fingerprint(saved: dict, now: dict, where: str) -> None:
    moves: list[tuple[list, list]] = []
    diffs = fingerprint_diff(saved, now, moves=moves)
    if not diffs:
        for old, new in moves:
            warn_relocated(old, new)
    if diffs:
        raise StreamMismatchError(
            f"{where}: the saved stream state was written for different data or settings; resuming would "
            f"read other samples than the interrupted run.{_revision_hint(diffs)} "
            f"Differences:\n{_describe(diffs)}",
            diffs,
        )


def check_topology(saved: dict, now: dict, where: str, elastic: bool = False,
                   compare_partitions: bool = True) -> bool:
    """May a state saved under topology ``saved`` resume under ``now``? True: same ranks and workers, the
    state continues exactly as saved; False: another topology, allowed with ``elastic`` (every virtual
    partition then continues from its own cursor). ``compare_partitions``: num_partitions is set in the
    config (else it is taken from the saved state and cannot differ)."""
    n_saved, n_now = saved.get("num_partitions"), now.get("num_partitions")
    if compare_partitions and n_saved != n_now:
        raise StreamMismatchError(
            f"{where}: data.num_partitions: saved {n_saved!r}, now {n_now!r}; the virtual partitions decide which "
            f"rows each partition reads, so their number cannot change during a run: set data.num_partitions: "
            f"{n_saved} (or null to take it from the checkpoint)",
            [("num_partitions", n_saved, n_now)],
        )
    diffs = [(k, saved.get(k), now.get(k)) for k in ("world_size", "num_workers") if saved.get(k) != now.get(k)]
    if not diffs:
        check_rank(saved.get("rank"), now.get("rank"), where)
        return True
    if not elastic:
        if not compare_partitions and n_saved != n_now:
            diffs.append(("num_partitions", n_saved, n_now))
        raise StreamMismatchError(
            f"{where}: the saved stream state was written for another topology; resume with the same number "
            f"of ranks and DataLoader workers, or set data.elastic: true to resume on this one (each of the "
            f"{n_saved} virtual partitions then continues from its own cursor; keep data.num_partitions "
            f"{n_saved} or null). Differences:\n{_describe(diffs)}",
            diffs,
        )
    return False


_LOAD_THE_MATCHING_RANK = (
    "load the matching rank's file (or the stream_state / checkpoint directory). accelerate's "
    "register_for_checkpointing saves the main process's state only: save every rank's with "
    "save_sidecar(dir) (rank 0 adds checkpoint.finish) and load it with load_sidecar(dir)")


def check_rank(saved_rank: Any, rank: Any, where: str, whose: str = "this is",
               cure: str = _LOAD_THE_MATCHING_RANK, listed: bool = True) -> None:
    """A rank's saved state is that rank's: the resume's check (:func:`check_topology`: against this
    process's rank) and ``inspect``'s (against the rank a rank file's name says: ``whose`` and ``cure`` say
    so; ``listed=False``: one line, without the differences block). A saved rank of None (a state gathered
    from several ranks' files) is any rank's."""
    if saved_rank is not None and saved_rank != rank:
        diffs = [("rank", saved_rank, rank)]
        tail = f". Differences:\n{_describe(diffs)}" if listed else ""
        raise StreamMismatchError(f"{where}: the saved stream state is rank {saved_rank}'s, {whose} rank {rank}; "
                                  f"{cure}{tail}", diffs)


def same_topology(saved: dict, now: dict) -> bool:
    """Same ranks and DataLoader workers: the saved interleaving of partitions continues unchanged."""
    return all(saved.get(k) == now.get(k) for k in ("world_size", "num_workers"))
