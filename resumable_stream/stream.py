"""``ResumableStream``: a torch IterableDataset over a HF dataset that saves and resumes exactly.

The interface the loader, the trainer patch and mixtures build on:

* ``partitions``: the virtual partitions this rank reads (sorted); ``lanes``: the same, split per
  DataLoader worker (``lanes[w]`` for worker w, one lane without workers); both from
  :func:`plan.partition_lanes`, the one place that decides who reads what;
* ``iter_partition(p)``: ``(sample, (shard, row))`` pairs of one partition, from its cursor;
* ``partition_state(p)``, ``partition_epoch(p)``: one partition's position / current epoch;
* ``state_dict(partitions=...)`` / ``load_state_dict(state, where)``: the rank's state (per-partition
  states replaceable by what training consumed); ``read_sidecar(path)`` returns the state of this
  rank's partitions from a checkpoint, gathered from several rank files after an elastic change;
* ``fingerprint()``, ``topology()``, ``transform_fingerprint``, ``set_epoch(e)``, ``rank``,
  ``world_size``, ``num_workers``, ``source``, ``config``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .checks import check_fingerprint, check_topology
from .config import StreamConfig
from .errors import ConfigError, SidecarError, StreamMismatchError
from .job_source import open_job_source, write_state_index
from .partition import Cursor, PartitionReader, sample_digest
from .plan import Layout, check_consumers, partition_lanes, partition_owner
from .sidecar import (
    FORMAT_VERSION,
    find_state_dir,
    rank_file_name,
    read_manifest,
    read_rank_state,
    read_state_file,
    write_manifest,
    write_rank_file,
    write_state_file,
)
from .source import Source

log = logging.getLogger(__name__)
_warned: set[tuple] = set()


def _default_topology() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_topology(rank: int | None, world_size: int | None, num_workers: int) -> tuple[int, int]:
    """(rank, world_size), defaulting to torch.distributed / $RANK / $WORLD_SIZE; ConfigError if invalid."""
    d_rank, d_world = _default_topology()
    rank = d_rank if rank is None else rank
    world_size = d_world if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ConfigError(f"world_size: got {world_size!r}; allowed: an integer >= 1")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"rank: got {rank!r}; allowed: an integer in [0, {world_size})")
    if not (isinstance(num_workers, int) and num_workers >= 0):
        raise ConfigError(f"num_workers: got {num_workers!r}; allowed: an integer >= 0")
    return rank, world_size


def round_robin(stream, live: dict[int, Iterator], parts: list[int], saved_turn: bool) -> Iterator:
    """Item by item from the iterators ``live`` in the order of ``parts``, skipping those that end. With
    ``saved_turn`` the rotation starts at, and is kept in, ``stream._turn`` (part of its saved state)."""
    turn = stream._turn if saved_turn else 0
    while live:
        p = parts[turn % len(parts)]
        turn = (turn + 1) % len(parts)
        if saved_turn:
            stream._turn = turn
        it = live.get(p)
        if it is None:
            continue
        try:
            yield next(it)
        except StopIteration:
            del live[p]


class SidecarMixin:
    """Sidecar files of a stream (ResumableStream, MixtureStream): write this rank's state, read it back,
    and after an elastic change of ranks / workers gather this rank's partitions from the old rank files.

    The stream provides ``rank``, ``world_size``, ``partitions``, ``num_partitions``, ``state_dict()``,
    ``load_state_dict(state, where)``, ``_check_saved_fingerprint(state, where)``,
    ``_adopt_topology(topology, where)`` (True when ranks and workers are unchanged) and
    ``_entry_partition(entry)``: the virtual partition a saved entry belongs to."""

    _TOPOLOGY_KEYS = ("world_size", "num_workers", "num_partitions")

    def _track_worker_reads(self) -> None:
        """A flag DataLoader workers share with this (main-process) object: a plain DataLoader with workers
        reads copies of the stream, so this object's cursors never move and its state would say that
        nothing was consumed; ``state_dict`` then refuses instead of silently restarting from the start."""
        import multiprocessing

        self._read_by_workers = multiprocessing.RawValue("b", 0)

    def _note_worker_read(self) -> None:
        if torch.utils.data.get_worker_info() is not None:
            self._read_by_workers.value = 1

    def _check_not_read_by_workers(self) -> None:
        # inside a worker the copy's state is that worker's own, exact (torchdata's StatefulDataLoader uses it)
        if self._read_by_workers.value and torch.utils.data.get_worker_info() is None:
            raise ConfigError(
                f"{type(self).__name__}.state_dict(): the stream was read by DataLoader worker processes, which "
                "read copies of it: this object does not know what they consumed (and they prefetch ahead). "
                "Read it through resumable_stream.loader.StreamLoader(stream, batch_size, num_workers=...) and "
                "take the state from the StreamLoader (state_dict / save_sidecar), or read it without workers")

    def _entry_partition(self, entry: int) -> int:
        return entry

    def read_sidecar(self, path: str | os.PathLike) -> tuple[dict[str, Any], str]:
        """(state, description) of this rank's partitions from a sidecar file, a stream_state directory or
        a checkpoint directory. Same topology: this rank's file. After a change of ranks or workers
        (``data.elastic``): the partitions this rank reads now, gathered from the files of the ranks
        that read them, every file checked against the manifest and this stream's fingerprint. Takes
        the saved num_partitions when data.num_partitions is null."""
        path = os.fspath(path)
        if os.path.isfile(path):
            return read_state_file(path), f"sidecar {path!r}"
        state_dir = find_state_dir(path)
        manifest = read_manifest(state_dir)
        first_rank = self.rank if rank_file_name(self.rank) in manifest["files"] else 0
        first, first_file = read_rank_state(state_dir, manifest, first_rank)
        where = f"sidecar {first_file!r}"
        self._check_saved_fingerprint(first, where)
        if self._adopt_topology(first["topology"], where):
            return first, where
        # elastic: gather this rank's partitions from the ranks that read them before
        mine = set(self.partitions)

        def owned(state: dict) -> dict:
            return {e: ps for e, ps in state["partitions"].items() if self._entry_partition(int(e)) in mine}

        saved_world = int(manifest["world_size"])
        owners = sorted({partition_owner(p, self.num_partitions, saved_world) for p in self.partitions})
        merged = owned(first)
        for r in owners:
            if r == first_rank:
                continue
            state, file = read_rank_state(state_dir, manifest, r)
            self._check_saved_fingerprint(state, f"sidecar {file!r}")
            topo = state["topology"]
            if any(topo[k] != first["topology"][k] for k in self._TOPOLOGY_KEYS):
                raise SidecarError(f"stream state {state_dir!r}: {rank_file_name(r)} has topology {topo}, "
                                   f"{rank_file_name(first_rank)} {first['topology']}: not one run's checkpoint")
            merged.update(owned(state))
        topology = {k: first["topology"][k] for k in self._TOPOLOGY_KEYS}
        where = f"stream state {state_dir!r} (ranks {owners} of {saved_world})"
        return {"format_version": first["format_version"], "fingerprint": first["fingerprint"],
                "topology": {**topology, "rank": None}, "turn": 0, "partitions": merged}, where

    def save_sidecar(self, path: str | os.PathLike) -> str:
        """Write this rank's state. ``path`` is a ``.safetensors`` file or a directory (then
        ``rank-NNNNN.safetensors`` inside it, plus the manifest when world_size is 1)."""
        return self.write_sidecar(path, self.state_dict())

    def write_sidecar(self, path: str | os.PathLike, state: dict, manifest: bool | None = None) -> str:
        """Write ``state`` (this stream's, or a loader's over it) where ``save_sidecar`` says; ``manifest``:
        write it now (default: when world_size is 1; a trainer writes it itself once the checkpoint is done)."""
        path = os.fspath(path)
        if path.endswith(".safetensors"):
            return write_state_file(path, state)
        file = write_rank_file(path, self.rank, state)
        self.save_index(path)
        if self.world_size == 1 if manifest is None else manifest:
            write_manifest(path, self.world_size)
        return file

    def save_index(self, state_dir: str) -> None:
        """Rank 0: the dataset index next to the rank files (listed in the manifest written after it), so that
        a resume from this state opens the stream without resolving the dataset again."""
        if self.rank == 0:
            write_state_index(state_dir, getattr(self.source, "index", None))

    def load_sidecar(self, path: str | os.PathLike) -> None:
        """Restore from a sidecar file, a stream_state directory or a checkpoint directory."""
        state, where = self.read_sidecar(path)
        self.load_state_dict(state, where=where)


class ResumableStream(SidecarMixin, torch.utils.data.IterableDataset):
    """The samples of one rank, as dicts with the dataset's own columns, in a resumable order.

    The data is cut into ``data.num_partitions`` ordered virtual partitions (default: ranks x
    DataLoader workers, one per consumer); each rank reads its own, each DataLoader worker one lane
    of them. ``num_workers`` is the DataLoader worker count the stream will be read with (0: the
    main process). Iterating in the main process interleaves this rank's partitions sample by sample.
    """

    def __init__(self, config: StreamConfig, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, source: Source | None = None, index_from: str | None = None):
        super().__init__()
        self._track_worker_reads()
        if not isinstance(config, StreamConfig):
            raise ConfigError(f"config: got {type(config).__name__}; allowed: a StreamConfig")
        rank, world_size = resolve_topology(rank, world_size, num_workers)
        self.config, self.rank, self.world_size, self.num_workers = config, rank, world_size, num_workers
        # index_from: a checkpoint about to be resumed (by a loader or trainer), whose saved index may be reused
        self.source = source if source is not None else open_job_source(config, rank, world_size, index_from)
        if config.cache_dir and not getattr(self.source, "is_cached", False):
            from .cache import CachedSource  # local block cache around the source (never changes results)

            self.source = CachedSource(self.source, config)
        self._epoch_limit: int | None = None
        self.transform_fingerprint: dict | None = None   # set by the loader when a transform follows
        self._set_partitions(config.num_partitions or world_size * max(1, num_workers))
        if config.resume_state_path:
            self.load_sidecar(config.resume_state_path)

    def _set_partitions(self, num_partitions: int, key: str = "data.num_partitions") -> None:
        """(Re)build the plan for ``num_partitions`` virtual partitions and this rank's readers (fresh cursors)."""
        slots = max(1, self.num_workers)
        check_consumers(num_partitions, self.world_size, slots, key)
        self.layout = Layout(
            num_shards=len(self.source.shards),
            row_counts=tuple(s.num_rows for s in self.source.shards),
            num_partitions=num_partitions,
            seed=self.config.shuffle_seed, shuffle=self.config.shuffle, buffer_size=self.config.buffer_size,
            interleave=self.config.interleave_shards, block_rows=self.config.block_rows,
        )
        consumers = self.world_size * slots
        if self.layout.strided and (note := ("strided", id(self.source), num_partitions)) not in _warned:
            _warned.add(note)
            log.warning(
                "dataset has %d shards for %d partitions: every partition reads every shard and keeps every %d-th "
                "row; give it more files or row groups to read less",
                self.layout.num_shards, num_partitions, num_partitions)
        if num_partitions % consumers and (note := ("uneven", num_partitions, consumers)) not in _warned:
            _warned.add(note)
            log.warning("%d virtual partitions over %d consumers (ranks x workers): some read %d partitions, others "
                        "%d, so they move through an epoch at different speeds", num_partitions, consumers,
                        -(-num_partitions // consumers), num_partitions // consumers)
        self.lanes = partition_lanes(num_partitions, self.world_size, slots, self.rank)
        self.partitions = sorted(p for lane in self.lanes for p in lane)
        self._readers = {p: PartitionReader(self.source, self.layout, p) for p in self.partitions}
        self._turn = 0
        self._expect: dict[int, str] = {}   # partition -> digest its next sample must have (after a load)

    @property
    def num_partitions(self) -> int:
        return self.layout.num_partitions

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        c = self.config
        fp = {
            "dataset": self.source.fingerprint,
            "order": {"shuffle": c.shuffle, "seed": c.shuffle_seed, "buffer_size": c.buffer_size,
                      "interleave": c.interleave_shards, "block_rows": c.block_rows},
        }
        if self.transform_fingerprint is not None:
            fp["transform"] = self.transform_fingerprint
        return fp

    def topology(self) -> dict[str, int]:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers,
                "num_partitions": self.layout.num_partitions}

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` only: continue it if a partition is inside it, else start it.

        Without ``set_epoch`` the stream is endless: each partition moves on to the next epoch by itself.
        """
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ConfigError(f"epoch: got {epoch!r}; allowed: an integer >= 0")
        self._epoch_limit = epoch
        for p, reader in self._readers.items():
            # inside `epoch`: continue; past it: done for this epoch; before it: start it
            if reader.cursor.epoch < epoch:
                consumed = reader.cursor.consumed
                reader.set_cursor(Cursor(epoch=epoch, consumed_before=consumed, chain=reader.cursor.chain,
                                         epoch_start=consumed))
                self._expect.pop(p, None)

    def set_endless(self) -> None:
        """Undo :meth:`set_epoch`: iterate endlessly again, each partition rolling over into its next epoch."""
        self._epoch_limit = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict]:
        self._note_worker_read()
        info = torch.utils.data.get_worker_info()
        if info is None:
            parts = self.partitions
        else:
            if info.num_workers != max(1, self.num_workers) or (self.num_workers == 0):
                raise ConfigError(
                    f"num_workers: the stream was created for {self.num_workers} DataLoader workers but is read by "
                    f"{info.num_workers}; create it with num_workers={info.num_workers}")
            parts = self.lanes[info.id]
        if len(parts) == 1:
            return self._iter_partition(self._readers[parts[0]])
        return self._iter_round_robin(parts, saved_turn=info is None)

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, tuple[int, int]]]:
        """(sample, (shard, row)) pairs of one partition: what the loader's workers read."""
        reader = self._readers[partition]
        for sample in self._iter_partition(reader):
            yield sample, reader.sample_key(reader.offset - 1)

    def _iter_partition(self, reader: PartitionReader) -> Iterator[dict]:
        finite = self._epoch_limit is not None
        while True:
            if finite and reader.cursor.epoch > self._epoch_limit:
                return
            win = reader.window(rollover=not finite)
            if win is None:
                return
            i, n = reader.offset, len(win)
            expected = self._expect.pop(reader.partition, None)
            if expected is not None:
                self._verify_first(reader, win.sample(i), expected)
            names, rows = win.names, win.rows
            while i < n:
                sample = dict(zip(names, rows[i]))
                i += 1
                reader.offset = i      # consumed once handed out: a save now resumes after it
                yield sample

    def _iter_round_robin(self, parts: list[int], saved_turn: bool) -> Iterator[dict]:
        """Sample by sample over ``parts``; in the main process the turn is part of the saved state."""
        return round_robin(self, {p: self._iter_partition(self._readers[p]) for p in parts}, parts, saved_turn)

    def _verify_first(self, reader: PartitionReader, sample: dict, expected: str) -> None:
        got = sample_digest(sample)
        if got != expected:
            raise StreamMismatchError(
                f"partition {reader.partition} (rank {self.rank}): the first sample after resume is not the one "
                f"recorded at save time (digest saved {expected}, now {got}); the data content changed although "
                "the file list, sizes and versions did not",
                [("next_sample_digest", expected, got)],
            )

    # ------------------------------------------------------------------ state
    def partition_epoch(self, partition: int) -> int:
        """The epoch ``partition`` is in (its next sample's, once the previous epoch is fully consumed)."""
        return self._readers[partition].epoch

    def close(self) -> None:
        """Stop reading: close every open shard now, so no reader (nor the native threads of a pyarrow scan
        behind it) outlives its use. Iterating again reopens the shards where the cursors stand."""
        for reader in self._readers.values():
            reader.close()

    def partition_state(self, partition: int) -> dict[str, Any]:
        """One partition's position after the last sample it yielded, with the digest of the next one.

        ``epoch_start`` (samples consumed before the current epoch) and ``epoch_rows`` (rows of the
        current epoch, None if unknown) are for progress reports only."""
        reader = self._readers[partition]
        win = reader.window(rollover=True)   # the next sample is needed for its digest
        c = reader.cursor
        return {
            **{f: getattr(c, f) for f in Cursor.FIELDS},
            "slots": [list(s) for s in c.slots],
            "chain": c.chain.hex(),
            "consumed": c.consumed,
            "consumed_digest": reader.consumed_digest(),
            "next_sample_digest": sample_digest(win.sample(c.offset)),
            "epoch_start": c.epoch_start,
            "epoch_rows": self.layout.partition_rows(c.epoch, partition),
        }

    def state_dict(self, partitions: dict[int, dict] | None = None) -> dict[str, Any]:
        """The position after the last sample this stream yielded (per partition).

        ``partitions`` replaces the per-partition states (the loader passes what training consumed).
        """
        if partitions is None:
            self._check_not_read_by_workers()
        parts = {p: (partitions or {}).get(p) or self.partition_state(p) for p in self.partitions}
        return {"format_version": FORMAT_VERSION, "fingerprint": self.fingerprint(), "topology": self.topology(),
                "turn": self._turn, "partitions": parts}

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state",
                        verify_next_sample: bool = True) -> None:
        """Continue every partition of this rank from its saved cursor.

        Same ranks and workers: the state must be this rank's and the interleaving continues exactly.
        Other ranks / workers (``data.elastic``): ``state`` must hold at least this rank's partitions
        (see :meth:`read_sidecar`); each continues from its cursor, the interleaving starts afresh.
        ``verify_next_sample=False`` skips the content check of each partition's first sample (for
        readers of other data than the rows, e.g. the warmup planner's row numbers)."""
        if state.get("format_version") != FORMAT_VERSION:
            raise StreamMismatchError(f"{where}: format version {state.get('format_version')!r}, expected "
                                      f"{FORMAT_VERSION}")
        self._read_by_workers.value = 0   # the position is the loaded one again
        self._check_saved_fingerprint(state, where)
        same = self._adopt_topology(state["topology"], where)
        saved_parts = {int(p): ps for p, ps in state["partitions"].items()}
        if same and sorted(saved_parts) != self.partitions:
            raise StreamMismatchError(f"{where}: holds partitions {sorted(saved_parts)}, this rank owns "
                                      f"{self.partitions}")
        missing = [p for p in self.partitions if p not in saved_parts]
        if missing:
            raise StreamMismatchError(f"{where}: holds partitions {sorted(saved_parts)}, this rank reads "
                                      f"{self.partitions} after the topology change; load a stream_state or "
                                      "checkpoint directory so they are gathered from every rank's file")
        for p in self.partitions:
            ps = saved_parts[p]
            self._check_cursor_bounds(p, ps, where)
            cursor = Cursor(
                **{f: int(ps[f]) for f in Cursor.FIELDS},
                slots=tuple((int(a), int(b)) for a, b in ps["slots"]),
                chain=bytes.fromhex(ps["chain"]),
                epoch_start=ps.get("epoch_start"),
            )
            self._readers[p].set_cursor(cursor)
            if verify_next_sample:
                self._expect[p] = ps["next_sample_digest"]
        self._turn = int(state.get("turn", 0)) if same else 0
        if self._epoch_limit is not None:     # set_epoch before the load: apply it to the loaded cursors
            self.set_epoch(self._epoch_limit)

    def _check_cursor_bounds(self, p: int, ps: dict[str, Any], where: str) -> None:
        """A saved cursor points inside partition ``p``'s data (its shards of its epoch, their rows, one
        window): a corrupt or forged state is a SidecarError naming the field, not an IndexError later."""
        lay = self.layout

        def require(ok: bool, field: str, value: Any, allowed: str) -> None:
            if not ok:
                raise SidecarError(f"{where}: corrupt field partitions[{p}].{field}: got {value!r:.80}; allowed: "
                                   f"{allowed}")

        require(0 <= ps["epoch"] < 2**31, "epoch", ps["epoch"], "an integer in [0, 2**31)")
        shards = lay.shards_for(ps["epoch"], p)
        require(0 <= ps["next_pos"] <= len(shards), "next_pos", ps["next_pos"],
                f"0 .. {len(shards)} (the partition's shards in epoch {ps['epoch']})")
        slots = list(ps["slots"])
        require(len(slots) <= lay.open_slots, "slots", slots, f"at most {lay.open_slots} open shards")
        for pos, row in slots:
            require(0 <= pos < ps["next_pos"] and [q for q, _ in slots].count(pos) == 1, "slots", slots,
                    f"distinct shard positions below next_pos {ps['next_pos']}")
            count = lay.row_counts[shards[pos]]
            require(0 <= row and (count is None or row <= count), "slots", slots,
                    f"rows within their shard ({count} rows in shard {shards[pos]})")
        require(0 <= ps["rr"] < max(1, len(slots)), "rr", ps["rr"], f"0 .. {max(1, len(slots)) - 1}")
        require(0 <= ps["rr_taken"] < lay.block, "rr_taken", ps["rr_taken"], f"0 .. {lay.block - 1}")
        require(0 <= ps["offset"] <= lay.buffer_size, "offset", ps["offset"], f"0 .. {lay.buffer_size} (one window)")
        require(0 <= ps["window"] and 0 <= ps["consumed_before"], "window", ps["window"], "an integer >= 0")

    def _check_saved_fingerprint(self, state: dict[str, Any], where: str) -> None:
        saved_fp = state["fingerprint"]
        if self.transform_fingerprint is None and "transform" in saved_fp:
            # a bare stream (e.g. peek) reading a training checkpoint: it shows raw samples from the
            # cursor; the transform's state is the loader's to check
            saved_fp = {k: v for k, v in saved_fp.items() if k != "transform"}
        check_fingerprint(saved_fp, self.fingerprint(), where)

    def _adopt_topology(self, saved: dict[str, Any], where: str) -> bool:
        """Check a saved topology against this stream's; take its num_partitions when data.num_partitions
        is null. True when ranks and workers are unchanged (the state continues exactly as saved)."""
        configured = self.config.num_partitions is not None
        same = check_topology(saved, self.topology(), where, elastic=self.config.elastic,
                              compare_partitions=configured)
        saved_n = int(saved["num_partitions"])
        if saved_n != self.layout.num_partitions:
            self._set_partitions(saved_n, key=f"{where}: num_partitions (taken from the saved state because "
                                              "data.num_partitions is null)")
        return same

    def sample_key(self, partition: int) -> tuple[int, int]:
        """(shard, row) of the sample ``partition`` yielded last."""
        reader = self._readers[partition]
        return reader.sample_key(reader.offset - 1)

