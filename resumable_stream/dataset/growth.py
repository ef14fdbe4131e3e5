"""Datasets that grow (``data.growth``): the index lists every file read, new ones at the end, and
``growth.generations`` (``{"from_epoch", "files", "dropped"}``): epoch e reads the first ``files`` files of the
last generation with ``from_epoch <= e``, less its ``dropped`` (docs/growing-data.md#how-it-works).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..config import formats as registry
from ..config.specs import DataSpec, GrowthSpec, SourceSpec
from ..errors import ConfigError, SourceError, StreamMismatchError
from ..io.hub import commit_sha, hub_commits, unpinned
from ..io.net import RetryPolicy, is_remote, protocol_options
from ..limits import is_int
from ..runtime.collectives import broadcast_bytes, max_over_ranks, shared_over_dist
from ..runtime.threads import map_files
from ..sources import fingerprint_files
from ..sources.index import changed_files, describe_changes
from ..sources.resolve import (
    explicit_urls,
    file_identity,
    index_entry,
    known_identities,
    resolve_split,
    where_to_look,
)
from .index_message import encode_message, errors_sent, received

log = logging.getLogger(__name__)

KEY = "growth"


def generations(index: dict) -> list[dict[str, Any]]:
    """The index's generations, checked (an index may come from a damaged or forged checkpoint); an index
    written without growth is one generation: all its files from epoch 0."""
    n = len(index["files"])
    raw = index.get(KEY)
    if raw is None:
        return [{"from_epoch": 0, "files": n, "dropped": []}]
    gens = raw.get("generations") if isinstance(raw, dict) else None
    paths = {f["path"] for f in index["files"]}
    ok = isinstance(gens, list) and 0 < len(gens) <= 100_000
    last_epoch, last_files = -1, 0
    for g in gens if ok else []:
        ok = (isinstance(g, dict) and set(g) == {"from_epoch", "files", "dropped"}
              and is_int(g["from_epoch"], last_epoch + 1, 2**31 - 1) and is_int(g["files"], max(1, last_files), n)
              and isinstance(g["dropped"], list) and all(isinstance(p, str) and p in paths for p in g["dropped"]))
        if not ok:
            break
        last_epoch, last_files = g["from_epoch"], g["files"]
    if not ok or gens[0]["from_epoch"] != 0 or last_files != n:
        raise SourceError(f"dataset index: malformed {KEY!r}: expected generations {{from_epoch, files, dropped}} "
                          f"with increasing epochs from 0 and file counts up to the {n} files listed")
    return gens


def with_generations(index: dict, gens: list[dict[str, Any]]) -> dict:
    return {**index, KEY: {"generations": gens}}


def files_of(index: dict, gen: dict[str, Any]) -> list[str]:
    """The paths a generation reads, in index order."""
    dropped = set(gen["dropped"])
    return [f["path"] for f in index["files"][:gen["files"]] if f["path"] not in dropped]


def layout_generations(index: dict | None, shards: list) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``plan.Layout.generations``: per generation its first epoch and its shards (global shard ids)."""
    if index is None:      # a source given to the stream that is not read through an index
        raise ConfigError("data.growth: got 'append' for a source without a dataset index; allowed: off, or "
                          "append for indexed formats (parquet, webdataset, jsonl)")
    by_file: dict[str, list[int]] = {}
    for s in shards:
        by_file.setdefault(s.file, []).append(s.index)
    out = []
    for g in generations(index):
        out.append((g["from_epoch"], tuple(i for p in files_of(index, g) for i in by_file.get(p, ()))))
    return tuple(out)


def stable_fingerprint(dataset_fp: dict, index: dict, mode: str) -> dict:
    """What a growing dataset's resume check compares: the first generation's files (those a run starts with;
    the later ones are checked against the index, which the checkpoint carries) and the growth mode."""
    first = generations(index)[0]["files"]
    fp = {k: v for k, v in dataset_fp.items() if k not in ("num_shards", "shard_rows")}
    files = dataset_fp.get("files", [])
    fp["files"] = (fingerprint_files.compact(index["files"], first) if fingerprint_files.is_compact(files)
                   else list(files)[:first])
    if "hub_commits" in fp:       # the commits the first files come from (later ones: the index's)
        fp["hub_commits"] = hub_commits([f["path"] for f in index["files"][:first]])
    fp["growth"] = mode
    return fp


def describe(index: dict) -> list[dict[str, Any]] | None:
    """Per generation (``inspect``): from which epoch, how many files, those it added and dropped."""
    if index.get(KEY) is None:
        return None
    out, before = [], 0
    for g in generations(index):
        entry = {"from_epoch": g["from_epoch"], "files": g["files"] - len(g["dropped"]),
                 "added": [f["path"] for f in index["files"][before:g["files"]]], "dropped": list(g["dropped"])}
        commits = hub_commits(entry["added"])      # a Hub branch: the commit that brought the new files
        if commits:
            entry["hub_commits"] = commits
        out.append(entry)
        before = g["files"]
    return out


def joins_at(growth: GrowthSpec, index: dict, furthest: int) -> int:
    """The epoch new files join from, ``furthest`` being the furthest epoch a partition stands in: the next one;
    in follow mode ``furthest`` itself when no generation starts there or later (that epoch has no files, so
    no partition has read any of it: the partitions wait at its start for new files)."""
    if growth.mode == "follow" and not any(g["from_epoch"] >= furthest for g in generations(index)):
        return furthest
    return furthest + 1


def _forget_listings(targets: list[str], storage_options: dict) -> None:
    """Drop the directory listings fsspec keeps per filesystem instance (s3fs, HfFileSystem): a listing made
    before the data grew would hide the new files from this process's resolution."""
    import fsspec

    for target in targets:
        if "://" not in target:
            continue
        try:
            fs, _ = fsspec.core.url_to_fs(target, **protocol_options(storage_options, target))
            fs.invalidate_cache()
        except Exception:   # nothing cached, or a path fsspec cannot open: the resolution then says why
            pass


# {(repo, revision): (an index's file set, a later commit of the branch at which a full resolution found that
# same file set)}: a commit that touched no data file (a README) then costs one request at the next refresh too
_CHECKED_AT: dict[tuple[str, str | None], tuple[tuple, str]] = {}


def _file_set(index: dict) -> tuple:
    return tuple(f["path"] for f in index["files"]), repr(generations(index))


def _branch_unmoved(data: DataSpec, index: dict) -> bool:
    """A running job's Hub branch still points to the commit of the index's newest files, or to a later one found
    to hold the same files (one repo-info request): nothing changed. False off one Hub repo or when it fails."""
    pinned = [hub_commits([f["path"]]) for f in reversed(index["files"])]
    repos = {repo for p in pinned for repo in p}
    if len(repos) != 1:
        return False
    repo = repos.pop()
    newest = next(p[repo] for p in pinned if p)
    try:
        now = commit_sha(repo, data.revision)
    except Exception:
        return False
    return now == newest or _CHECKED_AT.get((repo, data.revision)) == (_file_set(index), now)


def _remember_unchanged(data: DataSpec, index: dict, files_now: list[str]) -> None:
    """A full resolution at the branch's commit found the index's files unchanged: remember that commit."""
    commits = hub_commits(files_now)
    if len(commits) == 1:
        repo, sha = next(iter(commits.items()))
        _CHECKED_AT[(repo, data.revision)] = (_file_set(index), sha)


def recheck(spec: SourceSpec, index: dict, from_epoch: int | None, where: str, running: bool = False,
            given: bool = False) -> dict | None:
    """``index`` checked against the data now (the files the config resolves to, the identities of those read):
    the one way a saved or given index is checked; a changed file is a StreamMismatchError naming it.
    Without growth (``from_epoch`` None) the files must be the same: else a ``given`` index is an error naming
    the change, a checkpoint's gives None (resolved afresh: the resume check names it). A growing dataset may
    gain files (a generation from ``from_epoch``), lose them only with ``data.growth_allow_removal``.
    ``running``: the job that built ``index`` asks again (an unmoved Hub branch: one request)."""
    data = spec.data
    path, data_files, targets, retry = where_to_look(spec)
    reader = registry.format_of_index(index).load()
    growing = from_epoch is not None
    listed = [f["path"] for f in index["files"]]
    now = explicit_urls(data, path, data_files)
    if not growing and now is not None:
        now = listed        # an explicit list of URLs: check_resolution compared it with the index's
    if now is None and growing and running and _branch_unmoved(data, index):
        return with_generations(index, generations(index))
    if now is None:     # resolved again (a Hub branch: its files pinned to the commit it points to now)
        if growing:
            _forget_listings(targets, retry.storage_options)
        now = resolve_split(spec, path, data_files, targets, retry).files
    if not growing:
        if now != listed:
            if not given:
                return None
            added, removed = sorted(set(now) - set(listed)), sorted(set(listed) - set(now))
            diffs = [(f"file added: {f}", None, f) for f in added] + [(f"file removed: {f}", f, None) for f in removed]
            raise StreamMismatchError(
                f"dataset index {where} does not list the files the config resolves to now (rebuild it with "
                f"`resumable-stream index`): " + "; ".join(w for w, _, _ in diffs[:12] or [("file order", 0, 0)]),
                diffs or [("file order", listed, now)])
        kept, removed, at_now = index["files"], [], {p: p for p in listed}
    else:
        gens = generations(index)
        at_now = {unpinned(p): p for p in now}      # a Hub file read at an older commit is the same file now
        removed = [p for p in files_of(index, gens[-1]) if unpinned(p) not in at_now]
        if removed and not spec.growth.allow_removal:
            raise StreamMismatchError(
                f"dataset index {where}: {len(removed)} file(s) it reads disappeared: {', '.join(removed[:12])}; "
                "with data.growth: append files may only be added (set data.growth_allow_removal: true to drop them "
                "from the next epoch on)", [(f"file removed: {p}", p, None) for p in removed])
        # the files read so far (and still there) must be those the index describes (a Hub file: at the new commit)
        gone = set(gens[-1]["dropped"])
        kept = [f for f in index["files"] if unpinned(f["path"]) in at_now and f["path"] not in gone]
        at_now = {f["path"]: at_now[unpinned(f["path"])] for f in kept}
    changes = changed_files({**index, "files": kept}, map_files(_identity_now(reader, at_now, retry), kept))
    if changes and (growing or given):
        head = (f"dataset index {where}: files it has read changed (a growing dataset may only gain files)" if growing
                else f"dataset index {where} does not match the data (rebuild it with `resumable-stream index`)")
        raise StreamMismatchError(f"{head}:\n{describe_changes(changes)}",
                                  [(f"file modified: {p} ({k})", a, b) for p, k, a, b in changes])
    if not growing:
        return None if changes else index
    return _grown(spec, index, from_epoch, where, running, reader, retry, now, removed)


def _identity_now(reader, at_now: dict[str, str], retry: RetryPolicy) -> Callable[[dict], dict]:
    """An index entry's identity now (a Hub file: at the commit ``at_now`` maps it to), compared as the file
    the index lists; an error naming the file in place of an identity that cannot be read."""
    asked = list(at_now.values())
    try:
        known = known_identities(asked, retry)     # Hub files and S3 objects in batches, not a request per file
    except SourceError:
        known = {}                                 # asked file by file below, each error named

    def identity(entry: dict) -> dict:
        where_now = at_now[entry["path"]]
        try:
            ident = known.get(where_now) or file_identity(where_now, retry)
        except SourceError as e:
            return {"path": entry["path"], "error": str(e)}
        if not is_remote(where_now) and isinstance(ident.get("size"), int):
            ident.update(reader.local_check(where_now, ident, retry, entry))
        return {**ident, "path": entry["path"]}

    return identity


def _grown(spec: SourceSpec, index: dict, from_epoch: int, where: str, running: bool, reader, retry: RetryPolicy,
           now: list[str], removed: list[str]) -> dict:
    """A growing ``index`` whose files were checked, with the files of ``now`` it does not list yet indexed and
    added as a generation from ``from_epoch`` (with ``removed`` dropped)."""
    gens = generations(index)
    listed = {unpinned(f["path"]) for f in index["files"]}
    added = [p for p in now if unpinned(p) not in listed]
    if not added and not removed:
        if running:
            _remember_unchanged(spec.data, index, now)
        return with_generations(index, gens)
    new_known = known_identities(added, retry)
    footers: dict[str, bytes] = {}
    entries = map_files(lambda f: index_entry(reader, f, retry, new_known.get(f) or file_identity(f, retry), footers,
                                              growing=True), added)
    # a file not complete yet (still being written) is not added: it is listed again at the next refresh
    added, entries = [f for f, e in zip(added, entries) if e is not None], [e for e in entries if e is not None]
    if not added and not removed:
        return with_generations(index, gens)
    for f, entry in zip(added, entries):
        # as build_index infers them (a parquet footer's schema; a tar's first samples)
        features = reader.infer_features(spec, entry, footers.get(f), retry)
        features = features.to_dict() if hasattr(features, "to_dict") else features
        if features != index["features"]:
            raise StreamMismatchError(
                f"data file {f!r} (new since {where}): its columns {sorted(features)} / types differ from the "
                f"dataset's {sorted(index['features'])}; files added to a growing dataset must match it",
                [(f"file added: {f} (features)", index["features"], features)])
    dropped = sorted(set(gens[-1]["dropped"]) | set(removed))
    # generations no partition has begun yet (added at an earlier resume) are replaced by this one
    begun = [g for g in gens if g["from_epoch"] < from_epoch] or gens[:1]
    gen = {"from_epoch": max(from_epoch, begun[-1]["from_epoch"] + 1), "files": len(index["files"]) + len(entries),
           "dropped": dropped}
    log.info("data.growth: %d file(s) added, %d dropped; they apply from epoch %d (%s)", len(added), len(removed),
             gen["from_epoch"], where)
    grown = {**index, "files": [*index["files"], *entries]}
    return with_generations(grown, [*begun, gen])


def resume(spec: SourceSpec, saved: dict, furthest: int, rank: int, world_size: int, where: str) -> dict:
    """The index a resume continues with when its state carries it: ``saved`` checked, new files joining after
    ``furthest`` (the furthest epoch begun in the job). Rank 0 lists the files and broadcasts (a collective)."""
    return _by_rank_zero(lambda: recheck(spec, saved, joins_at(spec.growth, saved, furthest), where),
                         shared_over_dist(rank, world_size), rank, "resume from the files the state lists")


def _by_rank_zero(make: Callable[[], dict | None], shared: bool, rank: int, what: str) -> dict | None:
    """``make()`` on rank 0 (or a lone process), its index (or None) broadcast to the other ranks of the job
    (the message a job's sources are opened with, ``index_message``)."""
    if shared and rank != 0:
        sent = received(what)["sources"][:1]
        return sent[0]["index"] if sent and sent[0] is not None else None
    with errors_sent(shared):
        index = make()
    if shared:
        broadcast_bytes(encode_message([None if index is None else {"index": index, "footers": {}}], {}))
    return index


def refresh(spec: SourceSpec, index: dict, furthest_here: int, rank: int, world_size: int,
            num_workers: int) -> dict | None:
    """A running job's ``refresh_files``: the grown index (None: no change), by rank 0 and broadcast; every
    rank passes the furthest epoch its partitions have begun, the new generation starts after the job's."""
    if num_workers:
        raise ConfigError(f"refresh_files: the stream is read by {num_workers} DataLoader workers, which read ahead "
                          "with the plan they started with; allowed: with num_workers 0, or take new files in at a "
                          "resume")
    shared = shared_over_dist(rank, world_size)
    if world_size > 1 and not shared:
        raise ConfigError(f"refresh_files: rank {rank} of {world_size} without an initialized torch.distributed "
                          "group; the ranks must agree on the epoch the files join from")
    furthest = max_over_ranks(furthest_here) if shared else furthest_here

    def grown() -> dict | None:
        new = recheck(spec, index, joins_at(spec.growth, index, furthest), "of the running job", running=True)
        changed = new[KEY]["generations"] != generations(index) or len(new["files"]) != len(index["files"])
        return new if changed else None

    return _by_rank_zero(grown, shared, rank, "take in the new files")
