"""``CachedSource``: a read-through block cache around any :class:`~resumable_stream.sources.base.Source`: blocks
from the store while they are there, then the source from the first missing one (written behind). Rows, order and
fingerprint are the source's own, so a state resumes with the cache on or off."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ..config import formats as registry
from ..config.specs import CacheSpec
from ..errors import ConfigError
from ..sources.base import Source
from ..sources.footer_cache import FooterCache
from ..sources.index import identity_of
from .store import DEFAULT_BLOCK_ROWS, BlockStore, namespace


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)   # zero-copy: chunks stay chunks


def _in_blocks(tables: Iterator[pa.Table], rows: int, schema: pa.Schema | None = None
               ) -> Iterator[tuple[pa.Table, bool]]:
    """The rows of ``tables`` cut into (block, whole) of ``rows`` rows; once they end, what is left as a block that
    is not whole (empty when they ended on a boundary; none when no schema is known)."""
    parts: list[pa.Table] = []
    have = 0
    for table in tables:
        schema = table.schema
        while table.num_rows:
            take = min(rows - have, table.num_rows)
            parts.append(table.slice(0, take))
            table = table.slice(take)
            have += take
            if have == rows:
                yield _concat(parts), True
                parts, have = [], 0
    if parts:
        yield _concat(parts), False
    elif schema is not None:
        yield schema.empty_table(), False


def _keep_footers(directory: str, source: Source) -> None:
    """Keep the footers ``source``'s index was built from, by file identity, in the (claimed) cache directory:
    a later process building the index again reads none of them (``sources/footer_cache.py``)."""
    footers = getattr(source, "footers", None)
    index = getattr(source, "index", None)
    if not footers or not index:
        return
    reader = registry.format_of_index(index).load()
    not_identity = tuple(reader.layout_keys) + tuple(reader.content_keys)    # what the file's bytes gave
    kept = FooterCache(directory)
    for entry in index.get("files", ()):
        footer = footers.get(entry.get("path"))
        if footer is not None:
            kept.put(identity_of(entry, not_identity), footer)


def with_block_cache(source: Source, cache: CacheSpec) -> Source:
    """``source`` behind the local block cache when ``cache.directory`` is set (it never changes results)."""
    if not cache.directory or source.is_cached:
        return source
    return CachedSource(source, cache)


class CachedSource(Source):
    """Read-through local block cache: ``cache`` (``data.cache_dir`` / ``data.cache_size_limit_gb``), or the
    keywords ``cache_dir`` / ``size_limit_gb`` (default 50 GB); ``block_rows``: rows per cached block."""

    is_cached = True

    def __init__(self, source: Source, cache: CacheSpec | None = None, *, cache_dir: str | None = None,
                 size_limit_gb: float | None = None, block_rows: int | None = None):
        directory = cache_dir or (cache.directory if cache is not None else None)
        if not directory:
            raise ConfigError("data.cache_dir: got null; the block cache needs a directory")
        limit_gb = size_limit_gb if size_limit_gb is not None else (
            cache.size_limit_gb if cache is not None else 50)
        self.inner = source
        self.shards = source.shards
        self.fingerprint = source.fingerprint
        self.column_names = source.column_names
        self.exact_rows = source.exact_rows
        self.index = source.index     # the dataset index, saved with checkpoints
        self.block_rows = int(block_rows or DEFAULT_BLOCK_ROWS)
        self._missed = False                             # read anything from the source yet (this process)?
        self._hints: dict[int, tuple[list[int], dict[int, int]]] = {}   # (shards, starts) per partition, until then
        self.store = BlockStore(os.path.expanduser(directory), int(limit_gb * 2**30),
                                namespace(source.fingerprint, self.block_rows), self.block_rows)
        _keep_footers(self.store.directory, source)

    # ------------------------------------------------------------------ geometry
    def num_blocks(self, shard: int) -> int | None:
        """Blocks of a shard whose row count is known (None otherwise)."""
        n = self.shards[shard].num_rows
        return None if n is None else -(-n // self.block_rows)

    def _is_last(self, shard: int, block: int) -> bool:
        n = self.shards[shard].num_rows
        return n is not None and (block + 1) * self.block_rows >= n

    def _fully_cached(self, shard: int, first: int = 0) -> bool:
        """Whether the store holds every block of ``shard`` from block ``first`` on."""
        n = self.num_blocks(shard)
        return n is not None and all(self.store.contains(shard, b) for b in range(first, n))

    # ------------------------------------------------------------------ reading
    def prefetch(self, partition: int, shards: list[int], starts: dict[int, int] | None = None) -> None:
        """Pass the plan's next shards on to the source's prefetch, leaving out those the cache holds whole, once this
        process has missed the cache (a warm cache makes no request, not even ahead). ``starts`` are rounded down
        to a block: ``_read_through`` reads whole blocks."""
        if self.inner.prefetch_depth <= 0:
            return
        starts = starts or {}
        if not self._missed:
            self._hints[partition] = (shards, starts)
            return
        depth = self.inner.prefetch_ahead(partition)       # the adaptive depth, not only its cap
        R = self.block_rows
        missing: list[int] = []
        for shard in dict.fromkeys(shards):
            if len(missing) == depth:
                break
            if not self._fully_cached(shard, starts.get(shard, 0) // R):
                missing.append(shard)
        self.inner.prefetch(partition, missing,
                            starts={s: starts[s] // R * R for s in missing if starts.get(s, 0) >= R})

    def _first_miss(self) -> None:
        self._missed = True
        hints, self._hints = self._hints, {}
        for partition, (shards, starts) in hints.items():
            self.prefetch(partition, shards, starts)

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        n = self.shards[shard].num_rows
        if n is not None and start_row >= n:
            return
        R = self.block_rows
        block, skip = divmod(start_row, R)
        schema = None
        while True:
            hit = self.store.get(shard, block, self.shards[shard].name)
            if hit is None:
                yield from self._read_through(shard, block, skip, schema)
                return
            table, last = hit
            schema = table.schema
            if skip:
                table, skip = table.slice(min(skip, table.num_rows)), 0
            if table.num_rows:
                yield table
            if last:
                return
            block += 1

    def _source_blocks(self, shard: int, block: int, schema: pa.Schema | None = None
                       ) -> Iterator[tuple[int, pa.Table, bool]]:
        """(block number, table, last) of the source's rows from ``block`` on, in whole blocks: the block where the
        source ended is the shard's last (empty when it ended on a boundary). The source is closed when left."""
        tables = self.inner.read(shard, block * self.block_rows)
        try:
            for table, whole in _in_blocks(tables, self.block_rows, schema):
                last = self._is_last(shard, block) if whole else True
                self.store.count(rows_fetched=table.num_rows)
                yield block, table, last
                if last:
                    return
                block += 1
        finally:
            close = getattr(tables, "close", None)
            if close is not None:
                close()

    def _read_through(self, shard: int, block: int, skip: int, schema: pa.Schema | None) -> Iterator[pa.Table]:
        """Read the source from ``block`` on; store and yield whole blocks (the first one cut at ``skip``)."""
        if not self._missed:
            self._first_miss()
        with contextlib.closing(self._source_blocks(shard, block, schema)) as blocks:
            for b, table, last in blocks:
                self.store.put_behind(shard, b, table, last, self.shards[shard].name)
                if skip:
                    table, skip = table.slice(min(skip, table.num_rows)), 0
                if table.num_rows:
                    yield table

    # ------------------------------------------------------------------ warmup
    def fetch_blocks(self, shard: int, first: int, last: int, on_block=None) -> tuple[int, int]:
        """Fetch the missing blocks ``first..last`` of a shard into the store: (blocks, bytes) written;
        ``on_block(bytes_written)`` per block."""
        written = nbytes = 0
        with contextlib.closing(self._source_blocks(shard, first)) as blocks:
            for block, table, is_last in blocks:
                if not table.num_rows:       # the source ended on a block boundary: nothing more to store
                    break
                b = self.store.put(shard, block, table, is_last)
                written, nbytes = written + (b > 0), nbytes + b
                if on_block is not None:
                    on_block(b)
                if block >= last:
                    break
        return written, nbytes

    # ------------------------------------------------------------------ the rest
    def stats(self) -> dict[str, Any]:
        """Hits, misses, corrupt blocks, bytes and rows read from / written to the cache, hit rate, size."""
        return self.store.stats()

    def flush(self) -> None:
        """Wait for the blocks this process is still writing (reads never wait for them)."""
        self.store.flush()

    def close(self) -> None:
        """Stop the source's fetches ahead, then finish the blocks being written (see Source.close)."""
        self.inner.close()
        self.store.close()
