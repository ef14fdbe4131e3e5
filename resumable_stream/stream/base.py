"""The stream core: the :class:`Stream` protocol and what a single stream and a mixture share (topology,
iteration with the saved turn, the state envelope and loading it with its checks). Files and directories are
:mod:`resumable_stream.state.checkpoint`'s; a subclass reads, saves and restores one partition."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError, StreamMismatchError
from ..io import budget as request_budget
from ..limits import MAX_WORLD_SIZE
from ..observe.progress import mean_position
from ..plan import check_consumers, partition_lanes
from ..runtime.torch_compat import IterableDataset, worker_info
from ..state import checkpoint
from ..state.checks import check_fingerprint, check_topology
from ..state.sidecar import FORMAT_VERSION


@runtime_checkable
class Stream(Protocol):
    """What readers of a stream (the loader, the integrations) rely on. ``partitions``: the virtual partitions this
    rank reads (sorted); ``lanes[w]``: those DataLoader worker w reads (one lane without workers)."""

    config: Any
    rank: int
    world_size: int
    num_workers: int
    num_partitions: int
    partitions: list[int]
    lanes: list[list[int]]
    source: Any
    transform_fingerprint: dict | None
    follows: bool       # data.growth: follow: the loader reads in rounds through ``follower`` (stream/follow.py)
    follower: Any       # that Follower, or None

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, Any]]:
        """(sample, where) pairs of one partition from its cursor; ``where`` names the sample's row."""

    def source_label(self, where: Any) -> str | None:
        """The label of the mixture source a sample came from (None for a single dataset)."""

    def partition_state(self, partition: int) -> Any:
        """The typed state of one partition (``state_type``: a PartitionState or a MixturePartitionState);
        ``state_dict()`` holds its ``to_dict()``."""

    def partition_epoch(self, partition: int) -> int: ...

    def partition_position(self, partition: int) -> float | None:
        """Epochs one partition consumed (fractional), from what its consumer published: any thread may call
        it (it moves and builds nothing); None when unknown."""

    def data_epoch(self) -> float | None:
        """The mean of this rank's :meth:`partition_position`; any thread."""

    def fingerprint(self) -> dict[str, Any]: ...

    def state_fingerprint(self) -> dict[str, Any]: ...

    def topology(self) -> dict[str, int]: ...

    def state_dict(self, partitions: dict[int, dict] | None = None) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None: ...

    def check_saved_identity(self, state: dict[str, Any], where: str) -> None:
        """A saved state is of this kind of stream and of the same data, order and transform (else raises)."""

    def adopt_topology(self, saved: dict[str, Any], where: str) -> bool:
        """Check a saved topology (taking its num_partitions when unset); True when unchanged."""

    def read_sidecar(self, path: str | os.PathLike) -> tuple[dict[str, Any], str]:
        """(nested state, description) of this rank's partitions from a file or directory."""

    def write_sidecar(self, path: str | os.PathLike, state: dict, manifest: bool | None = None) -> str:
        """Write a nested state with the dataset's fingerprint and indexes."""

    def set_epoch(self, epoch: int) -> None: ...

    def refresh_files(self) -> int | dict[str, int] | None:
        """Take in the files that appeared (``data.growth``; collective): the epoch they join at (a mixture:
        ``{source label: epoch}`` of the sources that grew), or None."""

    def close(self) -> None: ...


# the data: keys that decide which rows a partition reads, in which order: the same on every rank of a job
ORDER_KEYS = ("shuffle", "shuffle_seed", "buffer_size", "interleave_shards", "block_rows", "num_partitions", "elastic",
              "elastic_determinism")


def order_settings(config: Any, prefix: str = "data.") -> dict[str, Any]:
    """``config``'s :data:`ORDER_KEYS` as ``{"data.shuffle_seed": 42, ...}`` (what ranks must agree on)."""
    return {prefix + k: getattr(config, k) for k in ORDER_KEYS}


def gathered_part(part: dict[str, Any], partitions: dict[int, Any]) -> dict[str, Any]:
    """The stream's part of a state gathered from ranks' states (the job's, or a rank's partitions after a change of
    ranks): one rank's ``part`` holding ``partitions``, of no rank (each rank loads its own partitions from it) and
    with the rotation afresh (``turn`` is a rank's). The state layer is handed this function: it merges values and
    never writes the stream's fields itself."""
    topology = part["topology"]
    return {"format_version": part["format_version"], "kind": part["kind"], "fingerprint": part["fingerprint"],
            "topology": {"rank": None, "world_size": topology["world_size"], "num_workers": topology["num_workers"],
                         "num_partitions": topology["num_partitions"]},
            "turn": 0, "partitions": partitions}


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
    if not (isinstance(world_size, int) and 1 <= world_size <= MAX_WORLD_SIZE):   # what a state can describe
        raise ConfigError(f"world_size: got {world_size!r}; allowed: an integer from 1 to {MAX_WORLD_SIZE}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"rank: got {rank!r}; allowed: an integer in [0, {world_size})")
    if not (isinstance(num_workers, int) and num_workers >= 0):
        raise ConfigError(f"num_workers: got {num_workers!r}; allowed: an integer >= 0")
    return rank, world_size


def round_robin(iterators: dict[int, Iterator], order: list[int], turn: int = 0,
                on_turn: Callable[[int], None] | None = None, steps: int | None = None, skip: Any = None) -> Iterator:
    """Item by item from ``iterators`` in the rotation ``order``, starting at ``order[turn]`` and skipping
    those that ended; ``on_turn(turn)`` is told where the rotation stands after each step (to save it). With
    ``steps`` longer than ``order``, each step past its end yields ``skip`` (the loader's shorter lanes)."""
    steps = steps or len(order)
    while iterators:
        t, turn = turn % steps, (turn + 1) % steps
        if on_turn is not None:
            on_turn(turn)
        if t >= len(order):
            yield skip
            continue
        it = iterators.get(order[t])
        if it is None:
            continue
        try:
            yield next(it)
        except StopIteration:
            del iterators[order[t]]


class StreamBase(IterableDataset):
    """The :class:`Stream` implementation a single stream and a mixture share. Subclasses set ``kind`` ("stream" or
    "mixture") and implement the methods at the end of the class, ``partition_state``, ``fingerprint`` and friends."""

    kind = "stream"
    state_type: Any = None      # the class of a partition's state (to_dict / from_dict / validate)
    follows = False             # a single stream in follow mode overrides it; a mixture never follows
    follower = None             # follow mode's waits (stream/follow.py): a single stream's, in follow mode

    @property
    def follow_ended(self) -> bool:
        """Follow mode: the last iteration ended after data.follow_timeout_s (the trainer saves and stops)."""
        return self.follower is not None and self.follower.ended

    def __init__(self, config: Any, rank: int | None, world_size: int | None, num_workers: int):
        super().__init__()
        # shared with DataLoader worker processes: set when a plain DataLoader's workers read copies of this
        # stream, so that this object's (unmoved) state is refused instead of silently restarting
        self._read_by_workers = multiprocessing.RawValue("b", 0)
        rank, world_size = resolve_topology(rank, world_size, num_workers)
        self.config, self.rank, self.world_size, self.num_workers = config, rank, world_size, num_workers
        request_budget.set_consumers(world_size * max(1, num_workers))   # this process's share of the job's rate
        self.transform_fingerprint: dict | None = None   # set by the loader when a transform follows
        self._epoch_limit: int | None = None               # set_epoch: the one epoch to iterate
        self._fingerprint: tuple[str, dict] | None = None   # (transform fingerprint, state_fingerprint())

    def _start(self) -> None:
        """Build the partitions (after the subclass opened its sources) and load ``data.resume_state_path``."""
        self._set_partitions(self.config.num_partitions or self.world_size * max(1, self.num_workers))
        if self.config.resume_state_path:
            self.load_sidecar(self.config.resume_state_path)

    def _set_partitions(self, num_partitions: int, key: str = "data.num_partitions") -> None:
        """(Re)plan ``num_partitions`` virtual partitions over the ranks and workers, with fresh readers."""
        slots = max(1, self.num_workers)
        check_consumers(num_partitions, self.world_size, slots, key)
        self.num_partitions = num_partitions
        self.lanes = partition_lanes(num_partitions, self.world_size, slots, self.rank)
        self.partitions = sorted(p for lane in self.lanes for p in lane)
        self._turn = 0    # the partition the main process reads next (part of the saved state)
        self._build_readers()

    def state_fingerprint(self) -> dict[str, Any]:
        """``fingerprint()``, made once while the transform's stays the same: every state then carries the same object,
        which a checkpoint encodes once, however many files the dataset lists."""
        key = json.dumps(self.transform_fingerprint, sort_keys=True, default=repr)
        if self._fingerprint is None or self._fingerprint[0] != key:
            self._fingerprint = (key, self.fingerprint())
        return self._fingerprint[1]

    def topology(self) -> dict[str, int]:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers,
                "num_partitions": self.num_partitions}

    def source_label(self, where: Any) -> str | None:
        return None

    def refresh_files(self) -> int | dict[str, int] | None:
        """New files while the job runs (``ResumableStream``, ``MixtureStream``); none here."""
        return None

    def data_epoch(self) -> float | None:
        """Epochs this stream yielded (fractional; None when an epoch's size is unknown). Any thread: it reads the
        published progress, never the readers ("One owner per cursor")."""
        return mean_position([self.partition_position(p) for p in self.partitions])

    def set_endless(self) -> None:
        """Undo ``set_epoch``: iterate endlessly again, each partition rolling over into its next epoch."""
        self._epoch_limit = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict]:
        info = worker_info()
        if info is None:
            parts = self.partitions
        else:
            self._read_by_workers.value = 1
            request_budget.set_consumers(self.world_size * info.num_workers)     # a spawned worker's share too
            if info.num_workers != max(1, self.num_workers) or self.num_workers == 0:
                raise ConfigError(
                    f"num_workers: the stream was created for {self.num_workers} DataLoader workers but is read by "
                    f"{info.num_workers}; create it with num_workers={info.num_workers}")
            parts = self.lanes[info.id]
        if len(parts) == 1:
            return self._samples(parts[0])
        if info is not None:    # a worker's copy: its rotation is not saved
            return round_robin({p: self._samples(p) for p in parts}, parts)
        return round_robin({p: self._samples(p) for p in parts}, parts, self._turn, partial(setattr, self, "_turn"))

    # ------------------------------------------------------------------ state
    def state_dict(self, partitions: dict[int, Any] | None = None) -> dict[str, Any]:
        """This rank's position after the last sample yielded, in the stream's envelope (``format_version``, ``kind``,
        ``fingerprint``, ``topology``, ``turn``, ``partitions``). ``partitions``: per-partition states to save instead
        of the stream's own (the loader passes what training consumed)."""
        if partitions is None and self._read_by_workers.value and worker_info() is None:
            # inside a worker the copy's state is that worker's own, exact (torchdata's StatefulDataLoader)
            raise ConfigError(
                f"{type(self).__name__}.state_dict(): the stream was read by DataLoader worker processes, which "
                "read copies of it: this object does not know what they consumed (and they prefetch ahead). "
                "Read it through resumable_stream.loader.StreamLoader(stream, batch_size, num_workers=...) and "
                "take the state from the StreamLoader (state_dict / save_sidecar), or read it without workers")
        given = partitions or {}
        parts = {p: self.state_type.from_dict(given[p], f"partition {p}").to_dict() if p in given
                 else self.partition_state(p).to_dict() for p in self.partitions}
        return {"format_version": FORMAT_VERSION, "kind": self.kind, "fingerprint": self.state_fingerprint(),
                "topology": self.topology(), "turn": self._turn if partitions is None else 0, "partitions": parts}

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state",
                        verify_next_sample: bool = True) -> None:
        """Continue every partition of this rank from a :meth:`state_dict` (this rank's, a job's, or gathered after a
        change of ranks; elastic: each partition from its cursor, the interleaving afresh).
        ``verify_next_sample=False`` skips the content check of each partition's first sample (the warmup planner)."""
        if isinstance(state, dict) and "stream" in state and "partitions" not in state:
            state = state["stream"]      # a loader's (nested) state: the stream's part is this stream's
        if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
            got = state.get("format_version") if isinstance(state, dict) else type(state).__name__
            raise StreamMismatchError(f"{where}: format version {got!r:.40}, expected {FORMAT_VERSION}")
        state = self._in_own_form(state, where)
        self._read_by_workers.value = 0   # the position is the loaded one again
        self.check_saved_identity(state, where)
        same = self.adopt_topology(state["topology"], where)
        saved = {int(p): ps for p, ps in state["partitions"].items()}
        if same and state["topology"].get("rank") is not None and sorted(saved) != self.partitions:
            raise StreamMismatchError(f"{where}: holds partitions {sorted(saved)}, this rank owns {self.partitions}")
        if any(p not in saved for p in self.partitions):
            raise StreamMismatchError(f"{where}: holds partitions {sorted(saved)}, this rank reads {self.partitions} "
                                      "after the topology change; load a stream_state or checkpoint directory so "
                                      "they are gathered from every rank's file")
        for p in self.partitions:
            self._restore_partition(p, self.state_type.from_dict(saved[p], f"{where}: partition {p}"), where,
                                    verify_next_sample)
        self._turn = int(state.get("turn", 0)) if same and state["topology"].get("rank") is not None else 0
        if self._epoch_limit is not None:     # set_epoch before the load: apply it to the loaded state
            self.set_epoch(self._epoch_limit)

    def _in_own_form(self, state: dict[str, Any], where: str) -> dict[str, Any]:
        """A saved state put in this stream's form before it is loaded (a mixture's other weights or sources)."""
        return state

    def check_saved_identity(self, state: dict[str, Any], where: str) -> None:
        """The saved state is of this kind of stream and of the same data, order and transform."""
        kind = state.get("kind", "stream")
        if kind != self.kind:
            what = {"stream": "a single dataset's", "mixture": "a mixture's (data.sources)"}
            mine = (f"a mixture of {', '.join(self.config.labels)} (data.sources)" if self.kind == "mixture"
                    else "a single dataset")
            raise StreamMismatchError(
                f"{where}: the saved state is {what.get(kind, repr(kind))}; this stream is {mine}. Resume with the "
                "data section it was written for", [("data.sources", kind, self.kind)])
        saved_fp = state["fingerprint"]
        if self.transform_fingerprint is None and "transform" in saved_fp:
            # a bare stream (e.g. peek) reading a training checkpoint: it shows raw samples from the
            # cursor; the transform's state is the loader's to check
            saved_fp = {k: v for k, v in saved_fp.items() if k != "transform"}
        check_fingerprint(saved_fp, self.state_fingerprint(), where)

    def adopt_topology(self, saved: dict[str, Any], where: str) -> bool:
        """Check a saved topology against this stream's; take its num_partitions when data.num_partitions
        is null. True when ranks and workers are unchanged (the state continues exactly as saved)."""
        configured = self.config.num_partitions is not None
        same = check_topology(saved, self.topology(), where, elastic=self.config.elastic,
                              compare_partitions=configured)
        saved_n = int(saved["num_partitions"])
        if saved_n != self.num_partitions:
            self._set_partitions(saved_n, key=f"{where}: num_partitions (taken from the saved state because "
                                              "data.num_partitions is null)")
        return same

    # ------------------------------------------------------------------ sidecar files (resumable_stream.state.checkpoint)
    def read_sidecar(self, path: str | os.PathLike) -> tuple[dict[str, Any], str]:
        """(nested state, description) of this rank's partitions from a sidecar file, a stream_state or a checkpoint
        directory; after a change of ranks or workers gathered from the files that hold them."""
        saved = checkpoint.SavedState(path, self.rank)
        with saved.identities():     # the files a compact fingerprint stands for: the indexes saved there
            self.check_saved_identity(saved.stream, saved.where)
            same = self.adopt_topology(saved.stream["topology"], saved.where)
        if same and saved.stream["topology"]["rank"] is not None:
            return saved.first, saved.where
        return saved.gather(self.partitions, gathered_part)

    def load_sidecar(self, path: str | os.PathLike) -> None:
        """Restore from a sidecar file, a stream_state or a checkpoint directory (StreamMismatchError, SidecarError)."""
        state, where = self.read_sidecar(path)
        self.load_state_dict(state["stream"], where=where)

    def save_sidecar(self, path: str | os.PathLike, manifest: bool | None = None) -> str:
        """Write this rank's state to a ``.safetensors`` file or a directory (``rank-NNNNN.safetensors``, the manifest
        when ``manifest`` or one rank; a multi-rank job completes it with ``checkpoint.finish``). Returns the file."""
        return self.write_sidecar(path, {"stream": self.state_dict()}, manifest)

    def write_sidecar(self, path: str | os.PathLike, state: dict, manifest: bool | None = None) -> str:
        """Write a nested ``state`` (this stream's, or a loader's over it) where ``save_sidecar`` says, with the
        dataset's fingerprint and indexes: see :func:`resumable_stream.state.checkpoint.save`."""
        return checkpoint.save(path, state, self.rank, self.world_size, self.saved_indexes(), manifest)

    def growing_indexes(self) -> dict[str | None, dict]:
        """The indexes of this stream's growing sources (``data.growth``), by label (None: the dataset's): what a
        state a trainer keeps itself must carry, since no stream_state directory saves them (none here)."""
        return {}

    def adopt_saved_indexes(self, indexes: dict[str | None, bytes], state: dict[str, Any], where: str) -> None:
        """Read through the indexes a state carries (:meth:`growing_indexes`), before the state is loaded. Collective.
        Nothing to do here."""

    def saved_indexes(self) -> dict[str | None, dict]:
        """The dataset indexes a checkpoint saves beside the state (rank 0): the dataset's under None, a mixture
        source's under its label."""
        indexes = dict(getattr(self.source, "indexes", None) or {})
        if getattr(self.source, "index", None) is not None:
            indexes[None] = self.source.index
        return indexes

    # ------------------------------------------------------------------ what a subclass provides
    def _build_readers(self) -> None:
        raise NotImplementedError

    def _samples(self, partition: int) -> Iterator[dict]:
        raise NotImplementedError

    def _restore_partition(self, partition: int, state: dict[str, Any], where: str,
                           verify_next_sample: bool) -> None:
        raise NotImplementedError
