"""Batches for training, with the state of what the training loop *consumed*: every batch comes from ONE partition
and carries the snapshot of its cursor and transform carry *after* it; the main process keeps the last one handed
out per partition, so batches prefetched but not handed out are never counted. Batches go out in rounds, one from
each partition (docs/elastic.md, "Rounds"; docs/internals.md, "Consumed, not produced")."""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .errors import ConfigError, StreamMismatchError
from .io import budget as request_budget
from .observe import metrics
from .observe.mixture_counts import (
    NO_SOURCE,
    consumed_by_source,
    example_runs,
    mixture_labels,
    source_id_rows,
    tokens_by_source,
)
from .observe.progress import epoch_position, mean_position
from .plan import check_global_batch, check_partitions_per_rank
from .runtime import threads
from .runtime.torch_compat import IterableDataset, data_loader, worker_info
from .state.checks import same_topology
from .state.job_state import carried_indexes, decode_state_dict, encode_state_dict, gather_job_state
from .stream.base import Stream, gathered_part, round_robin
from .transforms.errors import TransformError
from .transforms.protocol import Processor, as_processor


def _identity(item):
    return item


# what a worker hands out in place of a batch its lane lacks in a round (the main process drops it)
_SKIP = {"skip": True}


def round_steps(lanes: list[list[int]]) -> int:
    """Lane steps in a round: the longest lane's partitions."""
    return max(len(lane) for lane in lanes)


def token_count(batch: Any) -> int:
    """Tokens in a collated batch: its attention mask's ones (padding is no token), else the size of its
    input_ids; 0 for batches of raw samples. Torch tensors and numpy arrays (no torch needed for those)."""
    if isinstance(batch, dict):
        mask, ids = batch.get("attention_mask"), batch.get("input_ids")
        if _is_array(mask):
            return int((mask != 0).sum())
        if _is_array(ids):
            return int(np.prod(ids.shape))
    return 0


def _is_array(value: Any) -> bool:
    """A tensor or an array of any framework (``shape`` and ``dtype``; lists of samples have neither)."""
    return hasattr(value, "shape") and hasattr(value, "dtype")


def shard_row_key(sample: dict, where: tuple[int, int]) -> str:
    """The default sample key: "shard:row" ("label/shard:row" in a mixture)."""
    return f"{where[0]}:{where[1]}"


def _add_source_ids(collated: Any, runs: list[list[tuple[int, int]]]) -> None:
    """``collated["source_ids"]``: the source (index in ``data.sources``) of every token, NO_SOURCE on padding,
    shaped and typed as its ``input_ids`` (for the per-source loss, ``data.log_source_loss``)."""
    ids = collated.get("input_ids") if isinstance(collated, dict) else None
    if not _is_array(ids) or len(ids.shape) != 2 or ids.shape[0] != len(runs):
        raise ConfigError("data.log_source_loss: the batches need input_ids of shape (examples, tokens) to carry "
                          "each token's source; this collate_fn makes none")
    table = np.full(tuple(ids.shape), NO_SOURCE, dtype=np.int64)
    for r, row in enumerate(source_id_rows(runs)):
        row = row[:ids.shape[1]]
        table[r, :len(row)] = row
    collated["source_ids"] = ids.new_tensor(table) if hasattr(ids, "new_tensor") else table


class _BatchProducer(IterableDataset):
    """Runs in each worker (or the main process): lane of partitions -> transform -> batches + snapshots."""

    def __init__(self, stream: Stream, batch_size: int, collate_fn: Callable,
                 processor_factory: Callable[[], Processor] | None, key_fn: Callable, carries: dict[int, dict], turn: int,
                 lane_turns: list[int], keep_keys: bool = True, source_ids: bool = False):
        super().__init__()
        self.stream, self.batch_size, self.collate_fn = stream, batch_size, collate_fn
        self.processor_factory, self.key_fn, self.keep_keys = processor_factory, key_fn, keep_keys
        self.carries, self.turn, self.lane_turns = carries, turn, lane_turns
        self.counters = metrics.source_counters()   # a spawned worker records into its rank's counters
        # a mixture: every batch says what each source put into it (observe.mixture_counts)
        self.labels = mixture_labels(stream)
        self.source_index = {label: i for i, label in enumerate(self.labels or ())}
        self.source_ids = source_ids and self.labels is not None
        self._source_consumed: dict[int, list[int]] = {}    # partition -> per source, at its last batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        lanes = self.stream.lanes
        info = worker_info()
        metrics.adopt(self.counters)
        request_budget.set_consumers(self.stream.world_size * len(lanes))   # a spawned worker's share of the rate
        if info is None:
            if len(lanes) != 1:
                raise ConfigError(f"num_workers: the stream was created for {len(lanes)} DataLoader workers but the "
                                  "loader runs in the main process; create both with the same num_workers")
            j = 0
        else:
            if info.num_workers != len(lanes):
                raise ConfigError(f"num_workers: the stream was created for {len(lanes)} workers, the DataLoader "
                                  f"has {info.num_workers}")
            j = (info.id + self.turn) % len(lanes)
        lane = lanes[j]
        steps = round_steps(lanes)
        turn = (self.lane_turns[j] if j < len(self.lane_turns) else 0) % steps
        if self.stream.follows:     # data.growth: follow (main process, one lane): rounds with waits between
            yield from self.stream.follower.rounds(lane, turn, self._batches)
            return
        if steps == 1:
            yield from self._batches(lane[0])
            return
        # one batch of each partition in turn from the saved lane step, a skip item for each step past the
        # lane's end, so that the DataLoader (taking from its workers in turn) hands out whole rounds
        yield from round_robin({p: self._batches(p) for p in lane}, lane, turn, steps=steps, skip=_SKIP)

    def _batches(self, partition: int) -> Iterator[dict[str, Any]]:
        proc = as_processor(self.processor_factory()) if self.processor_factory is not None else None
        if proc is not None and partition in self.carries:
            proc.load_state(self.carries[partition])
        if self.labels is not None:
            self._source_consumed[partition] = consumed_by_source(self.stream.partition_state(partition))
        take = None if proc is None else proc.take
        if proc is not None and proc.counts_key_tokens and self.labels is not None:
            # the tokens each sample put into an example, for the per-source token counts (with packing: its part)
            take = functools.partial(proc.take, with_key_tokens=True)
        examples: list[Any] = []
        keys: list[str] = []
        starved = 0
        epoch_of_last_example = self.stream.partition_epoch(partition)
        # a mixture with per-source transform settings: the processor is told each sample's source
        source_of = self.stream.source_label if proc is not None and proc.takes_source else None
        # a processor whose chunks end with the data's epoch (LLaMA-Factory's map restarts with every epoch)
        epoch_bound = proc is not None and proc.epoch_bound
        if epoch_bound:
            if proc.data_epoch is None:
                proc.data_epoch = self.stream.partition_epoch(partition)
            yield from self._epoch_tail(partition, proc)     # a resume between the batches of an epoch's end
        if proc is None:     # raw samples (their keys only when asked for)
            key_fn = self.key_fn if self.keep_keys else None
            for sample, where in self.stream.iter_partition(partition):
                examples.append(sample)
                if key_fn is not None:
                    keys.append(key_fn(sample, where))
                if len(examples) == self.batch_size:
                    yield self._item(partition, examples, keys, None)
                    examples, keys = [], []
            if examples:
                yield self._item(partition, examples, keys, None)
            return
        for sample, where in self.stream.iter_partition(partition):
            key = self.key_fn(sample, where)
            ended = epoch_bound and self.stream.partition_epoch(partition) != proc.data_epoch
            if ended:      # the sample is the first of the next epoch: the ended one's last chunk is processed
                proc.end_epoch(self.stream.partition_epoch(partition))
            if source_of is None:
                proc.feed(sample, key)
            else:
                proc.feed(sample, key, source=source_of(where))
            if ended:      # after the feed, so each batch's snapshot (cursor past the sample) holds the sample
                yield from self._epoch_tail(partition, proc)
            if proc.ready():
                starved = 0
            else:
                starved += 1
                if starved % 1024 == 0:
                    self._check_not_starved(partition, proc, epoch_of_last_example)
            # examples made but not yet batched stay inside the processor, so they are in its state
            while proc.ready() >= self.batch_size:
                yield self._processed_item(partition, [take() for _ in range(self.batch_size)], proc)
        # the partition's epoch ended (finite mode, set_epoch): what is left is one shorter batch; packed
        # tokens not yet in a block stay in the processor's state and carry over to the next epoch
        if proc.ready():
            yield self._processed_item(partition, [take() for _ in range(proc.ready())], proc)

    def _epoch_tail(self, partition: int, proc: Processor) -> Iterator[dict[str, Any]]:
        """The examples of an ended epoch still in the processor, batched apart from the next epoch's (the last
        batch shorter), as a DataLoader over one epoch batches them."""
        while proc.epoch_tail():
            batch = [proc.take() for _ in range(min(self.batch_size, proc.epoch_tail()))]
            yield self._item(partition, batch, [k for ex in batch for k in ex.pop("keys", [])], proc)

    def _check_not_starved(self, partition: int, proc: Processor, since_epoch: int) -> None:
        """A transform that skips everything (e.g. a wrong column name) would spin over endless epochs."""
        epoch = self.stream.partition_epoch(partition)
        if epoch >= since_epoch + 2:
            raise TransformError(
                f"partition {partition}: a whole epoch of samples produced no training example; the transform "
                f"skipped them all ({proc.stats()}); check data.text_column / data.messages_column / data.format "
                "and the skip policies", None)

    def _processed_item(self, partition: int, batch: list[dict], proc: Processor) -> dict[str, Any]:
        """The item of a batch of the transform's examples (their keys and key_tokens taken out of them)."""
        runs = [example_runs(ex, self.source_index) for ex in batch] if self.labels is not None else None
        for ex in batch:
            ex.pop("key_tokens", None)
        batch_keys = [k for ex in batch for k in ex.pop("keys", [])]
        return self._item(partition, batch, batch_keys, proc, runs)

    def _item(self, partition: int, batch: list, keys: list[str], proc: Processor | None,
              runs: list[list[tuple[int, int]]] | None = None) -> dict[str, Any]:
        snapshot = self.stream.partition_state(partition)
        collated = self.collate_fn(batch)
        item = {"batch": collated, "partition": partition, "snapshot": snapshot, "keys": keys,
                "samples": len(batch), "tokens": token_count(collated)}
        if proc is not None:     # the transform's carry after this batch (its state, beside the stream's)
            item["carry"] = proc.state()
        if self.labels is not None:
            now = consumed_by_source(snapshot)
            item["source_samples"] = [a - b for a, b in zip(now, self._source_consumed[partition])]
            self._source_consumed[partition] = now
            item["source_tokens"] = tokens_by_source(runs or [], len(self.labels))
            if self.source_ids and runs is not None:
                _add_source_ids(collated, runs)
        return item


def _check_lightning_prefetch(trainer_prefetch: int) -> None:
    """Lightning's fit loop saves while it holds ``_PrefetchDataFetcher`` batches taken ahead: a ``trainer_prefetch``
    that does not say so would resume past a batch never trained on. Found by the caller's frame."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "on_save_checkpoint" and code.co_filename.replace("\\", "/").endswith(
                ("lightning/pytorch/loops/fit_loop.py", "pytorch_lightning/loops/fit_loop.py")):
            fetcher = getattr(frame.f_locals.get("self"), "_data_fetcher", None)
            ahead = len(getattr(fetcher, "batches", ()))
            if ahead != trainer_prefetch:
                raise ConfigError(
                    f"trainer_prefetch: got {trainer_prefetch}; Lightning's fit loop holds {ahead} batch(es) taken "
                    "ahead of the one it trains on when it saves this state: create the StreamLoader with "
                    f"trainer_prefetch={ahead}, so that the checkpoint resumes at the batch after the one trained")
            return
        frame = frame.f_back


def check_step_shape(stream: Stream, accumulation: int, batch_size: int | None = None,
                     keys: dict[str, str] | None = None) -> None:
    """Under ``data.elastic_determinism``: an optimizer step of ``accumulation`` micro-batches per rank takes the same
    number from every partition, else a ConfigError naming ``keys`` (the caller's names of ELASTIC_KEYS)."""
    if getattr(getattr(stream, "config", None), "same_global_batches", False):
        check_global_batch(stream.num_partitions, stream.world_size, accumulation, batch_size, stream.num_workers,
                           keys)


def _refuse_inside_a_round(loader: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """``data.elastic_determinism`` on another topology: the saved rotations must stand at a round's start (a state
    saved inside an optimizer step continues the identical sequence on its own topology only)."""
    slots = max(1, int(saved["num_workers"]))
    per_rank = int(saved["num_partitions"]) // int(saved["world_size"])
    for r, turn in sorted((loader.get("turns") or {}).items()):
        steps = (loader.get("lane_turns") or {}).get(r) or []
        handed = int(turn) + slots * int(steps[turn]) if turn < len(steps) else int(turn)
        if turn or any(steps):
            raise StreamMismatchError(
                f"{where}: saved inside a round of micro-batches: rank {r} of the {saved['world_size']} that saved "
                f"it had handed out {handed} of the {per_rank} micro-batches of its round (one from each of its "
                "partitions), so its partitions stand at different steps. data.elastic_determinism continues the "
                "identical sequence on another number of ranks or DataLoader workers only from a state saved "
                "between optimizer steps (a step accumulates whole rounds: StreamLoader.micro_batches_per_step). "
                f"Resume it on {saved['world_size']} ranks x {saved['num_workers']} DataLoader workers, or from a "
                "checkpoint saved after an optimizer step; or set data.elastic_determinism: false (each partition "
                "then continues from its cursor, the rounds afresh)",
                [("loader.turns", handed, 0)])


class StreamLoader:
    """Iterable of training batches from a stream, resumable at every batch handed out (docs/python-api.md).

    ``processor_factory``: a fresh :class:`~resumable_stream.transforms.Processor` per partition (without one,
    batches are lists of raw samples). ``keep_keys``: keep the keys handed out for :meth:`pop_consumed_keys`.
    ``trainer_prefetch``: batches the training loop takes ahead of the one it trains on (Lightning: 1); a batch counts
    as consumed only once that many more were taken. ``per_rank_state``: :meth:`state_dict` returns this rank's
    state without the gathering collective (for trainers asking from a background thread, e.g. VeOmni)."""

    def __init__(self, stream: Stream, batch_size: int, collate_fn: Callable | None = None,
                 processor_factory: Callable[[], Processor] | None = None, num_workers: int | None = None,
                 key_fn: Callable = shard_row_key, prefetch_factor: int | None = None, pin_memory: bool = False,
                 timeout: float = 0, keep_keys: bool = False, source_ids: bool = False, trainer_prefetch: int = 0,
                 per_rank_state: bool = False):
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
        self._consumed: dict[int, Any] = {}        # partition -> the stream's snapshot after its last consumed batch
        self._carries: dict[int, dict] = {}        # partition -> the transform's carry then (or as loaded)
        self._turn = 0                              # lane the next batch comes from
        self._lane_turns: list[int] = []           # per lane: partition (index in the lane) of its next batch
        self.keep_keys = keep_keys
        self.source_ids = source_ids
        if not (isinstance(trainer_prefetch, int) and not isinstance(trainer_prefetch, bool) and trainer_prefetch >= 0):
            raise ConfigError(f"trainer_prefetch: got {trainer_prefetch!r}; allowed: an integer >= 0")
        self.trainer_prefetch = trainer_prefetch
        self.per_rank_state = per_rank_state
        self._pending_keys: list[list[str]] = []   # only with keep_keys: emptied by pop_consumed_keys
        self.batches_consumed = 0
        self.counters = metrics.LoaderCounters()   # what the training loop waited for and got
        self._iterated = False
        self._restart = False     # set_weights: the running pass starts again from the batches handed out
        self._owner = threads.OwnerThread()   # the thread iterating: only it may call set_weights
        self._place: dict[int, tuple[int, int]] = {}   # partition -> (lane, index in it), set by items()
        self._round_end: tuple[int, int] | None = None   # (lane, step) of a round's last batch, set by items()
        # data.elastic_determinism: every optimizer step takes one micro-batch of each partition (plan/)
        self.same_global_batches = bool(getattr(getattr(stream, "config", None), "same_global_batches", False))
        self._check_shape()
        self._first_reading = self.metrics_reading()

    def _check_shape(self) -> None:
        """``data.elastic_determinism``: every rank reads the same number of partitions (ConfigError)."""
        if self.same_global_batches:
            check_partitions_per_rank(self.stream.num_partitions, self.stream.world_size)

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this rank hands out per round, one from each of its partitions (under
        ``data.elastic_determinism`` an optimizer step accumulates a multiple of it)."""
        return len(self.stream.partitions)

    def check_accumulation(self, accumulation: int, keys: dict[str, str] | None = None) -> None:
        """:func:`check_step_shape` for this loader's stream and batch size."""
        check_step_shape(self.stream, accumulation, self.batch_size, keys)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        self._owner.claim()
        items = self.items()
        clock, counters = time.perf_counter, self.counters
        taken: deque[dict[str, Any]] = deque()    # batches the training loop took ahead of the one it trains on
        while True:
            if self._restart:      # new weights: what the readers (workers) prefetched is dropped
                self._restart = False
                while taken:       # ... not what the training loop holds: it trains on those
                    self.hand_out(taken.popleft())
                items = self.items()
            asked = clock()
            item = next(items, None)   # the time the training loop waits for its batch
            if item is None:
                while taken:
                    self.hand_out(taken.popleft())
                return
            counters.batch(clock() - asked, item["samples"], item["tokens"], item.get("source_samples"),
                           item.get("source_tokens"))
            taken.append(item)
            while len(taken) > self.trainer_prefetch:
                self.hand_out(taken.popleft())
            yield item["batch"]

    def items(self) -> Iterator[dict[str, Any]]:
        """A new pass's items (``batch``, ``partition``, ``snapshot``, ``keys``, ``samples``, ``tokens``), none counted
        as consumed until given to :meth:`hand_out` (a prefetching consumer, e.g. MindSpore's, calls it itself)."""
        if self._iterated:
            # a new pass continues after the last batch handed out: the readers (and workers' processors)
            # of the previous pass may have run ahead of it
            self.load_state_dict(self.rank_state(), where="the state after the last batch handed out")
        self._iterated = True
        lanes = self.stream.lanes
        if len(self._lane_turns) != len(lanes):
            self._lane_turns = [0] * len(lanes)
        if self.num_workers == 0:
            # read in this process, a partition's reader may move ahead of what was handed out (a consumer that
            # hands items out later): one nothing is handed out from yet stays where it is now. Workers read
            # copies (this stream never moves), and building its windows here before they fork would only
            # read data and start prefetch threads in the parent
            for p in self.stream.partitions:
                self._consumed.setdefault(p, self.stream.partition_state(p))
        producer = _BatchProducer(self.stream, self.batch_size, self.collate_fn, self.processor_factory,
                                  self.key_fn, dict(self._carries), self._turn, list(self._lane_turns),
                                  self.keep_keys, self.source_ids)
        kwargs: dict[str, Any] = {"batch_size": None, "collate_fn": _identity, "num_workers": self.num_workers,
                                  "pin_memory": self.pin_memory, "timeout": self.timeout}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        if self.num_workers > 0:
            kwargs["worker_init_fn"] = threads.worker_threads   # one thread each: the cores are the trainer's
        self._place = {p: (j, i) for j, lane in enumerate(lanes) for i, p in enumerate(lane)}
        steps = round_steps(lanes)
        # the last lane step of a round that is a batch (lane, step): after it the round starts afresh
        self._round_end = (max(j for j, lane in enumerate(lanes) if len(lane) == steps), steps - 1)
        # in the main process a DataLoader would only add its per-item cost (~17 us) to every batch
        if self.num_workers == 0 and not self.pin_memory:
            return iter(producer)
        items = iter(data_loader(producer, "StreamLoader(num_workers>0 or pin_memory)", **kwargs))
        if any(len(lane) != steps for lane in lanes):     # shorter lanes hand out skip items (round_robin)
            return (item for item in items if "skip" not in item)
        return items

    def hand_out(self, item: dict[str, Any]) -> None:
        """Count one item of :meth:`items` as consumed: the state is now the one after its batch."""
        p = item["partition"]
        j, i = self._place[p]
        lanes = self.stream.lanes
        self._consumed[p] = item["snapshot"]
        if "carry" in item:
            self._carries[p] = item["carry"]
        self._turn = (j + 1) % len(lanes)
        self._lane_turns[j] = (i + 1) % round_steps(lanes)
        if (j, i) == self._round_end:     # the round's last batch (shorter lanes' skips follow): a new round
            self._turn, self._lane_turns = 0, [0] * len(lanes)
        if self.keep_keys:
            self._pending_keys.append(item["keys"])
        self.batches_consumed += 1

    def set_weights(self, weights: dict[str, Any], step: int | None = None) -> None:
        """A mixture's new weights from the next batch on, each partition's change after the last sample handed out
        (what was prefetched under the old weights is dropped). Collective; only from the iterating thread."""
        self._owner.check("StreamLoader.set_weights", "loader")
        if not hasattr(self.stream, "set_weights"):
            raise ConfigError(f"set_weights: the stream is a {type(self.stream).__name__}; weights are a mixture's "
                              "(data.sources)")
        # the stream records the change where training is and gives back the snapshots held here with it
        self._consumed = self.stream.set_weights(weights, consumed=self._consumed, step=step)
        self._restart = self._iterated

    def current_weights(self) -> dict[str, float]:
        """A mixture's target weights (by label) of the next draw after what training consumed, in the first partition."""
        p = self.stream.partitions[0]
        return self.stream.current_weights(p, self._consumed.get(p) or self.stream.partition_state(p))

    def set_epoch(self, epoch: int) -> None:
        """The Trainer calls this; the stream is endless (epochs roll over per partition), so it is a no-op."""

    def pop_consumed_keys(self) -> list[str]:
        """Keys (``key_fn``'s) of the samples handed out since the last call, in order (needs ``keep_keys``)."""
        if not self.keep_keys:
            raise ConfigError("pop_consumed_keys: this StreamLoader does not keep the keys of the samples it hands "
                              "out (they would pile up with every batch); create it with keep_keys=True, or set "
                              "loader.keep_keys = True before iterating")
        keys = [k for batch in self._pending_keys for k in batch]
        self._pending_keys = []
        return keys

    # ------------------------------------------------------------------ metrics
    def metrics_reading(self) -> dict[str, float]:
        """This rank's data-path counters now (its workers' included), the loader's (batches, seconds waited,
        samples, tokens) and the block cache's: what :meth:`data_metrics` compares."""
        return metrics.reading(self.counters, metrics.cache_stats(self.stream.source))

    def data_metrics(self, since: dict[str, float] | None = None) -> dict[str, Any]:
        """Figures of the data path since ``since`` (a :meth:`metrics_reading`; default: since this loader was made),
        with ``epoch``, the data's epoch from the consumed cursors (docs/training.md)."""
        now = self.metrics_reading()
        out = metrics.figures(metrics.delta(since or self._first_reading, now))
        out["epoch"] = self.data_epoch()
        return out

    def source_figures(self) -> dict[str, Any] | None:
        """Of a mixture: ``labels``, per source the ``samples`` and ``tokens`` handed out, and the ``target`` weights
        now; None for a single dataset. Any thread may call it: it moves no reader."""
        labels = mixture_labels(self.stream)
        if labels is None:
            return None
        counts = self.counters.per_source()
        zeros = (0,) * len(labels)
        # the target after what training consumed; before the first batch of the partition, where its reader
        # is (read from the position only: partition_state would build a reader's windows from this thread)
        p = self.stream.partitions[0]
        consumed = self._consumed.get(p)
        target = self.stream.current_weights(p, consumed) if consumed is not None else self.stream.current_weights(p)
        return {"labels": labels, "samples": counts["samples"] or zeros, "tokens": counts["tokens"] or zeros,
                "target": target}

    def data_epoch(self) -> float | None:
        """Epochs of data consumed (fractional; None when an epoch's size is unknown), from the snapshots handed out.
        Any thread may call it: it never touches the readers ("One owner per cursor")."""
        consumed = self._consumed          # replaced whole by load_state_dict: read it once
        return mean_position([epoch_position(consumed[p]) if p in consumed else self.stream.partition_position(p)
                              for p in self.stream.partitions])

    # ------------------------------------------------------------------ state
    def transform_states(self) -> dict[int, dict]:
        """Per partition of this rank, the transform's state (``meta``, ``tensors``) as of the last batch the
        training loop consumed (the loaded one before that; partitions without one are left out)."""
        return {p: self._carries[p] for p in self.stream.partitions if self._carries.get(p)}

    def rank_state(self) -> dict[str, Any]:
        """This rank's nested state after the last batch handed out: ``{"stream", "transform", "loader"}``, each
        layer's own part (what :meth:`save_sidecar` writes; :meth:`state_dict` gathers every rank's)."""
        parts = {p: self._consumed.get(p) or self.stream.partition_state(p) for p in self.stream.partitions}
        rank, lanes = self.stream.rank, self.stream.lanes
        lane_turns = list(self._lane_turns) if len(self._lane_turns) == len(lanes) else [0] * len(lanes)
        return {"stream": self.stream.state_dict(parts), "transform": self.transform_states(),
                "loader": {"turns": {rank: self._turn}, "lane_turns": {rank: lane_turns}}}

    def state_dict(self) -> dict[str, Any]:
        """The job's state as one plain value any trainer keeps: ``{"resumable_stream_state": bytes}`` (a
        self-verifying sidecar). Every rank's partitions are gathered here (a collective: every rank calls it), so
        any rank's copy restores the whole job; with ``per_rank_state``, this rank's alone."""
        _check_lightning_prefetch(self.trainer_prefetch)
        state = self.rank_state() if self.per_rank_state else gather_job_state(self.rank_state(), gathered_part)
        carried = carried_indexes(self.stream.growing_indexes())   # data.growth: no directory saves the index
        if carried:
            state["indexes"] = carried
        return encode_state_dict(state)

    def load_state_dict(self, state: dict[str, Any], where: str = "stream state") -> None:
        """Restore cursors, transform carries and, with the same ranks and workers, the batch rotation, from a
        :meth:`state_dict` or a nested state. Raises StreamMismatchError (other data / settings / topology, named) or
        SidecarError (damaged or forged)."""
        state = decode_state_dict(state, where)
        if state.get("indexes"):      # a growing dataset's state a trainer kept: its files, and those since
            self.stream.adopt_saved_indexes(state["indexes"], state["stream"], where)
        self.stream.load_state_dict(state["stream"], where)
        mine = set(self.stream.partitions)
        carries = {int(p): c for p, c in (state.get("transform") or {}).items() if int(p) in mine and c}
        if self.processor_factory is None and carries:
            raise StreamMismatchError(f"{where}: carries transform state (e.g. packed tokens) but this loader has "
                                      "no transform")
        self._carries = carries
        self._consumed = {}
        lanes = self.stream.lanes
        self._turn, self._lane_turns = 0, [0] * len(lanes)
        loader = state.get("loader") or {}
        rank = self.stream.rank
        if same_topology(state["stream"]["topology"], self.stream.topology()):
            self._turn = int(loader.get("turns", {}).get(rank, 0)) % len(lanes)
            saved = loader.get("lane_turns", {}).get(rank)
            if saved is not None and len(saved) == len(lanes):
                self._lane_turns = [int(t) % round_steps(lanes) for t in saved]
        elif self.same_global_batches:
            self._check_shape()     # num_partitions may have come from the state (data.num_partitions null)
            _refuse_inside_a_round(loader, state["stream"]["topology"], where)

    def save_sidecar(self, path: str, manifest: bool | None = None) -> str:
        """Write this rank's state to a ``.safetensors`` file or a directory (``ResumableStream.save_sidecar``)."""
        return self.stream.write_sidecar(path, self.rank_state(), manifest)

    def read_sidecar(self, path: str) -> tuple[dict[str, Any], str]:
        """(state, description) of this rank from a sidecar file, a stream_state dir or a checkpoint dir
        (``ResumableStream.read_sidecar``)."""
        return self.stream.read_sidecar(path)

    def load_sidecar(self, path: str) -> None:
        """Restore from a sidecar file, a stream_state dir or a checkpoint dir (gathered across rank files
        after an elastic change of ranks or workers; see ``ResumableStream.read_sidecar``)."""
        state, where = self.read_sidecar(path)
        self.load_state_dict(state, where=where)

    @property
    def rank(self) -> int:
        return self.stream.rank
