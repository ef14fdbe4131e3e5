"""Cache warmup: the plan is exactly what the ranks read; after it, reading makes no request at all."""

from __future__ import annotations

import itertools
import os

import pytest
import yaml
from helpers import parquet_config, shared_source, take_ids
from http_server import FileServer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.app.cli import main
from resumable_stream.app.warmup import plan_warmup, run_warmup
from resumable_stream.cache import CachedSource
from resumable_stream.sources import open_source
from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.testing import synthetic_rows, write_parquet_dataset

pytestmark = pytest.mark.timeout(120)

_source = shared_source


def _keys(cached: CachedSource) -> set[tuple[int, int]]:
    cache = cached.store.diskcache()
    out = set()
    for k in cache.iterkeys():
        ns, shard, block = k.split("/")
        if ns == cached.store.ns:
            out.add((int(shard), int(block)))
    return out


def _save_checkpoint(cfg, directory, world_size, num_workers, samples, source=None) -> str:
    state_dir = os.path.join(directory, "checkpoint-7", "stream_state")
    for rank in range(world_size):
        s = ResumableStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers, source=source)
        take_ids(s, samples + 17 * rank)
        s.save_sidecar(os.path.join(state_dir, f"rank-{rank:05d}.safetensors"))
    write_manifest(state_dir, world_size)
    return os.path.dirname(state_dir)


# ------------------------------------------------------------------------------ exactness (local files)
@pytest.mark.parametrize(("world_size", "rank", "workers", "shuffle", "buffer", "block_rows", "n", "resume"), [
    (1, 0, 0, True, 64, 16, 150, 0),
    (2, 1, 2, True, 100, 32, 333, 0),
    (3, 0, 0, False, 50, 64, 600, 0),
    (2, 0, 2, True, 100, 16, 200, 777),       # from saved cursors, mid-window
    (1, 0, 0, True, 100, 16, 400, 1000),      # exactly at a window boundary: the next window is planned too
])
def test_plan_is_exactly_the_blocks_the_stream_reads(parquet_60, tmp_path, world_size, rank, workers, shuffle,
                                                     buffer, block_rows, n, resume):
    cfg = parquet_config(parquet_60, shuffle=shuffle, buffer_size=buffer, block_rows=16, interleave_shards=2)
    src = _source(cfg)
    kw = dict(rank=rank, world_size=world_size, num_workers=workers)
    ckpt = _save_checkpoint(cfg, str(tmp_path), world_size, workers, resume, src) if resume else None
    plan = plan_warmup(cfg.replace(cache_dir=str(tmp_path / "plan")), n, ranks=[rank], world_size=world_size,
                       num_workers=workers, state_path=ckpt, source=src, block_rows=block_rows)
    assert 0 < len(plan.blocks) < 60 * 100 // block_rows, "only the blocks of the next n samples"
    assert len(set(plan.blocks)) == len(plan.blocks) and plan.missing == plan.blocks

    def stream(cached):
        s = ResumableStream(cfg, source=cached, **kw)
        if ckpt:
            s.load_sidecar(ckpt)
        return s

    # a cold cached read stores exactly the blocks it pulls: the planned ones
    cold = CachedSource(src, cfg.replace(cache_dir=str(tmp_path / "cold")).cache_spec, block_rows=block_rows)
    s = stream(cold)
    ids = take_ids(s, n)
    s.state_dict()                              # what a checkpoint after the n-th sample reads
    cold.flush()                                # blocks are written behind the reader
    assert _keys(cold) == set(plan.blocks)
    assert ids == take_ids(stream(src), n)

    # after fetching the plan, the stream looks up exactly those blocks and finds them all
    result = run_warmup(cfg.replace(cache_dir=str(tmp_path / "warm")), n, ranks=[rank], world_size=world_size,
                        num_workers=workers, state_path=ckpt, source=src, block_rows=block_rows, jobs=3,
                        progress=False)
    assert result.fetched_blocks == len(plan.blocks) and result.already_cached == 0
    warm = CachedSource(src, cfg.replace(cache_dir=str(tmp_path / "warm")).cache_spec, block_rows=block_rows)
    looked_up = []
    get = warm.store.get
    warm.store.get = lambda shard, block, where="": looked_up.append((shard, block)) or get(shard, block, where)
    s = stream(warm)
    assert take_ids(s, n) == ids
    s.state_dict()
    assert set(looked_up) == set(plan.blocks) and warm.stats()["misses"] == 0


# ------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """2400 rows in 4 parquet files x 6 row groups of 100 rows (24 shards), and 8 csv files (read by datasets:
    shards of unknown length; JSON lines are indexed)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    d = tmp_path_factory.mktemp("served")
    parquet = write_parquet_dataset(str(d / "pq"), rows=2400, files=4, row_group_size=100)
    (d / "csv").mkdir()
    csvs = []
    for f in range(8):
        csvs.append(str(d / "csv" / f"part-{f:05d}.csv"))
        pacsv.write_csv(pa.table(synthetic_rows(f * 100, 100)), csvs[-1])
    with FileServer(d) as srv:
        yield srv, [srv.url(p) for p in parquet], [srv.url(p) for p in csvs]


def _http_cfg(urls, builder="parquet", **kw) -> StreamConfig:
    base = dict(shuffle=True, buffer_size=64, interleave_shards=2, block_rows=16)
    return StreamConfig(dataset_name_or_path=builder, data_files=list(urls), **{**base, **kw})


def _yaml(tmp_path, cfg: StreamConfig) -> str:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({"data": {k: v for k, v in cfg.to_dict().items() if v is not None}}))
    return str(p)


def test_cli_warmup_from_checkpoint_then_reading_makes_no_requests(site, tmp_path, capsys):
    srv, urls, _ = site
    cfg = _http_cfg(urls)
    cached_cfg = cfg.replace(cache_dir=str(tmp_path / "cache"))
    src = open_source(cfg.source_spec)
    ckpt = _save_checkpoint(cfg, str(tmp_path), 2, 2, 130, src)
    n = 200
    references = []
    for rank in range(2):
        s = ResumableStream(cfg, rank=rank, world_size=2, num_workers=2, source=src)
        s.load_sidecar(ckpt)
        references.append(take_ids(s, n))

    assert main(["warmup", _yaml(tmp_path, cached_cfg), "--resume-from", ckpt, "--samples", str(n), "--jobs", "4"]) == 0
    err = capsys.readouterr().err
    assert "warmup:" in err and "fetched" in err and "block" in err     # the summary and the progress bar

    total_blocks = len(src.shards)              # one 8192-row block per 100-row shard
    for rank in range(2):
        s = ResumableStream(cached_cfg, rank=rank, world_size=2, num_workers=2)
        s.load_sidecar(ckpt)                    # topology and world size came from the checkpoint
        srv.reset_stats()
        assert take_ids(s, n) == references[rank]
        assert srv.stats()["requests"] == 0, srv.requests[:5]
        assert s.source.stats()["misses"] == 0
    assert len(_keys(s.source)) < total_blocks, "only what the next samples need was fetched"


def test_elastic_warmup_for_another_world_size_then_reading_makes_no_requests(site, tmp_path, capsys):
    """A checkpoint of 2 ranks x 2 workers warmed for 3 ranks (data.elastic): each new rank's partitions
    are gathered from the old ranks' files, and reading them after the warmup asks the server nothing."""
    srv, urls, _ = site
    cfg = _http_cfg(urls, num_partitions=6, elastic=True)
    cached_cfg = cfg.replace(cache_dir=str(tmp_path / "cache"))
    src = open_source(cfg.source_spec)
    ckpt = _save_checkpoint(cfg, str(tmp_path), 2, 2, 130, src)
    n = 150
    references = []
    for rank in range(3):
        s = ResumableStream(cfg, rank=rank, world_size=3, source=src)
        s.load_sidecar(ckpt)
        references.append(take_ids(s, n))
    rigid = _yaml(tmp_path, cached_cfg.replace(elastic=False))
    assert main(["warmup", rigid, "--resume-from", ckpt, "--samples", "10", "--world-size", "3", "--num-workers", "0",
                 "--no-progress"]) == 2
    assert "data.elastic: true" in capsys.readouterr().err
    assert main(["warmup", _yaml(tmp_path, cached_cfg), "--resume-from", ckpt, "--samples", str(n), "--world-size", "3",
                 "--num-workers", "0", "--no-progress"]) == 0
    for rank in range(3):
        s = ResumableStream(cached_cfg, rank=rank, world_size=3)
        s.load_sidecar(ckpt)
        srv.reset_stats()
        assert take_ids(s, n) == references[rank]
        assert srv.stats()["requests"] == 0, srv.requests[:5]


def test_warming_a_warm_cache_is_a_fast_noop(site, tmp_path, capsys):
    srv, urls, _ = site
    cfg = _http_cfg(urls, cache_dir=str(tmp_path / "cache"))
    src = open_source(cfg.source_spec)
    first = run_warmup(cfg, 300, world_size=2, source=src, progress=False)
    assert first.fetched_blocks == first.planned_blocks > 0
    srv.reset_stats()
    again = run_warmup(cfg, 300, world_size=2, source=src, progress=False)
    assert srv.stats()["requests"] == 0
    assert again.fetched_blocks == 0 and again.already_cached == again.planned_blocks == first.planned_blocks
    # the CLI too: nothing fetched; it only opens the dataset (file metadata, parquet footers)
    srv.reset_stats()
    open_source(cfg.source_spec)
    opening = srv.stats()["requests"]
    srv.reset_stats()
    assert main(["warmup", _yaml(tmp_path, cfg), "--samples", "300", "--world-size", "2", "--no-progress"]) == 0
    assert f"{again.planned_blocks} already cached, 0 fetched" in capsys.readouterr().err
    assert srv.stats()["requests"] <= opening


def test_warmup_of_some_ranks_only(site, tmp_path):
    srv, urls, _ = site
    cfg = _http_cfg(urls, cache_dir=str(tmp_path / "cache"))
    assert main(["warmup", _yaml(tmp_path, cfg), "--samples", "100", "--world-size", "3", "--ranks", "2",
                 "--no-progress"]) == 0
    for rank, warmed in ((2, True), (0, False)):
        s = ResumableStream(cfg, rank=rank, world_size=3)
        srv.reset_stats()
        take_ids(s, 100)
        assert (srv.stats()["requests"] == 0) is warmed


def test_warmup_of_unknown_length_shards_reads_them_through_the_cache(site, tmp_path):
    srv, _, csvs = site
    cfg = _http_cfg(csvs, builder="csv", buffer_size=50, cache_dir=str(tmp_path / "cache"))
    src = open_source(cfg.source_spec)
    assert all(s.num_rows is None for s in src.shards)
    reference = take_ids(ResumableStream(cfg.replace(cache_dir=None), rank=1, world_size=2, source=src), 120)
    result = run_warmup(cfg, 120, world_size=2, ranks=[1], source=src, progress=False)
    assert result.read_through_blocks > 0 and result.fetched_blocks == 0
    s = ResumableStream(cfg, rank=1, world_size=2, source=src)
    srv.reset_stats()
    assert take_ids(s, 120) == reference
    assert srv.stats()["requests"] == 0


def test_unknown_length_shards_interleaved_by_a_partition_download_in_parallel(site, tmp_path):
    """While planning, each open unknown-length shard is read by its own thread: with 4 shards
    interleaved and a slow server, requests overlap (read one after another, they never would)."""
    srv, _, csvs = site
    cfg = _http_cfg(csvs, builder="csv", buffer_size=50, interleave_shards=4, cache_dir=str(tmp_path / "c"))
    src = open_source(cfg.source_spec)
    reference = take_ids(ResumableStream(cfg.replace(cache_dir=None), source=src), 150)
    srv.reset_stats()
    srv.latency_s = 0.2
    try:
        result = run_warmup(cfg, 150, source=src, progress=False)
    finally:
        srv.latency_s = 0.0
    assert result.read_through_blocks > 0
    assert srv.stats()["max_in_flight"] >= 2
    srv.reset_stats()
    assert take_ids(ResumableStream(cfg, source=src), 150) == reference
    assert srv.stats()["requests"] == 0


# ------------------------------------------------------------------------------ errors
def test_warmup_errors_are_one_line(parquet_small, tmp_path, capsys):
    no_cache = tmp_path / "a.yaml"
    no_cache.write_text(f"data:\n  dataset_name_or_path: parquet\n  data_files: {parquet_small}/*.parquet\n")
    assert main(["warmup", str(no_cache), "--samples", "10"]) == 2
    assert "data.cache_dir" in capsys.readouterr().err
    with_cache = tmp_path / "b.yaml"
    with_cache.write_text(no_cache.read_text() + f"  cache_dir: {tmp_path / 'c'}\n")
    assert main(["warmup", str(with_cache), "--world-size", "2", "--ranks", "0,2"]) == 2
    assert "ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["warmup", str(with_cache), "--ranks", "x"])
    assert main(["warmup", str(with_cache), "--resume-from", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


def test_plan_with_workers_matches_a_dataloader(parquet_60, tmp_path):
    """With K DataLoader workers the stream interleaves its K partitions sample by sample."""
    import torch.utils.data

    cfg = parquet_config(parquet_60, shuffle=True, buffer_size=100, interleave_shards=2,
                         cache_dir=str(tmp_path / "c"))
    src = _source(cfg)
    run_warmup(cfg, 300, world_size=2, ranks=[0], num_workers=2, source=src, progress=False, block_rows=32)
    cached = CachedSource(src, cfg.cache_spec, block_rows=32)
    stream = ResumableStream(cfg, rank=0, world_size=2, num_workers=2, source=cached)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    got = [int(r["id"]) for r in itertools.islice(loader, 300)]
    assert got == take_ids(ResumableStream(cfg.replace(cache_dir=None), rank=0, world_size=2, num_workers=2,
                                           source=src), 300)
    # workers prefetch a little ahead; what the 300 samples needed was all there
    assert cached.stats()["hits"] > 0
