"""Resume checks: does a saved state belong to this stream? Each difference is named, old vs new."""

from __future__ import annotations

from typing import Any

from ..errors import StreamMismatchError
from ..sources.fingerprint_files import is_compact
from .relocation import announce, compare_files

# Fingerprint entries that map to config keys users can change, shown under those names.
_ORDER_KEYS = {"seed": "shuffle_seed", "buffer_size": "buffer_size", "shuffle": "shuffle",
               "interleave": "interleave_shards", "block_rows": "block_rows"}


def fingerprint_diff(saved: dict, now: dict, prefix: str = "", moves: list[tuple] | None = None,
                     source: str | None = None) -> list[tuple[str, Any, Any]]:
    """Every difference, named. Files moved under another root are compared by content (relocation.py), the move's
    note appended to ``moves``; ``source``: the mixture source being compared."""
    out: list[tuple[str, Any, Any]] = []
    files = compare_files(saved.get("files"), now.get("files"))
    moved = files is not None and files.moved is not None
    if moved and moves is not None:
        moves.append(files.moved)
    for key in sorted(set(saved) | set(now), key=str):
        a, b = saved.get(key), now.get(key)
        name = f"{prefix}{key}"
        if key == "files" and files is not None:
            if not files.named:       # the identities of a side are not at hand: the values themselves
                out.append((name, a, b))
                continue
            out.extend(files.diffs if source is None else [(f"{w} of source {source!r}", x, y)
                                                           for w, x, y in files.diffs])
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


def _unlisted_hint(diffs: list[tuple[str, Any, Any]]) -> str:
    """When a side's files are only their count and digest (``fingerprint_files``), and the index they stand for
    is not at hand: where the identities are."""
    if not any(what.endswith("files") and (is_compact(a) or is_compact(b)) for what, a, b in diffs):
        return ""
    return (" The data files differ: the state holds their count and digest, and the files they stand for are "
            "in the dataset index its checkpoint saved (stream_state/index.bin): load the state from its "
            "stream_state or checkpoint directory to have each file that differs named.")


def check_fingerprint(saved: dict, now: dict, where: str) -> None:
    moves: list[tuple] = []
    diffs = fingerprint_diff(saved, now, moves=moves)
    if diffs:
        raise StreamMismatchError(
            f"{where}: the saved stream state was written for different data or settings; resuming would "
            f"read other samples than the interrupted run.{_revision_hint(diffs)}{_unlisted_hint(diffs)} "
            f"Differences:\n{_describe(diffs)}", diffs)
    for note in moves:
        announce(note)


def check_topology(saved: dict, now: dict, where: str, elastic: bool = False,
                   compare_partitions: bool = True) -> bool:
    """May a state saved under ``saved`` resume under ``now``? True: same ranks and workers (continues exactly);
    False: another topology, allowed with ``elastic``. ``compare_partitions``: num_partitions is configured."""
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
    "load the matching rank's file (or the stream_state / checkpoint directory). A stream's state_dict() and "
    "a StreamLoader(per_rank_state=True)'s are one rank's: keep every rank's, or take the job's from a "
    "StreamLoader's state_dict() (whatever rank's copy is kept restores every rank)")


def check_rank(saved_rank: Any, rank: Any, where: str, whose: str = "this is",
               cure: str = _LOAD_THE_MATCHING_RANK, listed: bool = True) -> None:
    """A rank's saved state is that rank's (the resume's check, and ``inspect``'s against the rank a file name says:
    ``whose``, ``cure``; ``listed=False``: one line). A saved rank of None (gathered) is any rank's."""
    if saved_rank is not None and saved_rank != rank:
        diffs = [("rank", saved_rank, rank)]
        tail = f". Differences:\n{_describe(diffs)}" if listed else ""
        raise StreamMismatchError(f"{where}: the saved stream state is rank {saved_rank}'s, {whose} rank {rank}; "
                                  f"{cure}{tail}", diffs)


def same_topology(saved: dict, now: dict) -> bool:
    """Same ranks and DataLoader workers: the saved interleaving of partitions continues unchanged."""
    return all(saved.get(k) == now.get(k) for k in ("world_size", "num_workers"))
