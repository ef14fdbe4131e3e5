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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import SourceError
from .plan import Layout, window_permutation

DIGEST_BYTES = 16
MAX_EMPTY_EPOCHS = 16
PREFETCH_HINT = 256        # shards of its plan a partition hints at most when it builds a window
_EMPTY_CHAIN = bytes(DIGEST_BYTES)


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    window: int = 0
    offset: int = 0              # rows of the current window already consumed
    next_shard: int = 0          # position in this epoch's shard list of the next shard to open
    block_slot: int = 0          # open slot the next block is taken from (blocks rotate over open shards)
    block_taken: int = 0         # rows of that block already taken
    consumed_before: int = 0     # samples consumed before the current window (all epochs)
    slots: tuple[tuple[int, int], ...] = ()   # open shards: (position in shard list, next raw row)
    chain: bytes = field(default=_EMPTY_CHAIN)  # digest of the keys of every sample consumed before the window
    epoch_start: int | None = 0  # samples consumed before this epoch began (progress only; None: unknown)

    FIELDS = ("epoch", "window", "offset", "next_shard", "block_slot", "block_taken", "consumed_before")

    @property
    def consumed(self) -> int:
        return self.consumed_before + self.offset

    def next_epoch(self) -> Cursor:
        return Cursor(epoch=self.epoch + 1, consumed_before=self.consumed, chain=self.chain,
                      epoch_start=self.consumed)


def _chain(prev: bytes, shard_ids: np.ndarray, row_ids: np.ndarray) -> bytes:
    h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
    h.update(shard_ids.astype("<i8").tobytes())
    h.update(row_ids.astype("<i8").tobytes())
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
    rows: list[tuple]            # permuted rows as tuples in column order
    shard_ids: np.ndarray        # global shard index of each permuted row
    row_ids: np.ndarray          # raw row inside that shard
    next_start: Cursor           # the cursor at the start of the following window

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> dict:
        return dict(zip(self.names, self.rows[i]))


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
                table, raw = table.take(pa.array(keep)), raw[keep]
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

    def __init__(self, source, layout: Layout, partition: int, cursor: Cursor | None = None):
        self.source, self.layout, self.partition = source, layout, partition
        self._window: Window | None = None
        self._open: dict[int, _OpenShard] = {}   # shards left open by the last window, by position
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
        c, w = self._start, self._window
        if self.offset == 0 or w is None:
            return c.chain.hex()
        return _chain(c.chain, w.shard_ids[: self.offset], w.row_ids[: self.offset]).hex()

    @property
    def epoch(self) -> int:
        return self._start.epoch

    def sample_key(self, i: int) -> tuple[int, int]:
        """(shard, raw row) of row i of the current window."""
        return int(self._window.shard_ids[i]), int(self._window.row_ids[i])

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
            win = self._build(self._start)
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

    def _build(self, start: Cursor) -> Window | None:
        lay = self.layout
        shard_list = lay.shards_for(start.epoch, self.partition)
        step, phase = lay.stride(self.partition)
        # Shards left open by the previous window continue where they are; others are (re)opened.
        live = self._open

        def continues(pos: int, row: int) -> bool:
            return pos in live and live[pos].next_row == row and live[pos].epoch == start.epoch

        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None:   # the shards this window (re)opens or opened unread, then the next ones of the plan
            prefetch(self.partition, [shard_list[pos] for pos, row in start.slots
                                      if not continues(pos, row) or live[pos].unread]
                     + list(shard_list[start.next_shard:start.next_shard + PREFETCH_HINT]))
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
        sids, rids = np.concatenate(shard_ids), np.concatenate(row_ids)
        if lay.shuffle:
            perm = window_permutation(have, lay.seed, start.epoch, self.partition, start.window)
            table = table.take(pa.array(perm))
            sids, rids = sids[perm], rids[perm]
        names = table.column_names
        columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
        rows = list(zip(*columns)) if columns else [()] * have
        for shard in live.values():     # open shards this window did not continue: stop reading them now
            if all(shard is not s for s in slots):
                shard.close()
        self._open = {s.pos: s for s in slots}
        exhausted = not slots and next_shard >= len(shard_list)
        after = Cursor(
            epoch=start.epoch, window=start.window + 1, offset=0, next_shard=next_shard,
            block_slot=block_slot % len(slots) if slots else 0, block_taken=block_taken,
            consumed_before=start.consumed_before + have,
            slots=tuple((s.pos, s.next_row) for s in slots), chain=_chain(start.chain, sids, rids),
            epoch_start=start.epoch_start,
        )
        if exhausted:
            after = replace(after, offset=0).next_epoch()
        return Window(names, rows, sids, rids, after)
