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

from ..errors import BAD_SAMPLE_COLUMN, BAD_SAMPLE_OMIT_NULL, SourceError
from ..plan import Layout, window_permutation
from ..runtime.arrow_pool import rows_pool
from ..sources.table_rows import is_items, item_maker, table_rows
from ..state.partition_state import DIGEST_BYTES, Cursor, PartitionState

MAX_EMPTY_EPOCHS = 16
PREFETCH_HINT = 256        # shards of its plan a partition hints at most when it builds a window
FIRST_ROWS = 1024          # rows a window makes before its first sample; the rest when the consumer gets there
PART_ROWS = 2048           # rows a window makes at a time after its first part (the consumer dropping each part
                           # before the next is made keeps the rows in the CPU's cache: ~0.2 us a row less)
TAKE_ROWS = 16384          # rows a window takes from its tables in one Arrow call, sliced into parts (rows under
                           # LARGE_ROW_BYTES: at most 8 MiB)
LARGE_ROW_BYTES = 512      # rows of at least this many Arrow bytes are permuted as Python objects (_gathered)


@dataclass(frozen=True)
class Progress:
    """How far a partition's reader stands, as its consuming thread last published it (one attribute store): what
    other threads read instead of the reader. ``live``: the iterator handing out the window's rows up to ``end``
    (the rows handed out are read off its length hint, a read that moves nothing)."""

    start: Cursor                  # the current window's start (offset 0)
    offset: int = 0                # rows of the window consumed, while no iterator hands them out
    end: int = 0                   # the window's row after the last that ``live`` hands out
    live: Iterator | None = None
    epoch_rows: int | None = None  # rows of the start's epoch in this partition (None: unknown)

    @property
    def consumed(self) -> int:
        """Samples consumed, all epochs."""
        done = self.offset if self.live is None else self.end - self.live.__length_hint__()
        return self.start.consumed_before + done


def _chain(prev: bytes, keys: np.ndarray) -> bytes:
    """The digest chain after the samples ``keys`` ((shard, row) pairs, in order) followed ``prev``; hashed
    interleaved, so a snapshot's consumed digest extends a running hash (O(rows since the last one))."""
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
    rows: list[dict]             # the part being handed out: window rows lo .. lo + len(rows) - 1, in that order;
                                 # ``_rest`` makes the next when first asked for, and the part before is let go
    keys: np.ndarray             # (global shard, raw row) of each permuted row: C-contiguous little-endian int64
    next_start: Cursor           # the cursor at the start of the following window
    _rest: Callable[[], tuple[list[dict], Callable | None]] | None = field(default=None, repr=False)
    _key_tuples: list | None = field(default=None, repr=False)
    # rows that are items (a JSON-lines source's lines) made into a row as each is handed out (None: rows are rows)
    make: Callable[[Any], dict] | None = field(default=None, repr=False)
    lo: int = 0

    def __len__(self) -> int:
        return len(self.keys)

    def key_tuples(self) -> list[tuple[int, int]]:
        """(shard, row) of every row, as Python ints (made once per window, not per sample)."""
        if self._key_tuples is None:
            self._key_tuples = list(zip(self.keys[:, 0].tolist(), self.keys[:, 1].tolist()))
        return self._key_tuples

    def made_past(self, i: int) -> list[dict]:
        """``rows`` once it is the part holding row ``i`` (parts are made in order; ``i`` never goes back
        before ``lo``). A new list per part: an iterator over the one before (a reader's offset is read off
        it) still ends where it did."""
        if i < self.lo:
            raise IndexError(f"window row {i}: its part was handed out already (parts from row {self.lo} kept)")
        while i >= self.lo + len(self.rows) and self._rest is not None:
            self.lo += len(self.rows)
            self.rows = []       # let go of the part handed out first: the next one reuses its memory, still cached
            self.rows, self._rest = self._rest()
        return self.rows

    def sample(self, i: int) -> dict:
        row = self.made_past(i)[i - self.lo]
        return row if self.make is None else self.make(row)


def _indices(positions: np.ndarray) -> pa.Array:
    """``positions`` as an Arrow int64 array, made from its buffer: ``pa.array(numpy)`` would import pandas
    (~0.3 s) the first time it runs."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(positions), [None, pa.py_buffer(positions)])


_ROW_MAKERS: dict[tuple[str, ...], Callable[[list[list], int], list[dict]]] = {}
_MAX_LITERAL_COLUMNS = 256


def _row_maker(names: tuple[str, ...]) -> Callable[[list[list], int], list[dict]]:
    """A function turning column lists into one dict per row, made once per column names: a dict display with the
    names as constants builds rows ~1.6x faster than ``dict(zip(names, row))`` (the same dicts)."""
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


def _window_rows(takes: list[_Take], owner: np.ndarray, within: np.ndarray, perm: np.ndarray | None, skip: int,
                 have: int) -> tuple[list, Callable | None, Callable | None]:
    """The first part of the rows of a window of ``have`` rows (row ``i`` in file order is row ``within[i]`` of
    ``takes[owner[i]]``; ``perm``: the order handed out, None: file order), from row ``skip`` (consumed before a
    resume: never made), a function making the next part (None: nothing left), and the item maker (``_item_maker``)
    or None. The first part waits only for the shard of the first sample (up to FIRST_ROWS rows it or a read shard
    holds); then FIRST_ROWS, then PART_ROWS at a time. Rows are made in the order handed out: made in file order
    and permuted, the consumer would touch them in random memory order, which costs more than the take saves."""
    if skip >= have:
        return [], None, None
    for t in takes:
        if t.tables is not None:       # read as the window was cut (a shard of unknown length)
            t.read()

    def positions(lo: int, hi: int) -> np.ndarray:
        return perm[lo:hi] if perm is not None else np.arange(lo, hi, dtype=np.int64)

    joined: dict[tuple, _Joined] = {}

    def made(lo: int, hi: int) -> list[dict]:
        pos = positions(lo, hi)
        if make is not None:        # items: the rows of the takes before it + row in it (_item_maker)
            return (bases[owner[pos]] + within[pos]).tolist()
        ready = [t for t in takes if t.table is not None]
        key = tuple(t.index for t in ready)
        j = joined.get(key)
        if j is None:               # made once for the parts made from the same takes (the last ones kept)
            joined.clear()
            j = joined[key] = _Joined(ready, len(takes), perm)
        if j.rows is not None:
            return _gathered(j.rows, j.offset[owner[pos]] + within[pos])
        if j.block is None or not j.block_lo <= lo <= hi <= j.block_lo + j.block.num_rows:
            # every take read: the parts of the next TAKE_ROWS rows taken at once (one Arrow call, not one a part)
            end = hi if len(ready) < len(takes) else min(have, max(hi, lo + TAKE_ROWS))
            block = positions(lo, end)
            idx = j.offset[owner[block]] + within[block]
            if perm is None and len(idx) and idx[-1] - idx[0] == len(idx) - 1:     # file order: a contiguous slice
                j.block = j.table.slice(int(idx[0]), len(idx))
            else:
                j.block = pc.take(j.combined(), _indices(idx), memory_pool=rows_pool())
            j.block_lo = lo
        return _rows_of(j.block.slice(lo - j.block_lo, hi - lo), hi - lo)

    first = takes[int(owner[positions(skip, skip + 1)[0]])]
    first.read()
    make = _item_maker(takes, first.table.schema)
    bases = np.cumsum([0] + [t.count for t in takes[:-1]], dtype=np.int64)
    limit = min(have, skip + FIRST_ROWS)
    read = np.array([t.table is not None for t in takes])
    waits = np.nonzero(~read[owner[positions(skip, limit)]])[0]
    cut = skip + (int(waits[0]) if len(waits) else limit - skip)

    return made(skip, cut), (None if cut == have else _Part(takes, made, cut, limit, have)), make


def _item_maker(takes: list[_Take], schema: pa.Schema) -> Callable[[Any], dict] | None:
    """Where a window's takes hand on items made into rows one by one as they are handed out (a JSON-lines source's
    lines): the function making the row of item ``sum(take.count of the takes before it) + row`` (the take read if
    it was not yet); else None."""
    if not is_items(schema):
        return None
    return item_maker(schema, [t.count for t in takes], lambda k: takes[k].read())


class _Joined:
    """What the parts of a window made from the same read takes share: each take's first row in their
    concatenation (``offset``, by take index), and either the rows picked from (``rows``, made in file order:
    ``_per_take``) or the table taken from."""

    def __init__(self, ready: list[_Take], takes: int, perm: np.ndarray | None):
        self.offset = np.zeros(takes, dtype=np.int64)
        at = 0
        for t in ready:
            self.offset[t.index] = at
            at += t.table.num_rows
        self.rows: list[dict] | None = None
        self.table: pa.Table | None = None
        self.block: pa.Table | None = None      # the rows of the window from ``block_lo`` on, in the order handed out
        self.block_lo = 0
        self._combined: pa.Table | None = None
        if _per_take(ready, perm):
            self.rows = ready[0].made_rows() if len(ready) == 1 else [r for t in ready for r in t.made_rows()]
        else:
            self.table = ready[0].table if len(ready) == 1 else pa.concat_tables([t.table for t in ready])

    def combined(self) -> pa.Table:
        """``table`` with one chunk per column, made once for the window's parts: a take from several chunks
        concatenates them first, on every call."""
        if self._combined is None:
            chunked = any(c.num_chunks > 1 for c in self.table.columns)
            self._combined = self.table.combine_chunks(memory_pool=rows_pool()) if chunked else self.table
        return self._combined


def _gathered(rows: list[dict], idx: np.ndarray) -> list[dict]:
    """The rows at ``idx`` of the ready takes' rows (concatenated), each take's rows made once in file order and
    picked in the order handed out: for large rows (LARGE_ROW_BYTES) an Arrow take would copy every value's bytes
    once more (documents of kilobytes: the take cost as much as parsing them)."""
    return [rows[i] for i in idx.tolist()]


def _rows_of(part: pa.Table, n: int) -> list[dict]:
    made = table_rows(part)         # a source's table that is not its rows' columns (JSON lines: the lines)
    if made is not None:
        return made
    return _rows_from(part.column_names, part.schema, None, n, part)


def _per_take(ready: list[_Take], perm: np.ndarray | None) -> bool:
    """Whether a part of a window is made of each take's rows picked (``_gathered``) rather than of an Arrow take
    of their concatenation: large rows permuted, or tables of another kind among them (rows made from items: they
    do not concatenate with tables of the rows' columns)."""
    if perm is not None and all(t.large() for t in ready):
        return True
    return len({is_items(t.table.schema) for t in ready}) > 1


def _rows_from(names: list[str], schema: pa.Schema, columns: list[list] | None, n: int,
               part: pa.Table | None = None) -> list[dict]:
    """The ``n`` rows of ``part`` (or of ``columns``, its columns as lists) as dicts; a ``__bad_sample__`` column
    marked to omit its nulls adds its key only to the rows it marks (sources/jsonl.py: a good row is the row
    ``datasets`` gives)."""
    if columns is None:
        columns = [part.column(i).to_pylist() for i in range(part.num_columns)]
    if names and names[-1] == BAD_SAMPLE_COLUMN and schema.field(len(names) - 1).metadata == BAD_SAMPLE_OMIT_NULL:
        marks = columns[-1]
        rows = _row_maker(tuple(names[:-1]))(columns[:-1], n)
        for row, why in zip(rows, marks):
            if why is not None:
                row[BAD_SAMPLE_COLUMN] = why
        return rows
    return _row_maker(tuple(names))(columns, n)


class _Part:
    """The next part of a window's rows, from row ``lo`` (to ``limit``, or PART_ROWS rows past it), once
    every shard of the window is read. A class, not a closure naming itself: such a cycle would keep the
    window's row groups alive until a full garbage collection."""

    def __init__(self, takes: list[_Take], made: Callable[[int, int], list[dict]], lo: int, limit: int, have: int):
        self.takes, self.made, self.lo, self.limit, self.have = takes, made, lo, limit, have

    def __call__(self) -> tuple[list[dict], _Part | None]:
        for t in self.takes:
            t.read()
        hi = self.limit if self.lo < self.limit else min(self.have, self.lo + PART_ROWS)
        rows = self.made(self.lo, hi)
        return rows, (None if hi == self.have else _Part(self.takes, self.made, hi, self.limit, self.have))


@dataclass
class _Take:
    """The rows one open shard gives a window: planned (their raw row numbers, ``rows``) when the window is
    built, read when a sample among them is first made (``read``); a shard of unknown length is read at once
    (``tables``)."""

    index: int                   # its place in the window's takes
    slot: _OpenShard
    start: int                   # kept rows of the shard planned before this window's
    rows: list = field(default_factory=list)          # raw row numbers, piece by piece
    count: int = 0               # rows in them
    tables: list | None = None   # read already (a shard of unknown length)
    table: pa.Table | None = None
    _made: list | None = None    # the table's rows in file order (large rows: _gathered)
    _large: bool | None = None

    def made_rows(self) -> list[dict]:
        if self._made is None:
            self._made = _rows_of(self.table, self.table.num_rows)
        return self._made

    def large(self) -> bool:
        """Rows of LARGE_ROW_BYTES or more (asked once: a table's nbytes walks its buffers)."""
        if self._large is None:
            self._large = self.table.nbytes >= LARGE_ROW_BYTES * max(1, self.table.num_rows)
        return self._large

    def read(self) -> pa.Table:
        if self.table is None:
            if self.tables is not None:
                self.table = self.tables[0] if len(self.tables) == 1 else pa.concat_tables(self.tables)
            else:
                self.table = self.slot.read_planned(self.start, np.concatenate(self.rows))
            self.tables = None
            if self.slot.ended:
                self.slot.close()
        return self.table


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

    def __init__(self, source, shard: int, pos: int, next_row: int, step: int, phase: int, epoch: int,
                 num_rows: int | None = None):
        """``num_rows``: the shard's exact row count (the source vouches for it): its rows are then planned
        without reading (``plan``) and read when needed (``read_planned``)."""
        self.shard, self.pos, self.next_row, self.epoch = shard, pos, next_row, epoch
        self.num_rows = num_rows
        self.ended = False               # a take got fewer rows than it asked for
        self._step, self._phase = step, phase
        self._source = source
        self._closed = False
        self._tables = source.read(shard, next_row)
        self._opened_at = next_row
        self._raw_start = next_row       # raw row of the first row of the next table
        self._buf: pa.Table | None = None
        self._buf_rows = np.empty(0, dtype=np.int64)
        self._planned = 0                # kept rows taken or planned so far
        self._read = 0                   # kept rows read from the source so far
        _LIVE_SHARDS.add(self)

    @property
    def unread(self) -> bool:
        """Opened but nothing read yet (the source has not been asked for its rows: a prefetch still applies)."""
        return self._buf is None and self._raw_start == self._opened_at

    def close(self) -> None:
        """Stop reading: close the source's generator chain now (not at garbage collection)."""
        tables, self._tables = self._tables, iter(())
        self._buf = None
        self._closed = True
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

    @property
    def planned(self) -> int:
        """Kept rows taken or planned so far (where the next window's take of this shard starts)."""
        return self._planned

    def plan(self, k: int) -> np.ndarray:
        """The raw numbers of the next (up to) k kept rows, reading nothing (``num_rows`` is known); fewer only
        when the shard ends. They are read by ``read_planned``."""
        first = self.next_row + (self._phase - self.next_row) % self._step
        left = 0 if first >= self.num_rows else (self.num_rows - 1 - first) // self._step + 1
        rows = first + self._step * np.arange(min(k, left), dtype=np.int64)
        if len(rows):
            self.next_row = int(rows[-1]) + 1
        self._planned += len(rows)
        return rows

    def read_planned(self, start: int, rows: np.ndarray) -> pa.Table:
        """Read the kept rows planned from the ``start``-th on (``rows``: their raw numbers), skipping those
        planned before it and never read (a window resumed at its very end). A shard closed meanwhile (the
        stream was closed inside the window) is reopened at the first of them."""
        if self._closed and len(rows):
            self._tables = self._source.read(self.shard, int(rows[0]))
            self._raw_start, self._buf, self._read, self._closed = int(rows[0]), None, start, False
            _LIVE_SHARDS.add(self)
        if self._read < start:
            _, skipped = self._take_read(start - self._read)
            self._read += len(skipped)
        tables, got = self._take_read(len(rows))
        self._read += len(got)
        if not np.array_equal(got, rows):
            raise SourceError(f"shard {self.shard}: the source gave {len(got)} rows where its row count promised "
                              f"{len(rows)} from row {int(rows[0]) if len(rows) else self.next_row} (the data "
                              "changed while it was read)")
        if not tables:
            raise SourceError(f"shard {self.shard}: the source gave no rows where its row count promised {len(rows)}")
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def take(self, k: int) -> tuple[list[pa.Table], np.ndarray]:
        """Up to k kept rows, read now; fewer only when the shard has ended."""
        tables, got = self._take_read(k)
        self._read += len(got)
        self._planned += len(got)
        if len(got):
            self.next_row = int(got[-1]) + 1
        return tables, got

    def _take_read(self, k: int) -> tuple[list[pa.Table], np.ndarray]:
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
        return tables, (np.concatenate(rows) if rows else np.empty(0, dtype=np.int64))


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
        return self._offset if it is None else self._live_end - it.__length_hint__()

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
        """The rows of ``win`` (the current window) from the offset on to the end of the part holding it; each
        one it yields counts as consumed from then on (a save resumes after it), as if the offset were moved
        past it."""
        start = self.offset
        rows = win.made_past(start)
        it = iter(rows)
        if start > win.lo:
            next(islice(it, start - win.lo, start - win.lo), None)      # skip the rows already consumed
        self._offset = start
        self._live, self._live_end = it, win.lo + len(rows)
        self.progress = Progress(self._start, start, self._live_end, it, self._rows_in(self._start.epoch))
        return it if win.make is None else map(win.make, it)

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
        ahead = [shard for shard, _ in reopened] + list(shard_list[start.next_shard:start.next_shard + PREFETCH_HINT])
        starts = {shard: row for shard, row in reopened if row}
        # a source whose row counts are exact: the window is planned without reading anything, and the shard
        # holding its first sample is hinted (so decoded) first; otherwise shards are read as the window is cut
        planned = bool(getattr(self.source, "exact_rows", False))
        if not planned:
            self.source.prefetch(self.partition, ahead, starts=starts)

        def opened(pos: int, row: int) -> _OpenShard:     # a shard's count looked up as it opens: O(the window)
            return _OpenShard(self.source, shard_list[pos], pos, row, step, phase, start.epoch,
                              self.source.shards[shard_list[pos]].num_rows if planned else None)

        slots = [live[pos] if continues(pos, row) else opened(pos, row) for pos, row in start.slots]
        next_shard, block_slot, block_taken = start.next_shard, start.block_slot, start.block_taken
        want_total, block = lay.buffer_size, lay.block
        takes: dict[int, _Take] = {}               # by id of the open shard, in the order they first give rows
        pieces: list[tuple[_Take, int, int]] = []  # (take, first row of it, rows) in file order
        have = 0
        while have < want_total:
            while len(slots) < lay.open_slots and next_shard < len(shard_list):
                slots.append(opened(next_shard, 0))
                next_shard += 1
            if not slots:
                break
            block_slot %= len(slots)
            slot = slots[block_slot]
            want = min(block - block_taken, want_total - have)
            take = takes.get(id(slot))
            if take is None:
                take = _Take(len(takes), slot, slot.planned)
            if slot.num_rows is not None:
                got_rows = slot.plan(want)
            else:
                got_tables, got_rows = slot.take(want)
                take.tables = (take.tables or []) + got_tables
            got = len(got_rows)
            if got:
                if take.index == len(takes):
                    takes[id(slot)] = take
                pieces.append((take, take.count, got))
                take.rows.append(got_rows)
                take.count += got
                have += got
            if got < want:                  # shard ended: drop it, the next one opens in its place
                slot.ended = True
                slots.pop(block_slot)
                block_taken = 0
            elif block_taken + got >= block:
                block_slot, block_taken = block_slot + 1, 0
            else:
                block_taken += got
        if have == 0:
            if planned:
                self.source.prefetch(self.partition, ahead, starts=starts)
            return None
        order = list(takes.values())
        owner = np.empty(have, dtype=np.int64)
        within = np.empty(have, dtype=np.int64)
        shard_ids = np.empty(have, dtype=np.int64)
        at = 0
        for take, first, n in pieces:
            owner[at:at + n] = take.index
            within[at:at + n] = np.arange(first, first + n, dtype=np.int64)
            shard_ids[at:at + n] = take.slot.shard
            at += n
        raw_rows = _piece_rows(pieces)
        skip = min(consumed, have)
        if lay.shuffle:
            perm = window_permutation(have, lay.seed, start.epoch, self.partition, start.window)
            shard_ids, raw_rows = shard_ids[perm], raw_rows[perm]     # two gathers: cheaper than one of (n, 2) rows
        else:
            perm = None
        keys = np.empty((have, 2), dtype="<i8")
        keys[:, 0], keys[:, 1] = shard_ids, raw_rows
        if planned:     # the shard of the first sample first, unless its reading began in an earlier window
            slot = order[int(owner[perm[skip] if perm is not None else skip])].slot if skip < have else None
            first = [slot.shard] if slot is not None and slot.unread else []
            self.source.prefetch(self.partition, first + ahead, starts=starts)
        rows, rest, make = _window_rows(order, owner, within, perm, skip, have)
        for shard in live.values():     # open shards this window did not continue: stop reading them now
            if all(shard is not s for s in slots) and (id(shard) not in takes or takes[id(shard)].table is not None):
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
        names = next((t.table.column_names for t in order if t.table is not None), self.source.column_names or []) \
            if make is None else self.source.column_names or []
        return Window(list(names), rows, keys, after, rest, make=make, lo=min(skip, have))


def _piece_rows(pieces: list) -> np.ndarray:
    """The raw row numbers of a window's pieces, in file order."""
    out, seen = [], {}
    for take, first, n in pieces:
        rows = seen.get(take.index)
        if rows is None:
            rows = seen[take.index] = np.concatenate(take.rows)
        out.append(rows[first:first + n])
    return np.concatenate(out)


# ------------------------------------------------------------------ the state of one partition


