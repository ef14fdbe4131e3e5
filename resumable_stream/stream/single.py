"""``ResumableStream``: a torch IterableDataset over a HF dataset that saves and resumes exactly; each virtual
partition is a :class:`~resumable_stream.stream.partition.PartitionReader` over the dataset's shards."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import replace
from itertools import chain, islice
from typing import Any

from ..cache.cached_source import with_block_cache
from ..config.stream_config import StreamConfig, not_a_config
from ..dataset.growth import layout_generations, refresh, stable_fingerprint
from ..dataset.growth import resume as growth_after_resume
from ..dataset.job_source import open_job_source
from ..errors import ConfigError, StreamMismatchError
from ..observe.progress import position
from ..plan import Layout, shard_rows
from ..sources.base import Source
from ..sources.index import check_resolution, decode_index
from ..sources.open import open_source
from ..state.checkpoint import SavedIndexes
from ..state.partition_state import Cursor, PartitionState
from .base import StreamBase, order_settings
from .follow import Follower
from .partition import PartitionReader, sample_digest

log = logging.getLogger(__name__)
_warned: set[tuple] = set()


class ResumableStream(StreamBase):
    """The samples of one rank, as dicts with the dataset's own columns, in a resumable order: ``data.num_partitions``
    virtual partitions (default ranks x workers); ``num_workers`` is the DataLoader worker count it is read with."""

    kind = "stream"
    state_type = PartitionState

    def __init__(self, config: StreamConfig, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, source: Source | None = None, index_from: str | None = None):
        if not isinstance(config, StreamConfig):
            raise not_a_config(config, "a StreamConfig")
        super().__init__(config, rank, world_size, num_workers)
        # index_from: a checkpoint about to be resumed (by a loader or trainer), whose saved index may be reused
        # the stages below take the specs they need (config/specs.py), built once by the config
        self.spec, self.cache = config.source_spec, config.cache_spec
        resumed = index_from or config.resume_state_path
        opened = source if source is not None else open_job_source(self.spec, self.rank, self.world_size,
                                                                   SavedIndexes(resumed) if resumed else None,
                                                                   agree=order_settings(config))
        self.source = with_block_cache(opened, self.cache)
        self._retired: list[Source] = []      # sources replaced by refresh_files (shards still open on them)
        self.follower = Follower(self) if config.growth == "follow" else None   # data.growth: follow's waits
        self._start()

    def _build_readers(self) -> None:
        """The layout of ``num_partitions`` virtual partitions and this rank's readers (fresh cursors)."""
        num_partitions = self.num_partitions
        self.layout = Layout(
            num_shards=len(self.source.shards),
            row_counts=shard_rows(self.source.shards),
            num_partitions=num_partitions,
            seed=self.config.shuffle_seed, shuffle=self.config.shuffle, buffer_size=self.config.buffer_size,
            interleave=self.config.interleave_shards, block_rows=self.config.block_rows,
            generations=(layout_generations(self.source.index, self.source.shards)
                         if self.config.growth != "off" else None),
            follow=self.config.growth == "follow",
        )
        if self.config.growth == "follow" and self.num_workers:
            raise ConfigError(
                f"data.growth: got 'follow' with {self.num_workers} DataLoader worker(s); allowed: follow read in "
                "the main process of each rank (num_workers 0), or append with workers (see docs/growing-data.md)")
        consumers = self.world_size * max(1, self.num_workers)
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
        self._rows_of: dict[int, tuple[int, int | None]] = {}   # partition -> (epoch, its rows in that epoch)
        self._readers = {p: PartitionReader(self.source, self.layout, p,
                                            epoch_rows=functools.partial(self._epoch_rows, partition=p))
                         for p in self.partitions}
        self._expect: dict[int, str] = {}   # partition -> digest its next sample must have (after a load)

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> dict[str, Any]:
        c = self.config
        dataset = self.source.fingerprint
        if c.growth != "off":    # the first file set: what a run grows from (the later files: the index's)
            dataset = stable_fingerprint(dataset, self.source.index, c.growth)
        fp = {
            "dataset": dataset,
            "order": {"shuffle": c.shuffle, "seed": c.shuffle_seed, "buffer_size": c.buffer_size,
                      "interleave": c.interleave_shards, "block_rows": c.block_rows},
        }
        if self.transform_fingerprint is not None:
            fp["transform"] = self.transform_fingerprint
        return fp

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` only (continue it if a partition is inside it); without it the stream is endless."""
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

    def iter_partition(self, partition: int) -> Iterator[tuple[dict, tuple[int, int]]]:
        """(sample, (shard, row)) pairs of one partition: what the loader's workers read."""
        return self._samples(partition, with_keys=True)

    def _samples(self, partition: int, with_keys: bool = False) -> Iterator:
        """The samples of one partition from its cursor; ``with_keys``: (sample, (shard, row)) pairs. Each window's rows
        from C iterators (a list's, chained): no Python frame runs per sample."""
        return chain.from_iterable(self._windows(partition, with_keys))

    def _windows(self, partition: int, with_keys: bool) -> Iterator[Iterator]:
        """An iterator over the rest of each window's samples, window after window."""
        reader = self._readers[partition]
        limit = self._epoch_limit
        if limit is None and self.follower is not None:    # follow: the round being read (stream/follow.py)
            limit = self.round()
        finite = limit is not None
        while True:
            if finite and reader.cursor.epoch > limit:
                return
            win = reader.window(rollover=not finite)
            if win is None:
                return
            i = reader.offset
            expected = self._expect.pop(reader.partition, None)
            if expected is not None:
                self._verify_first(reader, win.sample(i), expected)
            # consumed once handed out: a save after a sample resumes after it (the reader counts them)
            if not with_keys:
                yield reader.consume(win)
            else:
                yield zip(reader.consume(win), islice(win.key_tuples(), i, None))

    # ------------------------------------------------------------------ data.growth: follow
    def __iter__(self) -> Iterator[dict]:
        if not self.follows:
            return super().__iter__()
        if self.world_size > 1:
            raise ConfigError(
                f"data.growth: got 'follow' iterating the stream of rank {self.rank} of {self.world_size} directly; "
                "allowed: with several ranks read it through a StreamLoader (or the patched Trainer), which keeps "
                "the ranks in step (see docs/growing-data.md)")
        return self.follower.samples(super().__iter__)

    @property
    def follows(self) -> bool:
        """``data.growth: follow`` on endless iteration: partitions read round by round, the waits between rounds
        by ``self.follower`` (stream/follow.py)."""
        return self.follower is not None and self._epoch_limit is None

    def round(self) -> int:
        """Follow mode's round: the least epoch of the rank's partitions (round e is epoch e, generation e's new files),
        so a resume is in the same round as the save."""
        return min(r.epoch for r in self._readers.values())

    def furthest_epoch(self) -> int:
        """The furthest epoch any of this rank's partitions has begun: new files join after it."""
        return max((r.epoch for r in self._readers.values()), default=0)

    def adopt_index(self, index: dict, source: Source | None = None) -> int:
        """Read through a grown ``index``: the epochs being read keep their plan, later ones get the new (``source``:
        already opened over it). Returns the first epoch of the newest generation."""
        self._retired.append(self.source)      # its open shards finish their windows (closed with the stream)
        self.source = source if source is not None else with_block_cache(open_source(self.spec, index=index),
                                                                          self.cache)
        gens = layout_generations(index, self.source.shards)
        self.layout = replace(self.layout, num_shards=len(self.source.shards),
                              row_counts=shard_rows(self.source.shards), generations=gens)
        for reader in self._readers.values():
            reader.source, reader.layout = self.source, self.layout
        self._rows_of = {}
        return gens[-1][0]

    def _verify_first(self, reader: PartitionReader, sample: dict, expected: str) -> None:
        got = sample_digest(sample)
        if got != expected:
            raise StreamMismatchError(
                f"partition {reader.partition} (rank {self.rank}): the first sample after resume is not the one "
                f"recorded at save time (digest saved {expected}, now {got}); the data content changed although "
                "the file list, sizes and versions did not",
                [("next_sample_digest", expected, got)],
            )

    def growing_indexes(self) -> dict[str | None, dict]:
        return {None: self.source.index} if self.config.growth != "off" and self.source.index is not None else {}

    def adopt_saved_indexes(self, indexes: dict[str | None, bytes], state: dict[str, Any], where: str) -> None:
        """A growing dataset's state kept by a trainer (no stream_state directory): its index, with the files that
        appeared since joining after the furthest epoch begun (as a resume from a checkpoint directory opens it)."""
        if self.config.growth == "off" or None not in indexes:
            return
        saved = decode_index(indexes[None], f"{where} (the dataset index it carries)")
        check_resolution(saved, self.spec.data, where)
        furthest = max((int(ps["epoch"]) for ps in state["partitions"].values()), default=0)
        self.adopt_index(growth_after_resume(self.spec, saved, furthest, self.rank, self.world_size, where))

    def refresh_files(self) -> int | None:
        """Take in the files that appeared (``data.growth: append``): they join from the epoch after the furthest any
        partition of the job has begun. Collective, no DataLoader workers (docs/growing-data.md). Returns that epoch,
        or None when unchanged."""
        if self.config.growth == "off":
            return None
        index = refresh(self.spec, self.source.index, self.furthest_epoch(), self.rank, self.world_size,
                        self.num_workers)
        if index is None:
            return None
        return self.adopt_index(index)

    # ------------------------------------------------------------------ state
    def partition_epoch(self, partition: int) -> int:
        """The epoch ``partition`` is in (its next sample's, once the previous epoch is fully consumed)."""
        return self._readers[partition].epoch

    def epoch_ended(self, partition: int) -> bool:
        """Whether ``partition`` has no sample left in its epoch (it then stands at the next epoch's start): a
        look-ahead of at most one window, which its next sample or state would read anyway."""
        return self._readers[partition].window(rollover=False) is None

    def epoch_begun(self, partition: int) -> bool:
        """Whether ``partition`` has consumed a sample of the epoch it stands in."""
        cursor = self._readers[partition].cursor
        return cursor.window > 0 or cursor.offset > 0

    def close(self) -> None:
        """Close every open shard now (no pyarrow scan outlives its use) and wait for the source's fetches ahead;
        iterating again reopens them where the cursors stand."""
        for reader in self._readers.values():
            reader.close()
        self.source.close()
        for old in self._retired:
            old.close()
        self._retired = []

    def partition_state(self, partition: int) -> PartitionState:
        """One partition's position after the last sample it yielded, with the digest of the next one (O(1):
        the loader takes one after every batch)."""
        reader = self._readers[partition]
        if self.config.growth == "follow":   # at the end of the known data: no next sample yet (digest "")
            win = reader.window(rollover=False)
            if win is None:
                return reader.state(lambda: "", self._epoch_rows(reader.epoch, partition))
        else:
            win = reader.window(rollover=True)   # the next sample is needed for its digest
        return reader.state(lambda: sample_digest(win.sample(reader.offset)), self._epoch_rows(reader.epoch, partition))

    def partition_position(self, partition: int) -> float | None:
        """Epochs ``partition`` has consumed (its epoch plus the fraction of it), from the progress its reader
        last published: callable from any thread, it moves and builds nothing (None: unknown)."""
        reader = self._readers.get(partition)
        if reader is None:       # the partitions are being re-planned (a resume under another topology)
            return None
        progress = reader.progress
        start = progress.start
        return position(start.epoch, progress.consumed, start.epoch_start, progress.epoch_rows)

    def _epoch_rows(self, epoch: int, partition: int) -> int | None:
        """``layout.partition_rows``, counted once per partition and epoch: it is O(shards), and every batch
        snapshot asks for it."""
        known = self._rows_of.get(partition)
        if known is None or known[0] != epoch:
            known = self._rows_of[partition] = (epoch, self.layout.partition_rows(epoch, partition))
        return known[1]

    def _restore_partition(self, p: int, ps: PartitionState, where: str, verify_next_sample: bool) -> None:
        """Continue partition ``p`` from its saved state (checked to point inside its data first)."""
        ps.validate(self.layout, p, where)
        self._readers[p].set_state(ps)
        if verify_next_sample and ps.next_sample_digest:    # "": saved at the end of the data (follow mode)
            self._expect[p] = ps.next_sample_digest
