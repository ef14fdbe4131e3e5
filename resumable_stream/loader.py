"""Batches for training, with the state of what the training loop *consumed*.

Each DataLoader worker reads one partition, runs the transform (tokenize, pack) and collates
batches; with every batch it sends a snapshot of its partition's cursor and the transform's
carried-over state *after* that batch. The main process keeps, per partition, the snapshot of
the last batch it handed to the training loop. Batches prefetched by workers but not yet handed
out are therefore never counted: the saved state equals that of a run that stopped right there.

The DataLoader hands out batches worker by worker in a fixed rotation; the rotation position is
saved too, and on resume worker *i* reads partition ``(i + turn) % workers`` so the batch order
continues unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

from .checks import check_fingerprint
from .errors import ConfigError, StreamMismatchError
from .sidecar import rank_file_name, read_state_file, resolve_rank_file, write_state_file
from .stream import ResumableStream
from .transforms.errors import TransformError


def _identity(item):
    return item


def shard_row_key(sample: dict, where: tuple[int, int]) -> str:
    return f"{where[0]}:{where[1]}"


class _BatchProducer(torch.utils.data.IterableDataset):
    """Runs in each worker (or the main process): partition -> transform -> batches + snapshots."""

    def __init__(self, stream: ResumableStream, batch_size: int, collate_fn: Callable,
                 processor_factory: Callable | None, key_fn: Callable, carries: dict[int, dict], turn: int):
        super().__init__()
        self.stream, self.batch_size, self.collate_fn = stream, batch_size, collate_fn
        self.processor_factory, self.key_fn = processor_factory, key_fn
        self.carries, self.turn = carries, turn

    def __iter__(self) -> Iterator[dict[str, Any]]:
        parts = self.stream.partitions
        info = torch.utils.data.get_worker_info()
        if info is None:
            if len(parts) != 1:
                raise ConfigError(f"num_workers: the stream has {len(parts)} partitions per rank but the loader "
                                  "runs in the main process; create both with the same num_workers")
            partition = parts[0]
        else:
            if info.num_workers != len(parts):
                raise ConfigError(f"num_workers: the stream was created for {len(parts)} workers, the DataLoader "
                                  f"has {info.num_workers}")
            partition = parts[(info.id + self.turn) % len(parts)]
        proc = self.processor_factory() if self.processor_factory is not None else None
        if proc is not None and partition in self.carries:
            proc.load_state(self.carries[partition])
        examples: list[Any] = []
        keys: list[str] = []
        starved = 0
        epoch_of_last_example = self.stream._readers[partition].cursor.epoch
        for sample, where in self.stream.iter_partition(partition):
            key = self.key_fn(sample, where)
            if proc is None:
                examples.append(sample)
                keys.append(key)
                if len(examples) == self.batch_size:
                    yield self._item(partition, examples, keys, None)
                    examples, keys = [], []
                continue
            proc.feed(sample, key)
            if proc.ready():
                starved = 0
            else:
                starved += 1
                if starved % 1024 == 0:
                    self._check_not_starved(partition, proc, epoch_of_last_example)
            # examples made but not yet batched stay inside the processor, so they are in its state
            while proc.ready() >= self.batch_size:
                batch = [proc.take() for _ in range(self.batch_size)]
                batch_keys = [k for ex in batch for k in ex.pop("keys", [])]
                yield self._item(partition, batch, batch_keys, proc)

    def _check_not_starved(self, partition: int, proc, since_epoch: int) -> None:
        """A transform that skips everything (e.g. a wrong column name) would spin over endless epochs."""
        epoch = self.stream._readers[partition].cursor.epoch
        if epoch >= since_epoch + 2:
            raise TransformError(
                f"partition {partition}: a whole epoch of samples produced no training example; the transform "
                f"skipped them all ({proc.stats()}); check data.text_column / data.messages_column / data.format "
                "and the skip policies", None)

    def _item(self, partition: int, batch: list, keys: list[str], proc) -> dict[str, Any]:
        snapshot = self.stream.partition_state(partition)
        if proc is not None:
            snapshot["extra"] = proc.state()
        return {"batch": self.collate_fn(batch), "partition": partition, "snapshot": snapshot, "keys": keys}


class StreamLoader:
    """Iterable of training batches from a ResumableStream, resumable at every batch handed out.

    ``processor_factory`` builds a fresh stateful transform per worker (``feed`` / ``ready`` /
    ``take`` / ``state`` / ``load_state`` / ``fingerprint``); without one, batches are lists of raw
    samples passed to ``collate_fn``.
    """

    def __init__(self, stream: ResumableStream, batch_size: int, collate_fn: Callable | None = None,
                 processor_factory: Callable | None = None, num_workers: int | None = None,
                 key_fn: Callable = shard_row_key, prefetch_factor: int | None = None, pin_memory: bool = False,
                 timeout: float = 0):
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ConfigError(f"batch_size: got {batch_size!r}; allowed: an integer >= 1")
        num_workers = stream.num_workers if num_workers is None else num_workers
        if num_workers != stream.num_workers:
            raise ConfigError(f"num_workers: got {num_workers} for a stream created with num_workers="
                              f"{stream.num_workers}; they must match")
        self.stream, self.batch_size = stream, batch_size
        self.collate_fn = collate_fn or _identity
        self.processor_factory, self.key_fn = processor_factory, key_fn
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory, self.timeout = pin_memory, timeout
        if processor_factory is not None:
            stream.transform_fingerprint = processor_factory().fingerprint()
        self._consumed: dict[int, dict] = {}       # partition -> snapshot after its last consumed batch
        self._carries: dict[int, dict] = {}        # loaded transform state, per partition
        self._turn = 0
        self._pending_keys: list[list[str]] = []
        self.batches_consumed = 0

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        producer = _BatchProducer(self.stream, self.batch_size, self.collate_fn, self.processor_factory,
                                  self.key_fn, dict(self._carries), self._turn)
        kwargs: dict[str, Any] = {"batch_size": None, "collate_fn": _identity, "num_workers": self.num_workers,
                                  "pin_memory": self.pin_memory, "timeout": self.timeout}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        parts = self.stream.partitions
        for item in torch.utils.data.DataLoader(producer, **kwargs):
            p = item["partition"]
            self._consumed[p] = item["snapshot"]
            self._turn = (parts.index(p) + 1) % len(parts)
            self._pending_keys.append(item["keys"])
            self.batches_consumed += 1
            yield item["batch"]

    def set_epoch(self, epoch: int) -> None:
        """The Trainer calls this; the stream is endless (epochs roll over per partition), so it is a no-op."""

    def pop_consumed_keys(self) -> list[str]:
        """Keys of the samples in the batches handed out since the last call."""
        keys = [k for batch in self._pending_keys for k in batch]
        self._pending_keys = []
        return keys

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        parts = {}
        for p in self.stream.partitions:
            snap = self._consumed.get(p)
            if snap is None:       # nothing consumed from it since start / resume: its starting state
                snap = self.stream.partition_state(p)
                if p in self._carries:
                    snap["extra"] = self._carries[p]
            parts[p] = snap
        state = self.stream.state_dict(parts)
        state["turn"] = self._turn
        return state

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None:
        self.stream.load_state_dict(state, where)
        if self.processor_factory is None and any(ps.get("extra") for ps in state["partitions"].values()):
            raise StreamMismatchError(f"{where}: carries transform state (e.g. packed tokens) but this loader has "
                                      "no transform")
        self._carries = {int(p): ps["extra"] for p, ps in state["partitions"].items() if ps.get("extra")}
        self._consumed = {}
        self._turn = int(state.get("turn", 0)) % max(1, len(self.stream.partitions))

    def save_sidecar(self, state_dir: str) -> str:
        """Write this rank's ``rank-NNNNN.safetensors`` into ``state_dir`` (the manifest is the caller's)."""
        return write_state_file(os.path.join(state_dir, rank_file_name(self.stream.rank)), self.state_dict())

    def load_sidecar(self, path: str) -> None:
        file = resolve_rank_file(os.fspath(path), self.stream.rank)
        state = read_state_file(file)
        check_fingerprint(state["fingerprint"], self.stream.fingerprint(), f"sidecar {file!r}")
        self.load_state_dict(state, where=f"sidecar {file!r}")
