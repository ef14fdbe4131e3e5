"""``ResumableStream``: a torch IterableDataset over a HF dataset that saves and resumes exactly."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .checks import check_fingerprint, check_topology
from .config import StreamConfig
from .errors import ConfigError, StreamMismatchError
from .partition import Cursor, PartitionReader, sample_digest
from .plan import Layout
from .sidecar import (
    FORMAT_VERSION,
    rank_file_name,
    read_state_file,
    resolve_rank_file,
    write_manifest,
    write_state_file,
)
from .source import Source, open_source

log = logging.getLogger(__name__)
_warned_strided: set[tuple] = set()


def _default_topology() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class ResumableStream(torch.utils.data.IterableDataset):
    """The samples of one rank, as dicts with the dataset's own columns, in a resumable order.

    ``num_workers`` is the DataLoader worker count the stream will be read with (0: the main
    process). Each (rank, worker) owns one partition; iterating in the main process with
    ``num_workers > 0`` interleaves this rank's partitions sample by sample.
    """

    def __init__(self, config: StreamConfig, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, source: Source | None = None):
        super().__init__()
        if not isinstance(config, StreamConfig):
            raise ConfigError(f"config: got {type(config).__name__}; allowed: a StreamConfig")
        d_rank, d_world = _default_topology()
        rank = d_rank if rank is None else rank
        world_size = d_world if world_size is None else world_size
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ConfigError(f"world_size: got {world_size!r}; allowed: an integer >= 1")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ConfigError(f"rank: got {rank!r}; allowed: an integer in [0, {world_size})")
        if not (isinstance(num_workers, int) and num_workers >= 0):
            raise ConfigError(f"num_workers: got {num_workers!r}; allowed: an integer >= 0")
        self.config, self.rank, self.world_size, self.num_workers = config, rank, world_size, num_workers
        self.source = source if source is not None else open_source(config)
        if config.cache_dir and not getattr(self.source, "is_cached", False):
            from .cache import CachedSource  # local block cache around the source (never changes results)

            self.source = CachedSource(self.source, config)
        slots = max(1, num_workers)
        self.layout = Layout(
            num_shards=len(self.source.shards),
            row_counts=tuple(s.num_rows for s in self.source.shards),
            num_partitions=world_size * slots,
            seed=config.shuffle_seed, shuffle=config.shuffle, buffer_size=config.buffer_size,
            interleave=config.interleave_shards, block_rows=config.block_rows,
        )
        if self.layout.strided and (key := (id(self.source), self.layout.num_partitions)) not in _warned_strided:
            _warned_strided.add(key)
            log.warning(
                "dataset has %d shards for %d partitions (ranks x workers): every partition reads every shard "
                "and keeps every %d-th row; give it more files or row groups to read less",
                self.layout.num_shards, self.layout.num_partitions, self.layout.num_partitions)
        self.partitions = [rank * slots + w for w in range(slots)]
        self._readers = {p: PartitionReader(self.source, self.layout, p) for p in self.partitions}
        self._turn = 0
        self._epoch_limit: int | None = None
        self._expect: dict[int, str] = {}   # partition -> digest its next sample must have (after a load)
        self.transform_fingerprint: dict | None = None   # set by the loader when a transform follows
        if config.resume_state_path:
            self.load_sidecar(config.resume_state_path)

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
                reader.set_cursor(Cursor(epoch=epoch, consumed_before=reader.cursor.consumed,
                                         chain=reader.cursor.chain))
                self._expect.pop(p, None)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            parts = self.partitions
        else:
            if info.num_workers != max(1, self.num_workers) or (self.num_workers == 0):
                raise ConfigError(
                    f"num_workers: the stream was created for {self.num_workers} DataLoader workers but is read by "
                    f"{info.num_workers}; create it with num_workers={info.num_workers}")
            parts = [self.partitions[info.id]]
        if len(parts) == 1:
            return self._iter_partition(self._readers[parts[0]])
        return self._iter_round_robin(parts)

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

    def _iter_round_robin(self, parts: list[int]) -> Iterator[dict]:
        live = {p: self._iter_partition(self._readers[p]) for p in parts}
        while live:
            p = parts[self._turn % len(parts)]
            self._turn = (self._turn + 1) % len(parts)
            it = live.get(p)
            if it is None:
                continue
            try:
                yield next(it)
            except StopIteration:
                del live[p]

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
    def partition_state(self, partition: int) -> dict[str, Any]:
        """One partition's position after the last sample it yielded, with the digest of the next one."""
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
        }

    def state_dict(self, partitions: dict[int, dict] | None = None) -> dict[str, Any]:
        """The position after the last sample this stream yielded (per partition).

        ``partitions`` replaces the per-partition states (the loader passes what training consumed).
        """
        parts = {p: (partitions or {}).get(p) or self.partition_state(p) for p in self.partitions}
        return {"format_version": FORMAT_VERSION, "fingerprint": self.fingerprint(), "topology": self.topology(),
                "turn": self._turn, "partitions": parts}

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None:
        if state.get("format_version") != FORMAT_VERSION:
            raise StreamMismatchError(f"{where}: format version {state.get('format_version')!r}, expected "
                                      f"{FORMAT_VERSION}")
        saved_fp = state["fingerprint"]
        if self.transform_fingerprint is None and "transform" in saved_fp:
            # a bare stream (e.g. peek) reading a training checkpoint: it shows raw samples from the
            # cursor; the transform's state is the loader's to check
            saved_fp = {k: v for k, v in saved_fp.items() if k != "transform"}
        check_fingerprint(saved_fp, self.fingerprint(), where)
        check_topology(state["topology"], self.topology(), where)
        saved_parts = {int(p): ps for p, ps in state["partitions"].items()}
        if sorted(saved_parts) != sorted(self.partitions):
            raise StreamMismatchError(f"{where}: holds partitions {sorted(saved_parts)}, this rank owns "
                                      f"{self.partitions}")
        for p, ps in saved_parts.items():
            cursor = Cursor(
                **{f: int(ps[f]) for f in Cursor.FIELDS},
                slots=tuple((int(a), int(b)) for a, b in ps["slots"]),
                chain=bytes.fromhex(ps["chain"]),
            )
            self._readers[p].set_cursor(cursor)
            self._expect[p] = ps["next_sample_digest"]
        self._turn = int(state.get("turn", 0))

    def save_sidecar(self, path: str | os.PathLike) -> str:
        """Write this rank's state. ``path`` is a ``.safetensors`` file or a directory (then
        ``rank-NNNNN.safetensors`` inside it, plus the manifest when world_size is 1)."""
        path = os.fspath(path)
        state = self.state_dict()
        if path.endswith(".safetensors"):
            return write_state_file(path, state)
        file = write_state_file(os.path.join(path, rank_file_name(self.rank)), state)
        if self.world_size == 1:
            write_manifest(path, 1)
        return file

    def load_sidecar(self, path: str | os.PathLike) -> None:
        """Restore from a sidecar file, a stream_state directory or a checkpoint directory."""
        file = resolve_rank_file(os.fspath(path), self.rank)
        self.load_state_dict(read_state_file(file), where=f"sidecar {file!r}")

    def sample_key(self, partition: int) -> tuple[int, int]:
        """(shard, row) of the sample ``partition`` yielded last."""
        reader = self._readers[partition]
        return reader.sample_key(reader.offset - 1)

