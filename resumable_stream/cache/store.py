"""The block store: Arrow IPC blocks with a checksum in a ``diskcache`` directory shared by a node.

A *block* is ``block_rows`` consecutive rows of one shard (block *b* holds rows
``[b * block_rows, (b + 1) * block_rows)``; the shard's last block may be shorter, and is marked
*last* so that a fully cached shard is read without asking the source anything).

Keys are ``"<namespace>/<shard>/<block>"`` where the namespace is a digest of the dataset
fingerprint (files with sizes / versions, split, builder...) and the block size, so a changed
file or another block size never meets an old entry. Values are raw bytes (diskcache stores
``bytes`` without pickling): a fixed header (magic, flags, rows, payload length, CRC-32)
followed by the Arrow IPC stream of the block. A value that fails any check is dropped with a
warning and the block is fetched again.

Every process (rank, DataLoader worker, warmup thread pool) opens the diskcache itself, lazily
and again after a fork: SQLite connections must not cross a fork. diskcache's SQLite (WAL) and
its file writes are safe between processes and threads, so one directory serves a whole node.
Counters (hits, misses, bytes...) live in shared memory created by the process that made the
store, so DataLoader workers' reads show up in the main process's :meth:`BlockStore.stats`.
Blocks read from the source are written by one background thread per process
(:meth:`BlockStore.put_behind`), so a cold read does not wait for the disk; pending writes
finish before the process exits, and :meth:`BlockStore.flush` waits for them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import struct
import threading
import zlib
from typing import Any

import pyarrow as pa

log = logging.getLogger(__name__)

# Rows per cached block. Part of the key namespace: changing it never mixes layouts.
DEFAULT_BLOCK_ROWS = 8192
# Blocks a reader may have waiting for the writer thread (memory bound: a few blocks).
WRITE_BEHIND_BLOCKS = 4
FORMAT = "rs-block-v1"

_MAGIC = b"RSB1"
_HEADER = struct.Struct("<4sBxxxQQI")     # magic, flags, rows, payload bytes, crc32 of the payload
_FLAG_LAST = 1

COUNTERS = ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "blocks_written", "rows_read",
            "rows_fetched")
_INDEX = {name: i for i, name in enumerate(COUNTERS)}

# diskcache objects inherited through a fork: never used (nor closed) in the child, only kept
# referenced so that garbage collection does not close the parent's SQLite handles from here.
_INHERITED: list = []


class CorruptBlock(ValueError):
    """A cached value that is not a well-formed block (bad header, length, checksum or IPC data)."""


def namespace(fingerprint: dict, block_rows: int) -> str:
    """Key prefix of one dataset's blocks: a digest of its fingerprint and the block size."""
    text = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "block_rows": block_rows},
                      sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"      # end-of-stream marker of the Arrow IPC stream format


def _has_dictionary(t: pa.DataType) -> bool:
    return pa.types.is_dictionary(t) or any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def _ipc_stream_parts(table: pa.Table) -> list:
    """The Arrow IPC stream of ``table`` as a list of buffers (schema, batches, end marker).

    Each record batch is serialized into a buffer of its exact size: ~10x faster than
    ``ipc.new_stream`` into a growing ``BufferOutputStream`` on the cache-filling path. Dictionary
    columns need dictionary messages, so they go through the stream writer.
    """
    if any(_has_dictionary(f.type) for f in table.schema):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return [sink.getvalue()]
    return [table.schema.serialize(), *(rb.serialize() for rb in table.to_batches()), _IPC_EOS]


def encode_block_parts(table: pa.Table, last: bool) -> list:
    """[header, *Arrow IPC stream buffers] of a block; the checksum covers the whole stream."""
    parts = _ipc_stream_parts(table)
    size = crc = 0
    for part in parts:
        view = memoryview(part)
        size += view.nbytes
        crc = zlib.crc32(view, crc)
    return [_HEADER.pack(_MAGIC, _FLAG_LAST if last else 0, table.num_rows, size, crc), *parts]


def encode_block(table: pa.Table, last: bool) -> bytes:
    """Header + Arrow IPC stream of ``table``, as one bytes value."""
    return b"".join(memoryview(p) for p in encode_block_parts(table, last))


class _PartsReader:
    """A read-only file object over a few buffers, handing out views (diskcache writes them as they come)."""

    def __init__(self, *parts):
        self._parts = [memoryview(p) for p in parts]
        self._i = self._off = 0

    def read(self, n: int = -1):
        while self._i < len(self._parts):
            part = self._parts[self._i]
            if self._off < len(part):
                chunk = part[self._off:] if n is None or n < 0 else part[self._off:self._off + n]
                self._off += len(chunk)
                return chunk
            self._i, self._off = self._i + 1, 0
        return b""


def check_block(data: bytes) -> tuple[int, int, memoryview]:
    """(flags, rows, payload) of a stored value whose header, length and checksum are right."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _HEADER.size:
        raise CorruptBlock("shorter than the block header" if isinstance(data, (bytes, bytearray, memoryview))
                           else f"a {type(data).__name__}, not bytes")
    magic, flags, rows, size, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptBlock("bad magic")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != size:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {size}")
    if zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return flags, rows, payload


def decode_block(data: bytes) -> tuple[pa.Table, bool]:
    """(table, is the shard's last block); raises CorruptBlock on any inconsistency."""
    flags, rows, payload = check_block(data)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise CorruptBlock(f"unreadable Arrow IPC data ({e})") from None
    if table.num_rows != rows:
        raise CorruptBlock(f"{table.num_rows} rows, header says {rows}")
    return table, bool(flags & _FLAG_LAST)


class _Counters:
    """Integer counters in shared memory (inherited by forked or spawned DataLoader workers)."""

    def __init__(self):
        try:
            # a spawn-context lock can go to forked, spawned and forkserver workers alike
            self._arr = multiprocessing.get_context("spawn").Array("q", len(COUNTERS))
        except (OSError, ImportError):     # no shared memory available: this process only
            self._arr = None
            self._local = [0] * len(COUNTERS)
            self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        if self._arr is not None:
            with self._arr.get_lock():
                for name, d in deltas.items():
                    self._arr[_INDEX[name]] += d
        else:
            with self._lock:
                for name, d in deltas.items():
                    self._local[_INDEX[name]] += d

    def snapshot(self) -> dict[str, int]:
        if self._arr is not None:
            with self._arr.get_lock():
                values = list(self._arr)
        else:
            with self._lock:
                values = list(self._local)
        return dict(zip(COUNTERS, values))

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        if self._arr is not None and get_spawning_popen() is not None:
            return {"arr": self._arr}         # handed to a worker being started: keep sharing
        # pickled for anything else (a copy of the stream): start a private set of counters
        return {"arr": None, "local": [0] * len(COUNTERS)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._arr = state["arr"]
        self._local = state.get("local", [0] * len(COUNTERS))
        self._lock = threading.Lock()


class BlockStore:
    """Blocks of one dataset (one namespace) in a diskcache directory."""

    def __init__(self, directory: str, size_limit_bytes: int, ns: str, block_rows: int = DEFAULT_BLOCK_ROWS):
        self.directory = os.path.abspath(os.fspath(directory))
        self.size_limit_bytes = int(size_limit_bytes)
        self.ns, self.block_rows = ns, block_rows
        self._counters = _Counters()
        self._cache = None
        self._pid = None
        self._open_lock, self._lock_pid = threading.Lock(), os.getpid()
        self._writer = None      # (pid, executor, in-flight semaphore, pending futures) of this process
        self._warned_errors = 0

    # ------------------------------------------------------------------ the diskcache, per process
    def _store(self):
        pid = os.getpid()
        if self._cache is not None and self._pid == pid:
            return self._cache
        if self._lock_pid != pid:               # a lock inherited through fork may be held by a lost thread
            self._open_lock, self._lock_pid = threading.Lock(), pid
        with self._open_lock:
            if self._cache is not None and self._pid == os.getpid():
                return self._cache
            if self._cache is not None:         # inherited through fork: leave it alone
                _INHERITED.append(self._cache)
            import diskcache

            os.makedirs(self.directory, exist_ok=True)
            self._cache = diskcache.Cache(
                self.directory, size_limit=self.size_limit_bytes, eviction_policy="least-recently-used",
                statistics=False, timeout=120)
            self._pid = os.getpid()
            return self._cache

    def close(self) -> None:
        self.flush()
        if self._cache is not None and self._pid == os.getpid():
            self._cache.close()
        self._cache = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_pid"], state["_open_lock"], state["_writer"] = None, None, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open_lock, self._lock_pid = threading.Lock(), os.getpid()

    # ------------------------------------------------------------------ blocks
    def key(self, shard: int, block: int) -> str:
        return f"{self.ns}/{shard}/{block}"

    def _error(self, what: str, err: Exception) -> None:
        """The cache is an optimisation: its failures (disk full, locked database...) never stop reading."""
        self._warned_errors += 1
        if self._warned_errors <= 5:
            log.warning("block cache %s: %s failed (%s: %s); reading from the source instead%s", self.directory,
                        what, type(err).__name__, err, "" if self._warned_errors < 5 else " (further errors not shown)")

    def get(self, shard: int, block: int, where: str = "") -> tuple[pa.Table, bool] | None:
        """(table, last) of a cached block, or None (a miss; a corrupt entry is dropped and is a miss)."""
        key = self.key(shard, block)
        try:
            data = self._store().get(key)
        except Exception as e:
            self._error("a lookup", e)
            data = None
        if data is None:
            self._counters.add(misses=1)
            return None
        try:
            table, last = decode_block(data)
        except CorruptBlock as e:
            self._corrupt(shard, block, where, e)
            try:
                self._store().delete(key)
            except Exception as err:
                self._error("dropping a corrupt block", err)
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_read=len(data), rows_read=table.num_rows)
        return table, last

    def contains(self, shard: int, block: int) -> bool:
        return self.key(shard, block) in self._store()

    def _corrupt(self, shard: int, block: int, where: str, err: Exception) -> None:
        log.warning("block cache %s: block %d of shard %d%s is corrupt (%s); dropped, reading it again from "
                    "the source", self.directory, block, shard, f" ({where})" if where else "", err)
        self._counters.add(corrupt=1)

    def put(self, shard: int, block: int, table: pa.Table, last: bool, where: str = "") -> int:
        """Store a block unless a sound copy is already there; returns the bytes written (0 if present).

        An entry already there is checked (header and checksum) and replaced if it is corrupt.
        """
        key = self.key(shard, block)
        cache = self._store()
        if key in cache:
            existing = cache.get(key)
            if existing is not None:
                try:
                    check_block(existing)
                    return 0
                except CorruptBlock as e:
                    self._corrupt(shard, block, where, e)
        parts = encode_block_parts(table, last)
        # as a file object: diskcache writes it to a file in 4 MiB pieces with no copy (given bytes, it
        # would iterate them line by line) and reads it back as bytes
        cache.set(key, _PartsReader(*parts), read=True)
        size = sum(memoryview(p).nbytes for p in parts)
        self._counters.add(bytes_written=size, blocks_written=1)
        return size

    # ------------------------------------------------------------------ writing behind the reader
    def _writer_of_this_process(self):
        w = self._writer
        if w is None or w[0] != os.getpid():   # none yet, or inherited through fork (its thread is gone)
            from concurrent.futures import ThreadPoolExecutor

            w = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="rs-cache-writer"),
                 threading.BoundedSemaphore(WRITE_BEHIND_BLOCKS), set())
            self._writer = w
        return w

    def put_behind(self, shard: int, block: int, table: pa.Table, last: bool, where: str = "") -> None:
        """``put`` on a writer thread, so the reader does not wait for the disk (at most
        ``WRITE_BEHIND_BLOCKS`` blocks in flight). Pending writes finish before the process exits."""
        _, pool, slots, pending = self._writer_of_this_process()
        slots.acquire()

        def write():
            try:
                self.put(shard, block, table, last, where)
            except Exception as e:
                self._error("writing a block", e)

        try:
            fut = pool.submit(write)
        except RuntimeError:          # interpreter shutting down: write here
            slots.release()
            write()
            return
        pending.add(fut)

        def done(f):
            pending.discard(f)
            slots.release()

        fut.add_done_callback(done)

    def flush(self) -> None:
        """Wait until the blocks handed to :meth:`put_behind` by this process are written."""
        w = self._writer
        if w is None or w[0] != os.getpid():
            return
        from concurrent.futures import wait

        wait(list(w[3]))

    def count(self, **deltas: int) -> None:
        self._counters.add(**deltas)

    def stats(self) -> dict[str, Any]:
        """Counters of this process and the DataLoader workers it started, plus the cache's size on disk."""
        s: dict[str, Any] = self._counters.snapshot()
        lookups = s["hits"] + s["misses"]
        s["hit_rate"] = round(s["hits"] / lookups, 4) if lookups else None
        try:
            s["cache_bytes"] = int(self._store().volume())
        except Exception:   # a stats call must never break training
            s["cache_bytes"] = None
        s["size_limit_bytes"] = self.size_limit_bytes
        return s
