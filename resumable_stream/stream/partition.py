"""One ordered partition: reads its shards block-interleaved, cuts windows, shuffles each window.

The cursor is the state at the start of the current window plus an offset into it. Resuming
re-reads that one window (each open shard from its saved row), recomputes the same
permutation and skips ``offset`` rows: the cost is one window, however far the run went.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import json
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SourceError
from ..plan import Layout, window_permutation
from ..runtime.arrow_pool import rows_pool
from ..state.partition_state import DIGEST_BYTES, Cursor, PartitionState

MAX_EMPTY_EPOCHS = 16
PREFETCH_HINT = 256        # shards of its plan a partition hints at most when it builds a window
FIRST_ROWS = 1024          # rows a window makes before its first sample; the rest when the consumer gets there


@dataclass(frozen=True)
class Progress:
    """How far a partition's reader stands, as its consuming thread last published it (one attribute store,
    ``PartitionReader.progress``): what any other thread reads instead of the reader (metrics, Prometheus,
    ``data_epoch``). ``live`` is the iterator handing out the window's rows (``rows``): the rows handed out are
    read off its length hint, a read that moves nothing."""

    start: Cursor                  # the current window's start (offset 0)
    offset: int = 0                # rows of the window consumed, while no iterator hands them out
    rows: list | None = None
    live: Iterator | None = None
    epoch_rows: int | None = None  # rows of the start's epoch in this partition (None: unknown)

    @property
    def consumed(self) -> int:
        """Samples consumed, all epochs."""
        done = self.offset if self.live is None else len(self.rows) - self.live.__length_hint__()
        return self.start.consumed_before + done


def _chain(prev: bytes, keys: np.ndarray) -> bytes:
    """The digest chain after the samples ``keys`` ((shard, row) pairs, in order) followed ``prev``.

    The pairs are hashed interleaved, so a prefix of a window extends a running hash: the consumed
    digest of a snapshot costs the rows consumed since the last one, not the window's prefix."""
    h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
    h.update(keys)
    return h.digest()


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$bytes": hashlib.blake2b(bytes(v), digest_size=16).hexdigest()}
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return repr(v)


def sample_digest(sample: dict) -> str:
    """A content digest of one sample, stable across processes and Python versions."""
    text = json.dumps(sample, sort_keys=True, default=_jsonable, ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass
class Window:
    names: list[str]
    rows: list[dict]             # the permuted rows made so far, in the order handed out (None: consumed before
                                 # the resume this window was rebuilt for, never handed out); the rest are made
                                 # by ``_rest`` when a sample past them is first asked for (``made_past``)
    keys: np.ndarray             # (global shard, raw row) of each permuted row: C-contiguous little-endian int64
    next_start: Cursor           # the cursor at the start of the following window
    _rest: Callable[[], list[dict]] | None = field(default=None, repr=False)
    _key_tuples: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def key_tuples(self) -> list[tuple[int, int]]:
        """(shard, row) of every row, as Python ints (made once per window, not per sample)."""
        if self._key_tuples is None:
            self._key_tuples = list(zip(self.keys[:, 0].tolist(), self.keys[:, 1].tolist()))
        return self._key_tuples

    def made_past(self, i: int) -> list[dict]:
        """``rows``, made at least up to row ``i`` (the rest of the window at once). A new list: an iterator
        over the old one (a reader's offset is read off it) still ends where it did."""
        if i >= len(self.rows) and self._rest is not None:
            rest, self._rest = self._rest, None
            self.rows = self.rows + rest()
        return self.rows

    def sample(self, i: int) -> dict:
        return self.made_past(i)[i]


def _indices(positions: np.ndarray) -> pa.Array:
    """``positions`` as an Arrow int64 array, made from its buffer: ``pa.array(numpy)`` would import pandas
    (~0.3 s) the first time it runs."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(positions), [None, pa.py_buffer(positions)])


_ROW_MAKERS: dict[tuple[str, ...], Callable[[list[list], int], list[dict]]] = {}
_MAX_LITERAL_COLUMNS = 256


def _row_maker(names: tuple[str, ...]) -> Callable[[list[list], int], list[dict]]:
    """A function turning column lists into one dict per row, made once per column names: a dict display
    with the names as constants (``{'id': v0, 'text': v1} for v0, v1 in zip(*columns)``) builds the rows
    ~1.6x faster than ``dict(zip(names, row))`` per row. The same dicts (a name given twice keeps its last
    value, as ``dict(zip(...))`` does)."""
    make = _ROW_MAKERS.get(names)
    if make is None:
        if not names:
            def make(columns: list[list], n: int) -> list[dict]:
                return [{} for _ in range(n)]
        elif len(names) > _MAX_LITERAL_COLUMNS or not all(type(n) is str for n in names):
            def make(columns: list[list], n: int, names: tuple = names) -> list[dict]:
                return [dict(zip(names, r)) for r in zip(*columns)]
        else:
            # only string literals (the repr of a str) and generated variable names go into the source
            values = [f"v{i}" for i in range(len(names))]
            display = ", ".join(f"{name!r}: {v}" for name, v in zip(names, values))
            source = f"lambda columns, n: [{{{display}}} for {', '.join(values)}, in zip(*columns)]"
            make = eval(source, {"__builtins__": {}, "zip": zip})
        _ROW_MAKERS[names] = make
    return make


def _window_rows(table: pa.Table, perm: np.ndarray | None, skip: int, have: int
                 ) -> tuple[list, Callable[[], list[dict]] | None]:
    """The rows of a window of ``have`` rows (``table`` in file order, ``perm`` its order; None: file order)
    of which ``skip`` were consumed before a resume: None for those (no Python objects made), then the next
    FIRST_ROWS made now, and a function making the rest (None: nothing left). The first sample waits for
    FIRST_ROWS rows, not the whole window (a resume or a start: the window's take and rows were 10-20 ms of it).
    The rows are made in the order they are handed out: made in file order and permuted as Python objects,
    they are touched in random memory order by the consumer, which costs more than the Arrow take saves."""
    make = _row_maker(tuple(table.column_names))

    def made(lo: int, hi: int) -> list[dict]:
        if perm is not None:
            part = pc.take(table, _indices(perm[lo:hi]), memory_pool=rows_pool())
        else:
            part = table.slice(lo, hi - lo)
        return make([part.column(i).to_pylist() for i in range(part.num_columns)], hi - lo)

    cut = min(have, skip + FIRST_ROWS)
    rows = [None] * skip + made(skip, cut)
    return rows, (None if cut == have else lambda: made(cut, have))


_LIVE_SHARDS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_shards() -> None:
    # Close readers while the interpreter is whole. Left to teardown, a shard stopped mid-way keeps a
    # pyarrow dataset scan (datasets' parquet reader) alive on arrow's native threads past the end of
    # Python, which aborts the process now and then ("terminate called without an active exception");
    # datasets' parquet generator also prints "Exception ignored" noise. The collection frees scans
    # that are only held by reference cycles.
    for shard in list(_LIVE_SHARDS):
        shard.close()
    gc.collect()


class _OpenShard:
    """One shard being read: buffers kept rows and their raw row numbers."""

    def __init__(self, source, shard: int, pos: int, next_row: int, step: int, phase: int, epoch: int):
        self.shard, self.pos, self.next_row, self.epoch = shard, pos, next_row, epoch
        self._step, self._phase = step, phase
        self._tables = source.read(shard, next_row)
        self._raw_start = next_row       # raw row of the first row of the next table
        self._buf: pa.Table | None = None
        self._buf_rows = np.empty(0, dtype=np.int64)
        _LIVE_SHARDS.add(self)

    @property
    def unread(self) -> bool:
        """Opened but nothing read yet (the source has not been asked for its rows: a prefetch still applies)."""
        return self._buf is None and self._raw_start == self.next_row

    def close(self) -> None:
        """Stop reading: close the source's generator chain now (not at garbage collection)."""
        tables, self._tables = self._tables, iter(())
        self._buf = None
        close = getattr(tables, "close", None)
        if close is not None:
            close()
        _LIVE_SHARDS.discard(self)

    def _fill(self) -> bool:
        for table in self._tables:
            n = table.num_rows
            raw = np.arange(self._raw_start, self._raw_start + n, dtype=np.int64)
            self._raw_start += n
            if self._step > 1:
                keep = np.nonzero(raw % self._step == self._phase)[0]
                if len(keep) == 0:
                    continue
                table, raw = table.take(_indices(keep)), raw[keep]
            if n:
                self._buf, self._buf_rows = table, raw
                return True
        return False

    def take(self, k: int) -> tuple[list[pa.Table], np.ndarray]:
        """Up to k kept rows; fewer only when the shard has ended."""
        tables, rows = [], []
        while k > 0:
            if self._buf is None or self._buf.num_rows == 0:
                if not self._fill():
                    break
            n = min(k, self._buf.num_rows)
            tables.append(self._buf.slice(0, n))
            rows.append(self._buf_rows[:n])
            self._buf = self._buf.slice(n)
            self._buf_rows = self._buf_rows[n:]
            k -= n
        got = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        if len(got):
            self.next_row = int(got[-1]) + 1
        return tables, got


class PartitionReader:
    """Yields the rows of one partition in its deterministic order, window by window."""

    def __init__(self, source, layout: Layout, partition: int, cursor: Cursor | None = None,
                 epoch_rows: Callable[[int], int | None] | None = None):
        """``epoch_rows(epoch)``: the partition's rows in an epoch, for the published progress (default: counted
        from the layout, O(shards) each window; the stream passes its count made once per epoch)."""
        self.source, self.layout, self.partition = source, layout, partition
        self._epoch_rows = epoch_rows       # picklable (a spawned DataLoader worker gets a copy): no lambda
        self._window: Window | None = None
        self._open: dict[int, _OpenShard] = {}   # shards left open by the last window, by position
        self._hashed: tuple[Window, int, Any] | None = None   # (window, rows hashed, running hash of them)
        self._last_state: PartitionState | None = None          # the last state made (see state())
        self.cursor = cursor or Cursor()

    # ------------------------------------------------------------------ state
    # ``_start`` is the cursor at the start of the current window; ``offset`` counts the rows of
    # that window already consumed. Kept apart so the per-row cost is one integer store.
    @property
    def cursor(self) -> Cursor:
        return replace(self._start, offset=self.offset)

    @cursor.setter
    def cursor(self, cursor: Cursor) -> None:
        self._start = replace(cursor, offset=0) if cursor.offset else cursor
        self.offset = cursor.offset

    # While the rows of the window are handed out by ``consume``'s iterator, the offset is read off that
    # iterator (rows handed out = length of the list it runs over - rows it has left): no store per row.
    @property
    def offset(self) -> int:
        it = self._live
        return self._offset if it is None else len(self._live_rows) - it.__length_hint__()

    @offset.setter
    def offset(self, value: int) -> None:
        self._live = None
        self._offset = value
        self.progress = Progress(self._start, value, epoch_rows=self._rows_in(self._start.epoch))

    def _rows_in(self, epoch: int) -> int | None:
        if self._epoch_rows is not None:
            return self._epoch_rows(epoch)
        return self.layout.partition_rows(epoch, self.partition)

    # ``progress`` is the one attribute other threads may read (docs/architecture.md, "One owner per cursor"):
    # replaced whole, never changed in place, by the thread that consumes (the setters above and ``consume``).

    def consume(self, win: Window) -> Iterator[dict]:
        """The rows of ``win`` (the current window) from the offset on; each one it yields counts as consumed
        from then on (a save resumes after it), as if the offset were moved past it."""
        start = self.offset
        rows = win.made_past(start)
        it = iter(rows)
        if start:
            next(islice(it, start, start), None)      # skip the rows already consumed
        self._offset = start
        self._live, self._live_rows = it, rows
        self.progress = Progress(self._start, start, rows, it, self._rows_in(self._start.epoch))
        return it

    def set_cursor(self, cursor: Cursor) -> None:
        self.close()
        self.cursor = cursor
        self._window = None

    def close(self) -> None:
        """Close the shards this partition has open (it reopens them where it stands when read again)."""
        for shard in self._open.values():
            shard.close()
        self._open = {}

    def consumed_digest(self) -> str:
        """The digest chain of every sample consumed: O(rows consumed since the last call), so the loader's
        snapshot after each batch does not grow with the window."""
        c, w, k = self._start, self._window, self.offset
        if k == 0 or w is None:
            return c.chain.hex()
        known = self._hashed
        if known is None or known[0] is not w or known[1] > k:
            known = (w, 0, hashlib.blake2b(c.chain, digest_size=DIGEST_BYTES))
        h = known[2]
        if known[1] < k:
            h.update(w.keys[known[1]:k])
        self._hashed = (w, k, h)
        return h.copy().hexdigest()

    @property
    def epoch(self) -> int:
        return self._start.epoch

    def state(self, next_sample_digest: Callable[[], str], epoch_rows: int | None) -> PartitionState:
        """Where this partition stands: O(1) (the window's start cursor is shared, not copied), and the same
        object again while the partition has not moved, so a state_dict over many partitions costs what the
        ones that moved cost. Treat it as read-only (``dataclasses.replace`` to change it)."""
        known = self._last_state
        if known is None or known.start is not self._start or known.offset != self.offset:
            known = self._last_state = PartitionState(self._start, self.offset, self.consumed_digest(),
                                                      next_sample_digest(), epoch_rows)
        return known

    def set_state(self, state: PartitionState) -> None:
        """Continue from ``state`` (validated by the caller)."""
        self.set_cursor(state.cursor)

    # ---------------------------------------------------------------- windows
    def window(self, rollover: bool = True) -> Window | None:
        """The current window, built if needed. At the end of the epoch: the next epoch's first
        window if ``rollover``, else None (and the cursor moves to the next epoch's start)."""
        if self._window is not None:
            if self.offset < len(self._window):
                return self._window
            epoch = self._start.epoch
            self.finish_window()           # fully consumed: move on
            if not rollover and self._start.epoch != epoch:
                return None
        empty_epochs = 0
        while True:
            win = self._build(self._start, self.offset)
            if win is not None:
                self._window = win
                return win
            s = self._start
            if s.window == 0 and s.next_shard == 0 and not s.slots:
                # this partition's shards of this epoch were all empty (e.g. an empty file): move on,
                # but a partition that never gets a row is an error, not an endless loop
                empty_epochs += 1
                if empty_epochs >= MAX_EMPTY_EPOCHS:
                    raise SourceError(
                        f"partition {self.partition} of {self.layout.num_partitions} got no rows in "
                        f"{empty_epochs} epochs in a row: the dataset has too few rows ({self.layout.num_shards} "
                        "shards) for this many ranks x workers, or its files are empty")
            self.cursor = s.next_epoch()
            if not rollover:
                return None

    def finish_window(self) -> None:
        self.cursor = self._window.next_start
        self._window = None

    def _build(self, start: Cursor, consumed: int = 0) -> Window | None:
        """The window that starts at ``start``, of which ``consumed`` rows were already handed out (a resume
        inside it): those rows are never handed out again, so no Python objects are made for them (their places
        in ``rows`` hold None; their keys are kept, for the digest chain)."""
        lay = self.layout
        shard_list = lay.shards_for(start.epoch, self.partition)
        step, phase = lay.stride(self.partition, start.epoch)
        # Shards left open by the previous window continue where they are; others are (re)opened.
        live = self._open

        def continues(pos: int, row: int) -> bool:
            return pos in live and live[pos].next_row == row and live[pos].epoch == start.epoch

        # the shards this window (re)opens or opened unread, then the next ones of the plan
        # (a shard reopened mid-way, on resume, is hinted with its row: a fetch ahead need not cover its prefix)
        reopened = [(shard_list[pos], row) for pos, row in start.slots if not continues(pos, row) or live[pos].unread]
        self.source.prefetch(self.partition, [shard for shard, _ in reopened]
                             + list(shard_list[start.next_shard:start.next_shard + PREFETCH_HINT]),
                             starts={shard: row for shard, row in reopened if row})
        slots = [
            live[pos] if continues(pos, row)
            else _OpenShard(self.source, shard_list[pos], pos, row, step, phase, start.epoch)
            for pos, row in start.slots
        ]
        next_shard, block_slot, block_taken = start.next_shard, start.block_slot, start.block_taken
        want_total, block = lay.buffer_size, lay.block
        tables: list[pa.Table] = []
        shard_ids: list[np.ndarray] = []
        row_ids: list[np.ndarray] = []
        have = 0
        while have < want_total:
            while len(slots) < lay.open_slots and next_shard < len(shard_list):
                slots.append(_OpenShard(self.source, shard_list[next_shard], next_shard, 0, step, phase,
                                        start.epoch))
                next_shard += 1
            if not slots:
                break
            block_slot %= len(slots)
            slot = slots[block_slot]
            want = min(block - block_taken, want_total - have)
            got_tables, got_rows = slot.take(want)
            got = len(got_rows)
            if got:
                tables.extend(got_tables)
                shard_ids.append(np.full(got, slot.shard, dtype=np.int64))
                row_ids.append(got_rows)
                have += got
            if got < want:                  # shard ended: drop it, the next one opens in its place
                slots.pop(block_slot)
                block_taken = 0
            elif block_taken + got >= block:
                block_slot, block_taken = block_slot + 1, 0
            else:
                block_taken += got
        if have == 0:
            return None
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        keys = np.empty((have, 2), dtype="<i8")
        keys[:, 0], keys[:, 1] = np.concatenate(shard_ids), np.concatenate(row_ids)
        skip = min(consumed, have)
        if lay.shuffle:
            perm = window_permutation(have, lay.seed, start.epoch, self.partition, start.window)
            keys = keys[perm]       # fancy indexing: a new C-contiguous array
        else:
            perm = None
        rows, rest = _window_rows(table, perm, skip, have)
        for shard in live.values():     # open shards this window did not continue: stop reading them now
            if all(shard is not s for s in slots):
                shard.close()
        self._open = {s.pos: s for s in slots}
        exhausted = not slots and next_shard >= len(shard_list)
        after = Cursor(
            epoch=start.epoch, window=start.window + 1, offset=0, next_shard=next_shard,
            block_slot=block_slot % len(slots) if slots else 0, block_taken=block_taken,
            consumed_before=start.consumed_before + have,
            slots=tuple((s.pos, s.next_row) for s in slots), chain=_chain(start.chain, keys),
            epoch_start=start.epoch_start,
        )
        if exhausted:
            after = replace(after, offset=0).next_epoch()
        return Window(table.column_names, rows, keys, after, rest)


# ------------------------------------------------------------------ the state of one partition


