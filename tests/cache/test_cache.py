"""The local block cache: never changes results (off / cold / warm / mixed resume, local and over HTTP),
checksums, corrupt entries, eviction, one cache shared by DataLoader workers and processes, stats."""

from __future__ import annotations

import itertools
import json
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
from helpers import parquet_config, shared_source, take_ids, through_sidecar
from http_server import FileServer
from repo_paths import REPO_ROOT

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.cache import CachedSource, CorruptBlock, decode_block, encode_block
from resumable_stream.sources import ShardInfo, Source
from resumable_stream.testing import synthetic_rows, write_parquet_dataset

pytestmark = pytest.mark.timeout(120)

_source = shared_source


def _cached(cfg: StreamConfig, cache_dir, block_rows: int = 32, **kw) -> CachedSource:
    return CachedSource(_source(cfg), cfg.replace(cache_dir=str(cache_dir), **kw).cache_spec, block_rows=block_rows)


def _stream(cfg, source, **kw) -> ResumableStream:
    return ResumableStream(cfg, source=source, **kw)


# ------------------------------------------------------------------------------ the block format
def test_block_roundtrip_keeps_schema_and_flags():
    table = pa.table(synthetic_rows(0, 100))
    table = table.replace_schema_metadata({b"huggingface": b'{"info": 1}'})
    for last in (False, True):
        data = encode_block(table, last, "ns/0/1")
        assert isinstance(data, bytes)           # raw bytes: diskcache stores them without pickle
        back, flag = decode_block(data, "ns/0/1")
        assert back.equals(table) and back.schema.metadata == table.schema.metadata and flag is last
    empty, flag = decode_block(encode_block(table.schema.empty_table(), True, "k"), "k")
    assert empty.num_rows == 0 and empty.schema == table.schema and flag


def test_block_roundtrip_of_chunked_sliced_nested_and_dictionary_columns():
    """Blocks are cut from several source tables (many chunks, slices with offsets); nested types and
    dictionary columns (which need dictionary messages in the IPC stream) come back identical."""
    rows = synthetic_rows(0, 90)
    rows["tags"] = [[f"t{i}", f"u{i % 3}"] for i in range(90)]
    rows["meta"] = [{"a": i, "b": str(i)} for i in range(90)]
    base = pa.table(rows)
    chunked = pa.concat_tables([base.slice(0, 30), base.slice(30, 25), base.slice(55)]).slice(7, 70)
    assert chunked.column("text").num_chunks == 3
    cat = pa.array([f"c{i % 4}" for i in range(70)]).dictionary_encode()
    for table in (chunked, chunked.append_column("cat", cat)):
        back, _ = decode_block(encode_block(table, False, "k"), "k")
        assert back.equals(table) and back.num_rows == 70
        assert back.column("tags").to_pylist() == rows["tags"][7:77]


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "magic", "short", "not-bytes", "last-flag",
                                    "rows", "other-key"])
def test_damaged_block_is_detected(damage):
    data = bytearray(encode_block(pa.table(synthetic_rows(0, 50)), False, "ns/3/7"))
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "extend":
        data += b"\0"
    elif damage == "magic":
        data[0:4] = b"XXXX"
    elif damage == "short":
        data = data[:10]
    elif damage == "last-flag":                # the header's fields are under the checksum too
        data[4] ^= 1
    elif damage == "rows":
        data[8] ^= 1
    value = 12345 if damage == "not-bytes" else bytes(data)
    with pytest.raises(CorruptBlock):
        decode_block(value, "ns/3/8" if damage == "other-key" else "ns/3/7")


# ------------------------------------------------------------------------------ results never change
@pytest.mark.parametrize(("world_size", "rank", "workers", "shuffle", "buffer", "block_rows"), [
    (1, 0, 0, True, 64, 32),      # blocks smaller than the 50-row shards: partial last blocks
    (2, 1, 2, True, 333, 16),     # two partitions per rank, interleaved in the main process
    (3, 2, 0, False, 7, 50),      # blocks exactly the shard size
    (1, 0, 0, True, 100, 8192),   # the default: one block per shard
])
def test_cache_off_cold_warm_identical(parquet_small, tmp_path, world_size, rank, workers, shuffle, buffer,
                                       block_rows):
    cfg = parquet_config(parquet_small, shuffle=shuffle, buffer_size=buffer, block_rows=16)
    n = 2300 // world_size                    # more than two epochs of this rank
    kw = dict(rank=rank, world_size=world_size, num_workers=workers)
    reference = take_ids(_stream(cfg, _source(cfg), **kw), n)
    cold = _cached(cfg, tmp_path / "c", block_rows)
    assert take_ids(_stream(cfg, cold, **kw), n) == reference
    cold.flush()                              # blocks are written behind the reader
    assert cold.stats()["misses"] > 0 and cold.stats()["blocks_written"] > 0
    warm = _cached(cfg, tmp_path / "c", block_rows)
    rows = [r for r in itertools.islice(_stream(cfg, warm, **kw), n)]
    assert [r["id"] for r in rows] == reference
    s = warm.stats()
    assert s["misses"] == 0 and s["rows_fetched"] == 0 and s["hits"] > 0 and s["hit_rate"] == 1.0
    # whole samples too, not only ids
    plain = list(itertools.islice(_stream(cfg, _source(cfg), **kw), n))
    assert rows == plain


def test_stream_wraps_its_source_and_keeps_the_fingerprint(parquet_small, tmp_path):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    cached_cfg = cfg.replace(cache_dir=str(tmp_path / "c"), cache_size_limit_gb=0.5)
    on = ResumableStream(cached_cfg, source=_source(cfg))
    off = ResumableStream(cfg, source=_source(cfg))
    assert isinstance(on.source, CachedSource) and on.source.store.size_limit_bytes == 2**29
    assert on.fingerprint() == off.fingerprint()
    # a sidecar written with the cache on resumes with it off, and the other way round
    head = take_ids(on, 150)
    state = through_sidecar(on.state_dict())
    resumed_off = ResumableStream(cfg, source=_source(cfg))
    resumed_off.load_state_dict(state)
    assert head + take_ids(resumed_off, 100) == take_ids(ResumableStream(cfg, source=_source(cfg)), 250)
    state = through_sidecar(off.state_dict())
    resumed_on = ResumableStream(cached_cfg, source=_source(cfg))
    resumed_on.load_state_dict(state)
    assert take_ids(resumed_on, 100) == take_ids(off, 100)


@pytest.mark.parametrize("stop", [0, 137, 640, 1333])
def test_resume_mixing_cached_and_uncached_blocks(parquet_small, tmp_path, stop):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=100, block_rows=16, interleave_shards=3)
    kw = dict(rank=1, world_size=2, num_workers=2)
    reference = take_ids(_stream(cfg, _source(cfg), **kw), stop + 600)
    first = _cached(cfg, tmp_path / "c", block_rows=16)
    first_stream = _stream(cfg, first, **kw)
    assert take_ids(first_stream, stop) == reference[:stop]
    first.flush()
    state = through_sidecar(first_stream.state_dict())
    # drop every third cached block: the resumed run meets hits and misses, also inside one shard
    store = first.store
    cache = store.diskcache()
    keys = sorted(k for k in cache.iterkeys() if k.startswith(store.ns))
    for k in keys[::3]:
        del cache[k]
    resumed_source = _cached(cfg, tmp_path / "c", block_rows=16)
    resumed = _stream(cfg, resumed_source, **kw)
    resumed.load_state_dict(state)
    assert take_ids(resumed, 600) == reference[stop:]
    s = resumed_source.stats()
    if stop:
        assert s["hits"] > 0 and s["misses"] > 0


# ------------------------------------------------------------------------------ corrupt entries
@pytest.fixture(scope="module")
def parquet_wide_groups(tmp_path_factory):
    """1600 rows in 2 files x 2 row groups of 400 rows (blocks of ~30 KB and more)."""
    d = tmp_path_factory.mktemp("wide")
    write_parquet_dataset(str(d), rows=1600, files=2, row_group_size=400, words=12)
    return str(d)


def test_corrupt_entries_are_dropped_refetched_and_warned(parquet_wide_groups, tmp_path, caplog):
    cfg = parquet_config(parquet_wide_groups, shuffle=True, buffer_size=64)
    # 400-row blocks go to files (> 32 KiB), 10-row blocks into SQLite: damage both kinds
    for block_rows, where in ((400, "file"), (10, "db")):
        c = _cached(cfg, tmp_path / where, block_rows=block_rows)
        reference = take_ids(_stream(cfg, _source(cfg)), 1000)
        assert take_ids(_stream(cfg, c), 1000) == reference
        c.flush()
        cache = c.store.diskcache()
        keys = sorted(k for k in cache.iterkeys() if k.startswith(c.store.ns))
        damaged = keys[::4]
        for k in damaged:
            if where == "file":
                path = _value_file(c.store, k)   # a file-stored value
                with open(path, "r+b") as f:
                    f.seek(os.path.getsize(path) // 2)
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0xFF]))
            else:
                raw = bytearray(cache[k])
                raw[-3] ^= 0xFF
                cache[k] = bytes(raw)
        caplog.clear()
        again = _cached(cfg, tmp_path / where, block_rows=block_rows)
        with caplog.at_level(logging.WARNING, logger="resumable_stream.cache.store"):
            assert take_ids(_stream(cfg, again), 1000) == reference
        again.flush()
        s = again.stats()
        assert s["corrupt"] == len(damaged), (where, s)
        assert sum("is corrupt" in r.getMessage() for r in caplog.records) == len(damaged)
        for k in damaged:                    # fetched again and stored whole
            decode_block(cache[k], k)
        third = _cached(cfg, tmp_path / where, block_rows=block_rows)
        assert take_ids(_stream(cfg, third), 1000) == reference and third.stats()["misses"] == 0


def _value_file(store, key: str) -> str:
    with sqlite3.connect(os.path.join(store.directory, "cache.db")) as con:
        (name,), = con.execute("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchall()
    return os.path.join(store.directory, name)


# ------------------------------------------------------------------------------ shards and sources
class _MemorySource(Source):
    """Shards held in memory, row counts optionally unknown; counts how often it is read."""

    def __init__(self, sizes: list[int], known: bool, batch: int = 7):
        self.tables, start = [], 0
        for n in sizes:
            self.tables.append(pa.table(synthetic_rows(start, n)))
            start += n
        self.shards = [ShardInfo(i, f"mem{i}", None, n if known else None) for i, n in enumerate(sizes)]
        self.fingerprint = {"memory": sizes, "known": known}
        self.column_names = ["id", "text", "label"]
        self.batch, self.reads = batch, 0

    def read(self, shard, start_row=0):
        self.reads += 1
        t = self.tables[shard]
        for lo in range(start_row, t.num_rows, self.batch):
            yield t.slice(lo, self.batch)


@pytest.mark.parametrize("known", [True, False])
def test_fully_cached_shard_reads_nothing_from_the_source(tmp_path, known):
    sizes = [48, 50, 0, 16, 1]                  # multiples of the block size, partial blocks, empty
    src = _MemorySource(sizes, known)
    cached = CachedSource(src, cache_dir=str(tmp_path), block_rows=16)
    for shard, n in enumerate(sizes):
        for start in (0, 5, 16, 47, n):
            got = list(cached.read(shard, start))
            expect = src.tables[shard].slice(start)
            assert (pa.concat_tables(got) if got else expect.schema.empty_table()).to_pylist() == expect.to_pylist()
    cached.flush()
    src.reads = 0
    again = CachedSource(src, cache_dir=str(tmp_path), block_rows=16)
    for shard, n in enumerate(sizes):
        for start in range(0, n + 2):
            got = list(again.read(shard, start))
            assert sum(t.num_rows for t in got) == max(0, n - start)
            if got:
                assert pa.concat_tables(got).column("id").to_pylist() == \
                    src.tables[shard].column("id").to_pylist()[start:]
    if known:
        assert src.reads == 0
    else:   # an empty shard read past its end has no schema to cache an empty block with
        assert src.reads == 2


def test_size_limit_evicts_least_recently_used(parquet_60, tmp_path):
    cfg = parquet_config(parquet_60, shuffle=True, buffer_size=256)
    limit_gb = 0.3 / 1024                       # ~0.3 MB; each 100-row block is ~9 KB
    c = CachedSource(_source(cfg), cfg.replace(cache_dir=str(tmp_path), cache_size_limit_gb=limit_gb).cache_spec,
                     block_rows=100)
    cache = c.store.diskcache()
    assert cache.eviction_policy == "least-recently-used" and cache.size_limit == int(limit_gb * 2**30)
    reference = take_ids(_stream(cfg, _source(cfg)), 6000)
    assert take_ids(_stream(cfg, c), 6000) == reference
    c.flush()
    assert c.stats()["blocks_written"] == 60
    assert len(cache) < 60                      # culled
    # the blocks read last survive; reading the epoch again still gives the same samples
    again = CachedSource(_source(cfg), cfg.replace(cache_dir=str(tmp_path), cache_size_limit_gb=limit_gb).cache_spec,
                         block_rows=100)
    assert take_ids(_stream(cfg, again), 6000) == reference
    assert again.stats()["misses"] > 0


# ------------------------------------------------------------------------------ processes and workers
_CHILD = textwrap.dedent("""
    import json, sys, torch.utils.data
    from resumable_stream import ResumableStream, StreamConfig
    data, cache_dir, rank, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=data + "/*.parquet", shuffle=True,
                       buffer_size=100, block_rows=16, cache_dir=cache_dir)
    stream = ResumableStream(cfg, rank=rank, world_size=2, num_workers=2)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    ids = []
    for row in loader:
        ids.append(int(row["id"]))
        if len(ids) == n:
            break
    print(json.dumps({"ids": ids, "stats": stream.source.stats()}))
""")


@pytest.mark.slow
def test_dataloader_workers_and_two_processes_share_one_cache(parquet_60, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cache_dir = str(tmp_path / "shared-cache")
    n = 3500                                    # > one epoch of a rank (3000 rows): shards are read twice
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def run_both():
        procs = [subprocess.Popen([sys.executable, str(script), parquet_60, cache_dir, str(r), str(n)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for r in (0, 1)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, err.decode()[-3000:]
            outs.append(json.loads(out.decode().strip().splitlines()[-1]))
        return outs

    cold = run_both()
    cfg = parquet_config(parquet_60, shuffle=True, buffer_size=100, block_rows=16)
    for rank, got in enumerate(cold):
        # the DataLoader hands out its workers' samples in rotation: the stream's own interleaving
        assert got["ids"] == take_ids(ResumableStream(cfg, rank=rank, world_size=2, num_workers=2,
                                                      source=_source(cfg)), n)
        s = got["stats"]   # counted in the workers, seen by the main process
        assert s["misses"] > 0 and s["blocks_written"] > 0 and s["hits"] > 0
    filled = cold
    for _ in range(3):     # a write that waited too long for the lock is skipped by design (the reader never
        if not any(o["stats"]["writes_skipped"] for o in filled):   # waits): a pass over the gaps fills them
            break
        filled = run_both()
    warm = run_both()
    for rank, got in enumerate(warm):
        assert got["ids"] == cold[rank]["ids"]
        s = got["stats"]
        assert s["misses"] == 0 and s["rows_fetched"] == 0 and s["hits"] > 0, (s, [o["stats"] for o in filled])


# ------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    paths = write_parquet_dataset(str(d), rows=480, files=3, row_group_size=40)
    with FileServer(d) as srv:
        yield srv, [srv.url(os.path.basename(p)) for p in paths]


def test_http_cold_warm_identical_and_warm_reads_make_no_requests(site, tmp_path):
    srv, urls = site
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=list(urls), shuffle=True, buffer_size=64,
                       block_rows=8)
    cached_cfg = cfg.replace(cache_dir=str(tmp_path / "c"))
    kw = dict(rank=0, world_size=2)
    reference = take_ids(ResumableStream(cfg, **kw), 500)
    srv.reset_stats()
    cold = ResumableStream(cached_cfg, **kw)
    assert take_ids(cold, 500) == reference
    cold.source.flush()
    cold_requests = srv.stats()["requests"]
    assert cold_requests > 0
    warm = ResumableStream(cached_cfg, **kw)     # opening the source asks the server for file metadata
    srv.reset_stats()
    assert take_ids(warm, 500) == reference
    assert srv.stats()["requests"] == 0
    s = warm.source.stats()
    assert s["misses"] == 0 and s["hits"] > 0
    # resume with the cache from a state saved without it, in the middle of a window
    off = ResumableStream(cfg, **kw)
    take_ids(off, 123)
    resumed = ResumableStream(cached_cfg, **kw)
    resumed.load_state_dict(through_sidecar(off.state_dict()))
    srv.reset_stats()
    assert take_ids(resumed, 377) == reference[123:]
    assert srv.stats()["requests"] == 0


# ------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_training_logs_cache_stats(tmp_path):
    import yaml

    from resumable_stream.app.train import build_trainer
    from resumable_stream.config.trainer import TrainerConfig
    from resumable_stream.integrations.transformers.callbacks import CacheStatsCallback

    root = REPO_ROOT
    tiny = os.path.join(root, "examples", "tiny")
    with open(os.path.join(tiny, "train_lm.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].pop("consumed_log", None)
    doc["data"].update(data_files=os.path.join(tiny, "data", "*.parquet"), cache_dir=str(tmp_path / "cache"))
    doc["model"]["tokenizer"] = os.path.join(tiny, "tokenizer")
    doc["train"].update(output_dir=str(tmp_path / "out"), max_steps=4, save_steps=100, logging_steps=1,
                        disable_tqdm=True, dataloader_num_workers=1)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(doc))
    trainer = build_trainer(TrainerConfig.from_yaml(str(tmp_path / "cfg.yaml")))
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CacheStatsCallback))
    callback.every_steps = 2
    trainer.train()
    assert [r["step"] for r in callback.records] == [2, 4, 4]
    assert callback.records[-1]["cache_misses_total"] > 0     # counted in the DataLoader worker
    with open(tmp_path / "out" / "train_log.jsonl", encoding="utf-8") as f:
        lines = [json.loads(x) for x in f]
    assert len(lines) == 4 and all("cache_hits_total" in x and "cache_bytes_written_total" in x for x in lines)
    assert lines[-1]["cache_bytes_written_total"] > 0
    # this rank since the start (_total) beside all ranks in the interval (data_): never one name for both
    assert not any(k in x for x in lines for k in ("cache_hits", "cache_misses", "cache_hit_rate"))


@pytest.mark.slow
def test_spawned_dataloader_workers_share_the_counters(parquet_small, tmp_path):
    import torch.utils.data

    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64, cache_dir=str(tmp_path / "c"))
    stream = ResumableStream(cfg, num_workers=2, source=_source(cfg))
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = [int(r["id"]) for r in itertools.islice(loader, 900)]
    assert got == take_ids(ResumableStream(cfg.replace(cache_dir=None), num_workers=2, source=_source(cfg)), 900)
    s = stream.source.stats()
    assert s["misses"] > 0 and s["rows_fetched"] > 0
