"""A resumable stream as the source of a ``mindspore.dataset.GeneratorDataset``. MindSpore prefetches from a thread
of its own, so each row carries an id and only rows :meth:`MindSporeSource.iterate` hands out count as consumed;
the state and sidecars are the loader's, so a checkpoint resumes under PyTorch too (docs/mindspore.md)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..config.stream_config import MixtureConfig, StreamConfig
from ..errors import ConfigError
from ..loader import StreamLoader, shard_row_key
from ..stream.base import Stream
from ..stream.mixture import open_stream

ID_COLUMN = "_rs_item"     # the column holding each row's item id (dropped from what iterate() hands out)
# how the data.elastic_determinism errors name this adapter's arguments
MINDSPORE_KEYS = {"accumulation": "MindSporeSource(gradient_accumulation_steps)",
                  "batch": "MindSporeSource(batch_size)", "workers": "num_workers"}


def mindspore_topology(rank: int | None = None, world_size: int | None = None) -> tuple[int | None, int | None]:
    """(rank, world_size): MindSpore's ``get_rank()`` / ``get_group_size()`` when its communication is
    initialised (``mindspore.communication.init()``), else the ones given (None: the stream's defaults,
    $RANK / $WORLD_SIZE). An explicit value that differs from the initialised one is a ``ConfigError``."""
    comm = _mindspore("mindspore.communication")
    if not comm.GlobalComm.INITED:
        return rank, world_size
    ms_rank, ms_world = int(comm.get_rank()), int(comm.get_group_size())
    for key, given, found in (("rank", rank, ms_rank), ("world_size", world_size, ms_world)):
        if given is not None and given != found:
            raise ConfigError(f"{key}: got {given!r}, but MindSpore's communication is initialised with {key} "
                              f"{found}; allowed: {found} or None")
    return ms_rank, ms_world


class MindSporeSource:
    """The iterable source of a ``GeneratorDataset``: batches of ``batch_size`` examples of a stream's rank (made as
    ``StreamLoader`` makes them), read in this process, as a dict of numpy arrays keyed ``columns``. With
    ``data.elastic_determinism``, ``gradient_accumulation_steps`` must be a multiple of :attr:`micro_batches_per_step`."""

    def __init__(self, stream: Stream, batch_size: int, columns: Sequence[str],
                 collate_fn: Callable[[list], dict[str, Any]], processor_factory: Callable | None = None,
                 key_fn: Callable = shard_row_key, keep_keys: bool = False, gradient_accumulation_steps: int = 1):
        if getattr(stream, "num_workers", 0) != 0:
            raise ConfigError(f"num_workers: got a stream created with num_workers={stream.num_workers}; allowed: "
                              "0 (MindSpore reads the source in this process; its own num_parallel_workers "
                              "map and batch the rows)")
        columns = list(columns) if not isinstance(columns, str) else None
        if not columns or not all(isinstance(c, str) and c for c in columns) or len(set(columns)) != len(columns) \
                or ID_COLUMN in columns:
            raise ConfigError(f"columns: got {columns!r}; allowed: a list of distinct non-empty column names "
                              f"(not {ID_COLUMN!r}, which holds the item ids)")
        if not callable(collate_fn):
            raise ConfigError(f"collate_fn: got {collate_fn!r}; allowed: a function from a list of examples to a "
                              "dict of numpy arrays keyed by the columns")
        self.columns = columns
        self.loader = StreamLoader(stream, batch_size, collate_fn=collate_fn, processor_factory=processor_factory,
                                   num_workers=0, key_fn=key_fn, keep_keys=keep_keys)
        self.loader.check_accumulation(gradient_accumulation_steps, MINDSPORE_KEYS)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.stream = stream
        self._lock = threading.Lock()     # held while producing a row; a new pass (or a load) stops the old one
        self._pass = 0
        self._next_id = 0
        self._produced: deque[tuple[int, dict]] = deque()   # (id, item without its batch), oldest first
        self._last_handed = -1
        self._error: Exception | None = None    # what stopped the producer (MindSpore hides its type)

    @classmethod
    def from_config(cls, config: StreamConfig | MixtureConfig, batch_size: int, columns: Sequence[str],
                    collate_fn: Callable[[list], dict[str, Any]], processor_factory: Callable | None = None,
                    rank: int | None = None, world_size: int | None = None, **kwargs: Any) -> MindSporeSource:
        """A source over ``open_stream(config)`` with the rank and world size of :func:`mindspore_topology`."""
        rank, world_size = mindspore_topology(rank, world_size)
        stream = open_stream(config, rank=rank, world_size=world_size, num_workers=0)
        return cls(stream, batch_size, columns, collate_fn, processor_factory, **kwargs)

    @property
    def micro_batches_per_step(self) -> int:
        """Rows (micro-batches) per round of this rank, one from each of its partitions
        (``StreamLoader.micro_batches_per_step``): an optimizer step under ``data.elastic_determinism``
        accumulates a multiple of it."""
        return self.loader.micro_batches_per_step

    @property
    def read_ahead(self) -> int:
        """Rows MindSpore's pipeline made of this pass and the loop has not been handed yet: what a save now
        leaves out. Any thread may read it (a length of a deque the producer appends to); the stream's readers
        are the producer thread's alone (docs/architecture.md, "One owner per cursor")."""
        return len(self._produced)

    @property
    def column_names(self) -> list[str]:
        """The dataset's columns: ``columns`` and the id column."""
        return [*self.columns, ID_COLUMN]

    # ------------------------------------------------------------------ the producer (MindSpore's thread)
    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        with self._lock:
            self._pass += 1
            mine = self._pass
            self._produced.clear()       # what the previous pass made ahead is never handed out
            items = self.loader.items()  # continues after the last row handed out
        while True:
            with self._lock:
                if self._pass != mine:   # a newer pass took over the stream
                    return
                try:
                    item = next(items, None)
                    if item is None:
                        return
                    row = self._row(item["batch"])
                except Exception as e:   # MindSpore re-raises it as a RuntimeError: iterate() raises this one
                    self._error = e
                    raise
                item_id = self._next_id
                self._next_id += 1
                self._produced.append((item_id, {k: v for k, v in item.items() if k != "batch"}))
            yield (*row, np.asarray(item_id, dtype=np.int64))

    def _row(self, batch: Any) -> list[np.ndarray]:
        if not isinstance(batch, dict) or set(batch) != set(self.columns):
            got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ConfigError(f"collate_fn: returned {got}; allowed: a dict with exactly the keys of columns "
                              f"{self.columns}")
        return [np.asarray(batch[c]) for c in self.columns]

    # ------------------------------------------------------------------ the consumer (the training loop)
    def dataset(self, **kwargs: Any) -> Any:
        """``mindspore.dataset.GeneratorDataset(self, column_names=self.column_names, ...)`` reading this
        source in one thread of this process (``num_parallel_workers=1``, no multiprocessing, no shuffle: the
        stream shuffles); further ``kwargs`` go to GeneratorDataset."""
        for key, allowed in (("num_parallel_workers", 1), ("python_multiprocessing", False), ("shuffle", False)):
            if kwargs.get(key, allowed) != allowed:
                raise ConfigError(f"{key}: got {kwargs[key]!r}; allowed: {allowed!r} (the stream is read in order "
                                  "by one thread of this process; use .map(..., num_parallel_workers=N) after it)")
        ds = _mindspore("mindspore.dataset")
        kwargs.update(num_parallel_workers=1, python_multiprocessing=False, shuffle=False)
        return ds.GeneratorDataset(self, column_names=self.column_names, **kwargs)

    def iterate(self, dataset: Any, output_numpy: bool = True) -> Iterator[dict[str, Any]]:
        """The rows of ``dataset`` (this source's GeneratorDataset, maybe mapped or batched further, order
        kept) as dicts of ``columns``, each counted as consumed when it is handed out. ``output_numpy=False``
        gives mindspore Tensors. One iteration at a time; a new one continues after the last row handed out."""
        self._error = None
        it = dataset.create_dict_iterator(num_epochs=1, output_numpy=output_numpy)
        try:
            for row in self._rows(it):
                ids = row.pop(ID_COLUMN, None)
                if ids is None:
                    raise ConfigError(f"dataset: its rows have no {ID_COLUMN!r} column; allowed: a dataset made by "
                                      "MindSporeSource.dataset() whose ops keep that column")
                self.consumed(np.asarray(ids.asnumpy() if hasattr(ids, "asnumpy") else ids).reshape(-1))
                yield row
        finally:
            it.stop()

    def _rows(self, it: Any) -> Iterator[dict[str, Any]]:
        """The iterator's rows; an error of this source (a ConfigError, a SourceError, ...) raised as itself,
        not as the RuntimeError MindSpore's pipeline turns it into."""
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                if self._error is not None:
                    raise self._error from e
                raise
            yield row

    def consumed(self, ids: Sequence[int] | np.ndarray) -> None:
        """Count the rows with these item ids (in order) as consumed: for loops that read the dataset's own
        iterator instead of :meth:`iterate`. Ids must come in the order they were produced."""
        for raw in ids:
            item_id = int(raw)
            if item_id <= self._last_handed:
                raise ConfigError(f"{ID_COLUMN}: got {item_id} after {self._last_handed}; allowed: ids in the order "
                                  "the source made them (no shuffle or reordering op after the source)")
            # only this thread pops and the producer only appends (deque operations are atomic): no lock, so
            # handing a row out never waits for the batch being produced
            while self._produced and self._produced[0][0] < item_id:   # dropped by the pipeline
                self._produced.popleft()
            if not self._produced or self._produced[0][0] != item_id:
                raise ConfigError(f"{ID_COLUMN}: got {item_id}; allowed: an id of a row this source produced in "
                                  "its current pass (a row of an earlier pass, or of another source?)")
            _, item = self._produced.popleft()
            self._last_handed = item_id
            self.loader.hand_out(item)

    # ------------------------------------------------------------------ state (the loader's)
    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None:
        with self._lock:
            self._pass += 1          # a pass still producing stops: the stream is moved
            self.loader.load_state_dict(state, where)

    def save_sidecar(self, path: str, manifest: bool | None = None) -> str:
        """``StreamLoader.save_sidecar``: this rank's file (plus the manifest with one rank; with several, rank 0
        calls ``resumable_stream.state.checkpoint.finish(path, world_size)`` after a barrier)."""
        return self.loader.save_sidecar(path, manifest)

    def load_sidecar(self, path: str) -> None:
        with self._lock:
            self._pass += 1
            self.loader.load_sidecar(path)

    def pop_consumed_keys(self) -> list[str]:
        """The keys of the samples in the rows handed out since the last call (needs ``keep_keys=True``)."""
        return self.loader.pop_consumed_keys()


def _mindspore(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise ConfigError(f"{module}: cannot be imported ({e}); resumable_stream.integrations.mindspore needs MindSpore: "
                          "pip install mindspore (docs/mindspore.md)") from e
