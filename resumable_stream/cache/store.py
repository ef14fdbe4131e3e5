"""The block store: Arrow IPC blocks bound to their key, in a ``diskcache`` directory shared by a node.

A block is ``block_rows`` consecutive rows of one shard (the last one marked), under
``<namespace>/<shard>/<block>`` (the namespace: a digest of the fingerprint, block size and format); its value
a header (magic, flags, rows, length, key digest, CRC-32) and the Arrow IPC stream. What is guaranteed (trust,
locks, read-only caches, sharing): docs/cache-and-warmup.md."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sqlite3
import struct
import threading
import time
import urllib.parse
import zlib
from contextlib import closing
from typing import Any

import diskcache
import pyarrow as pa

from ..observe.metrics import SharedCounters
from .disk import DBNAME, SafeDisk, UnsafeEntry, read_value, sweep_orphans
from .ownership import claim

log = logging.getLogger(__name__)

# Rows per cached block. Part of the key namespace: changing it never mixes layouts.
DEFAULT_BLOCK_ROWS = 8192
# Blocks a reader may have waiting for the writer thread (memory bound: a few blocks).
WRITE_BEHIND_BLOCKS = 4
# The data path never waits long for the cache: a lookup's lock wait, a write's, a reader's wait for a writer
# slot, and how long the cache is skipped after a failure (docs/cache-and-warmup.md).
READ_TIMEOUT_S = 0.2
WRITE_TIMEOUT_S = 2.0
SLOT_WAIT_S = 5.0
RETRY_AFTER_S = 30.0
# Value files no row refers to are removed once this old (a file is written before its row commits).
ORPHAN_AGE_S = 600.0
FORMAT = "rs-block-v3"     # v3: blocks of verified row groups only (v2: the header names its key); older entries miss

_MAGIC = b"RSB2"
# magic, flags, rows, payload bytes, digest of the key, crc32 of (flags, rows, payload bytes, key digest, payload)
_HEADER = struct.Struct("<4sBxxxQQ16sI")
_BOUND = struct.Struct("<BQQ16s")
_FLAG_LAST = 1

# unavailable: lookups given up because cache.db could not be read in time (locked...), served by the source;
# writes_skipped: blocks not cached because the cache was read-only, locked or full
COUNTERS = ("hits", "misses", "corrupt", "unavailable", "writes_skipped", "bytes_read", "bytes_written",
            "blocks_written", "rows_read", "rows_fetched")

# a lookup reads the row itself: diskcache's get would unpickle a row in pickle mode, and write (LRU)
_SELECT = "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1"
_TOUCH = "UPDATE Cache SET access_time = ? WHERE key = ? AND raw = 1"

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
    """The Arrow IPC stream of ``table`` as buffers (schema, batches, end marker), each batch serialized at its
    exact size (~10x faster than a growing ``BufferOutputStream``); dictionary columns go through the writer."""
    if any(_has_dictionary(f.type) for f in table.schema):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return [sink.getvalue()]
    return [table.schema.serialize(), *(rb.serialize() for rb in table.to_batches()), _IPC_EOS]


def _key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def encode_block_parts(table: pa.Table, last: bool, key: str) -> list:
    """[header, *Arrow IPC stream buffers] of the block stored under ``key``: the header names the key (a digest,
    checked by :func:`check_block`), the checksum covers the header's fields and the whole stream."""
    parts = _ipc_stream_parts(table)
    size = sum(memoryview(p).nbytes for p in parts)
    flags, digest = _FLAG_LAST if last else 0, _key_digest(key)
    crc = zlib.crc32(_BOUND.pack(flags, table.num_rows, size, digest))
    for part in parts:
        crc = zlib.crc32(memoryview(part), crc)
    return [_HEADER.pack(_MAGIC, flags, table.num_rows, size, digest, crc), *parts]


def encode_block(table: pa.Table, last: bool, key: str) -> bytes:
    """Header + Arrow IPC stream of ``table`` stored under ``key``, as one bytes value."""
    return b"".join(memoryview(p) for p in encode_block_parts(table, last, key))


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


def check_block(data: bytes, key: str) -> tuple[int, int, memoryview]:
    """(flags, rows, payload) of the value stored under ``key`` if its header, length and checksum are right."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _HEADER.size:
        raise CorruptBlock("shorter than the block header" if isinstance(data, (bytes, bytearray, memoryview))
                           else f"a {type(data).__name__}, not bytes")
    magic, flags, rows, size, digest, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptBlock("bad magic")
    if digest != _key_digest(key):
        raise CorruptBlock("it is the block of another key")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != size:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {size}")
    if zlib.crc32(payload, zlib.crc32(_BOUND.pack(flags, rows, size, digest))) != crc:
        raise CorruptBlock("checksum mismatch")
    return flags, rows, payload


def decode_block(data: bytes, key: str) -> tuple[pa.Table, bool]:
    """(table, is the shard's last block) of the value stored under ``key``; CorruptBlock on any inconsistency."""
    flags, rows, payload = check_block(data, key)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise CorruptBlock(f"unreadable Arrow IPC data ({e})") from None
    if table.num_rows != rows:
        raise CorruptBlock(f"{table.num_rows} rows, header says {rows}")
    return table, bool(flags & _FLAG_LAST)


def _open_read_only(db: str) -> sqlite3.Connection:
    """A read-only connection to ``cache.db`` (immutable in a directory nobody may write: WAL needs that)."""
    uri = "file:" + urllib.parse.quote(db)
    con = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=READ_TIMEOUT_S, isolation_level=None)
    try:
        con.execute("PRAGMA schema_version").fetchone()
        return con
    except sqlite3.OperationalError:
        con.close()
        if os.access(os.path.dirname(db), os.W_OK):
            raise
    return sqlite3.connect(uri + "?immutable=1", uri=True, isolation_level=None)


def _probe_write_lock(db: str) -> None:
    """Raise (within WRITE_TIMEOUT_S) if another connection holds cache.db's write lock: opening a
    ``diskcache.Cache`` retries its set-up statements on a locked database for 60 s."""
    with closing(sqlite3.connect(db, timeout=WRITE_TIMEOUT_S, isolation_level=None)) as con:
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")


def _is_read_only(err: Exception) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    return isinstance(err, sqlite3.OperationalError) and "readonly" in str(err)


class _ProcessState:
    """What one process holds: SQLite connections and diskcache objects must not cross a fork."""

    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()              # held briefly (the reader takes it)
        self.open_lock = threading.Lock()         # held while opening the diskcache (seconds at worst)
        self.readers = threading.local()          # a read-only connection per thread
        self.cache = None                         # the diskcache.Cache writes go through, opened on first write
        self.toucher = None                       # the writer thread's connection that records hits (LRU)
        self.writes_off = None                    # why this process never writes (a read-only cache)
        self.reads_paused_until = self.writes_paused_until = 0.0
        self.pool = None                          # the writer thread
        self.slots = threading.BoundedSemaphore(WRITE_BEHIND_BLOCKS)
        self.pending: set = set()
        # A corrupt entry is counted (and warned) once by the first of this process's threads to meet it: the
        # reader's lookup, or the check of a write queued before that lookup (both may see it, in either order).
        self.dropped: set[str] = set()            # keys found corrupt here, until this process stores them sound
        self.fixed: dict[str, int] = {}           # times this process stored a dropped key: a lookup made before
                                                  # such a store met the old entry (only keys once corrupt)
        self.touched: list[str] = []
        self.touch_queued = False


class BlockStore:
    """Blocks of one dataset (one namespace) in a diskcache directory."""

    def __init__(self, directory: str, size_limit_bytes: int, ns: str, block_rows: int = DEFAULT_BLOCK_ROWS):
        self.directory = os.path.abspath(os.fspath(directory))
        claim(self.directory)           # a directory of ours, or a ConfigError: the cache deletes files here
        self.size_limit_bytes = int(size_limit_bytes)
        self.ns, self.block_rows = ns, block_rows
        self._counters = SharedCounters(COUNTERS)
        self.last_failure: str | None = None    # why the latest write (or lookup) failed, for warmup's report
        self._state = None
        self._state_lock, self._lock_pid = threading.Lock(), os.getpid()
        self._warned_errors = 0

    # ------------------------------------------------------------------ per process
    def _proc(self) -> _ProcessState:
        st, pid = self._state, os.getpid()
        if st is not None and st.pid == pid:
            return st
        if self._lock_pid != pid:               # a lock inherited through fork may be held by a lost thread
            self._state_lock, self._lock_pid = threading.Lock(), pid
        with self._state_lock:
            if self._state is None or self._state.pid != pid:
                if self._state is not None:     # inherited through fork: leave it alone
                    _INHERITED.append(self._state)
                self._state = _ProcessState()
            return self._state

    def _reader(self, st: _ProcessState) -> sqlite3.Connection | None:
        con = getattr(st.readers, "con", None)
        if con is None:
            db = os.path.join(self.directory, DBNAME)
            if not os.path.exists(db):
                return None                     # nothing cached yet
            con = st.readers.con = _open_read_only(db)
        return con

    def _writer_cache(self, st: _ProcessState):
        if st.cache is None:
            with st.open_lock:
                if st.cache is None:
                    os.makedirs(self.directory, exist_ok=True)
                    # created here so that it follows the umask (SQLite would make it 0644); SQLite gives
                    # the -wal and -shm files the database's mode
                    db = os.path.join(self.directory, DBNAME)
                    os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o666))
                    _probe_write_lock(db)
                    cache = diskcache.Cache(self.directory, disk=SafeDisk, timeout=WRITE_TIMEOUT_S,
                                            size_limit=self.size_limit_bytes,
                                            eviction_policy="least-recently-used", statistics=False)
                    self._sweep(st)
                    st.cache = cache
        return st.cache

    def _sweep(self, st: _ProcessState) -> None:
        """Remove value files no row refers to (cache.db deleted, killed writes): they would sit outside
        the size limit for good. Once per process, on its first write."""
        try:
            rows = self._reader(st).execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")
            removed = sweep_orphans(self.directory, {name for (name,) in rows}, ORPHAN_AGE_S)
        except Exception as e:
            self._error("removing value files no entry refers to", e)
            return
        if removed:
            log.warning("block cache %s: removed %d value files no entry refers to", self.directory, removed)

    def diskcache(self):
        """The ``diskcache.Cache`` this process writes through (opened on first use)."""
        return self._writer_cache(self._proc())

    def close(self) -> None:
        """Finish pending writes and close this process's connections (the writer thread's too)."""
        self.flush()
        st = self._state
        if st is None or st.pid != os.getpid():
            return
        def close_this_thread():               # diskcache and the readers hold a connection per thread
            for con in (st.cache, getattr(st.readers, "con", None)):
                if con is not None:
                    con.close()
            st.readers.con = None

        if st.pool is not None:
            try:
                st.pool.submit(close_this_thread)
            except RuntimeError:                # interpreter shutting down: its connections go with it
                pass
            st.pool.shutdown(wait=True)
        close_this_thread()
        if st.toucher is not None:
            st.toucher.close()
        self._state = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"], state["_state_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state_lock, self._lock_pid = threading.Lock(), os.getpid()

    # ------------------------------------------------------------------ blocks
    def key(self, shard: int, block: int) -> str:
        return f"{self.ns}/{shard}/{block}"

    def _error(self, what: str, err: Exception) -> None:
        """The cache is an optimisation: its failures (disk full, locked database...) never stop reading."""
        self._warned_errors += 1
        self.last_failure = f"{what}: {type(err).__name__}: {err}"
        if self._warned_errors <= 5:
            log.warning("block cache %s: %s failed (%s: %s); reading from the source instead%s", self.directory,
                        what, type(err).__name__, err, "" if self._warned_errors < 5 else " (further errors not shown)")

    def _lookup(self, st: _ProcessState, key: str) -> bytes | None:
        """The stored bytes of ``key`` (None if absent); UnsafeEntry for a row that is not raw bytes in the directory."""
        con = self._reader(st)
        if con is None:
            return None
        try:
            row = con.execute(_SELECT, (key,)).fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):        # cache.db being created
                return None
            raise
        if row is None:
            return None
        try:
            return read_value(self.directory, *row)
        except FileNotFoundError:               # evicted between the row and its file
            return None

    def get(self, shard: int, block: int, where: str = "") -> tuple[pa.Table, bool] | None:
        """(table, last) of a cached block, or None: a miss, an unreachable cache (counted ``unavailable``)
        or a corrupt / unsafe entry (dropped, and a miss)."""
        st = self._proc()
        if time.monotonic() < st.reads_paused_until:
            self._counters.add(unavailable=1)
            return None
        key = self.key(shard, block)
        if key in st.dropped:                   # its deletion may still be queued: never read (nor warn) twice
            self._counters.add(misses=1)
            return None
        fixed = st.fixed.get(key, 0)
        try:
            data = self._lookup(st, key)
            hit = None if data is None else decode_block(data, key)
        except (UnsafeEntry, CorruptBlock) as e:
            self._drop(st, shard, block, where, e, fixed)
            hit = None
        except Exception as e:                  # locked, unreadable: skip the cache a while, read the source
            st.reads_paused_until = time.monotonic() + RETRY_AFTER_S
            self._error("a lookup", e)
            self._counters.add(unavailable=1)
            return None
        if hit is None:
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_read=len(data), rows_read=hit[0].num_rows)
        self._touch_behind(st, key)
        return hit

    def contains(self, shard: int, block: int) -> bool:
        st = self._proc()
        try:
            con = self._reader(st)
            return con is not None and con.execute(_SELECT, (self.key(shard, block),)).fetchone() is not None
        except sqlite3.Error as e:
            if "no such table" not in str(e):      # (cache.db being created: simply not there yet)
                self._error("a lookup", e)
            return False

    def _corrupt(self, shard: int, block: int, where: str, err: Exception) -> None:
        log.warning("block cache %s: block %d of shard %d%s is corrupt (%s); dropped, reading it again from "
                    "the source", self.directory, block, shard, f" ({where})" if where else "", err)
        self._counters.add(corrupt=1)

    def _first_to_meet(self, st: _ProcessState, key: str, fixed: int) -> bool:
        """Whether this thread is the first here to meet the corrupt entry of ``key`` (``fixed``: ``st.fixed[key]``
        before its lookup: a sound copy stored since then is no corruption)."""
        with st.lock:
            if key in st.dropped or st.fixed.get(key, 0) != fixed:
                return False
            st.dropped.add(key)
            return True

    def _stored(self, st: _ProcessState, key: str) -> None:
        """A sound copy of ``key`` is in the store (written, or found there) by this process."""
        if key in st.dropped:
            with st.lock:
                if key in st.dropped:
                    st.dropped.discard(key)
                    st.fixed[key] = st.fixed.get(key, 0) + 1

    def _drop(self, st: _ProcessState, shard: int, block: int, where: str, err: Exception, fixed: int) -> None:
        """Warn, and delete the entry on the writer thread, unless another thread here met it first."""
        key = self.key(shard, block)
        if not self._first_to_meet(st, key, fixed):
            return
        self._corrupt(shard, block, where, err)

        def delete():
            if key not in st.dropped:           # stored sound meanwhile (a write queued before this drop)
                return
            if self._may_write(st):
                try:
                    self._writer_cache(st).delete(key)
                except Exception as e:
                    self._write_failed(st, "dropping a corrupt block", e)

        self._behind(st, delete)

    def _may_write(self, st: _ProcessState) -> bool:
        return st.writes_off is None and time.monotonic() >= st.writes_paused_until

    def _write_failed(self, st: _ProcessState, what: str, err: Exception) -> None:
        if _is_read_only(err):
            self.last_failure = f"the cache is read-only ({type(err).__name__}: {err})"
            if st.writes_off is None:
                st.writes_off = f"{type(err).__name__}: {err}"
                log.warning("block cache %s is read-only (%s): serving the blocks it holds, caching no new ones",
                            self.directory, st.writes_off)
        else:
            st.writes_paused_until = time.monotonic() + RETRY_AFTER_S
            self._error(what, err)

    def put(self, shard: int, block: int, table: pa.Table, last: bool, where: str = "") -> int:
        """Store a block unless a sound copy is there: the bytes written, 0 when present or skipped."""
        st = self._proc()
        if not self._may_write(st):
            self._counters.add(writes_skipped=1)
            return 0
        key = self.key(shard, block)
        fixed = st.fixed.get(key, 0)
        try:
            existing = self._lookup(st, key)
            if existing is not None:
                check_block(existing, key)
                self._stored(st, key)
                return 0
        except (UnsafeEntry, CorruptBlock) as e:
            if self._first_to_meet(st, key, fixed):     # else counted by the lookup that met it first
                self._corrupt(shard, block, where, e)
        except Exception:                       # unreadable just now: write it anyway
            pass
        parts = encode_block_parts(table, last, key)
        try:
            cache = self._writer_cache(st)
            try:
                # as a file object: diskcache writes it to a file in 4 MiB pieces with no copy (given bytes,
                # it would iterate them line by line)
                cache.set(key, _PartsReader(*parts), read=True)
            except BaseException:
                cache.disk.remove_last_write()  # its row was not committed: the file would be an orphan
                raise
        except Exception as e:
            self._write_failed(st, "writing a block", e)
            self._counters.add(writes_skipped=1)
            return 0
        self._stored(st, key)
        size = sum(memoryview(p).nbytes for p in parts)
        self._counters.add(bytes_written=size, blocks_written=1)
        return size

    # ------------------------------------------------------------------ writing behind the reader
    def _behind(self, st: _ProcessState, job) -> None:
        """Run ``job`` on this process's writer thread (pending jobs finish before the process exits)."""
        if st.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            with st.lock:
                if st.pool is None:
                    st.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rs-cache-writer")
        try:
            fut = st.pool.submit(job)
        except RuntimeError:          # interpreter shutting down: run it here
            job()
            return
        st.pending.add(fut)
        fut.add_done_callback(st.pending.discard)

    def put_behind(self, shard: int, block: int, table: pa.Table, last: bool, where: str = "") -> None:
        """``put`` on the writer thread, so the reader does not wait for the disk (at most
        ``WRITE_BEHIND_BLOCKS`` blocks in flight; a writer stuck longer than SLOT_WAIT_S is skipped)."""
        st = self._proc()
        if not self._may_write(st):
            self._counters.add(writes_skipped=1)
            return
        if not st.slots.acquire(timeout=SLOT_WAIT_S):
            st.writes_paused_until = time.monotonic() + RETRY_AFTER_S
            self._counters.add(writes_skipped=1)
            return

        def write():
            try:
                self.put(shard, block, table, last, where)     # a dropped key stays dropped until stored sound
            except Exception as e:
                self._error("writing a block", e)
            finally:
                st.slots.release()

        self._behind(st, write)

    def _touch_behind(self, st: _ProcessState, key: str) -> None:
        """Record a hit's access time on the writer thread (the LRU order), hits batched."""
        with st.lock:
            st.touched.append(key)
            if st.touch_queued:
                return
            st.touch_queued = True
        self._behind(st, lambda: self._touch(st))

    def _touch(self, st: _ProcessState) -> None:
        with st.lock:
            keys, st.touched, st.touch_queued = st.touched, [], False
        if not self._may_write(st):
            return
        try:
            if st.toucher is None:
                self._writer_cache(st)            # the database exists and follows the umask
                st.toucher = sqlite3.connect(os.path.join(self.directory, DBNAME), timeout=WRITE_TIMEOUT_S,
                                             isolation_level=None, check_same_thread=False)
            now = time.time()
            st.toucher.execute("BEGIN IMMEDIATE")
            try:
                st.toucher.executemany(_TOUCH, [(now, k) for k in keys])
                st.toucher.execute("COMMIT")
            except BaseException:
                st.toucher.execute("ROLLBACK")
                raise
        except Exception as e:
            self._write_failed(st, "recording cache hits", e)

    def flush(self) -> None:
        """Wait until the blocks handed to :meth:`put_behind` by this process are written."""
        st = self._state
        if st is None or st.pid != os.getpid():
            return
        from concurrent.futures import wait

        while st.pending:
            wait(list(st.pending))

    def count(self, **deltas: int) -> None:
        self._counters.add(**deltas)

    def _volume(self) -> int | None:
        con = self._reader(self._proc())
        if con is None:
            return 0
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        page_count = con.execute("PRAGMA page_count").fetchone()[0]
        row = con.execute("SELECT value FROM Settings WHERE key = 'size'").fetchone()
        return int(page_size * page_count + (row[0] if row else 0))     # what diskcache's volume() counts

    def stats(self) -> dict[str, Any]:
        """Counters of this process and the DataLoader workers it started, plus the cache's size on disk."""
        s: dict[str, Any] = self._counters.snapshot()
        lookups = s["hits"] + s["misses"]
        s["hit_rate"] = round(s["hits"] / lookups, 4) if lookups else None
        try:
            s["cache_bytes"] = self._volume()
        except Exception:   # a stats call must never break training
            s["cache_bytes"] = None
        s["size_limit_bytes"] = self.size_limit_bytes
        return s
