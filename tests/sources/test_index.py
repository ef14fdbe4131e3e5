"""The dataset index: parquet read with pyarrow from it (no ``reshard``), resolved once per job, saved with
every checkpoint, reused on a restart without network, and bound to each file's content identity.

Everything runs over real ``datasets`` resolution, the loopback HTTP server (its request log is the
counter) and real torchrun (gloo) for the sharing between ranks.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from http_server import FileServer
from repo_paths import REPO_ROOT
from training_helpers import free_port

from resumable_stream import ResumableStream, SidecarError, SourceError, StreamConfig, StreamMismatchError
from resumable_stream.app.cli import main as cli_main
from resumable_stream.sources import open_source
from resumable_stream.sources.index import load_index
from resumable_stream.testing import write_parquet_dataset

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]

FILES, ROWS, GROUP = 6, 1200, 50          # 6 files x 4 row groups of 50 rows
FAST = {"retries": 3, "retry_backoff_s": 0.02, "timeout_s": 2.0}


def _ids(stream, n: int) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


def _count(srv: FileServer) -> collections.Counter:
    return collections.Counter((r.method, "ranged" if r.range else "whole") for r in srv.requests)


@pytest.fixture
def site(tmp_path):
    data = tmp_path / "data"
    paths = write_parquet_dataset(str(data), rows=ROWS, files=FILES, row_group_size=GROUP)
    with FileServer(data) as srv:
        srv.paths = paths
        srv.config = lambda **kw: StreamConfig(
            dataset_name_or_path="parquet", data_files=[srv.url(os.path.basename(p)) for p in paths],
            **{"shuffle": True, "buffer_size": 64, **FAST, **kw})
        yield srv


# ---------------------------------------------------------------------------- parquet without reshard
def test_rows_are_those_of_datasets_streaming_without_reshard(tmp_path, monkeypatch):
    """A dataset written by ``datasets`` (ClassLabel, nested sequences): every row group read with pyarrow
    from the index equals what ``datasets`` streams, in file / row-group order, cast to the same features;
    ``IterableDataset.reshard`` (datasets >= 4.6 only) is never called."""
    feats = datasets.Features({"id": datasets.Value("int64"), "seq": datasets.Sequence(datasets.Value("int32")),
                               "label": datasets.ClassLabel(names=["a", "b", "c"])})
    files = []
    for i in range(2):
        ds = datasets.Dataset.from_dict({"id": list(range(i * 300, (i + 1) * 300)),
                                         "seq": [[j, j + 1] for j in range(300)], "label": [j % 3 for j in range(300)]},
                                        features=feats)
        files.append(str(tmp_path / f"p{i}.parquet"))
        ds.to_parquet(files[-1], batch_size=70)
    hf_rows = list(datasets.load_dataset("parquet", data_files=files, split="train", streaming=True))

    def no_reshard(*a, **k):
        raise AssertionError("reshard called")

    monkeypatch.setattr(datasets.IterableDataset, "reshard", no_reshard, raising=False)
    src = open_source(StreamConfig(dataset_name_or_path="parquet", data_files=files).source_spec)
    assert [s.num_rows for s in src.shards] == [70, 70, 70, 70, 20] * 2     # one shard per row group
    ours = [row for s in range(len(src.shards)) for t in src.read(s) for row in t.to_pylist()]
    assert ours == hf_rows
    assert src.column_names == ["id", "seq", "label"]
    # reading from a row: the rows after it, nothing else
    assert [r["id"] for t in src.read(1, 65) for r in t.to_pylist()] == list(range(135, 140))


def test_steady_state_reads_one_request_per_row_group(site):
    """Opening costs one request per file (its identity and footer: a GET of its last bytes, whose
    Content-Range names the size); reading, one ranged GET per row group (the footers read to build the index
    are kept); a source opened from a given index reads each footer once."""
    cfg = site.config(shuffle=False)
    src = open_source(cfg.source_spec)
    assert _count(site) == {("GET", "ranged"): FILES}
    site.reset_stats()
    assert sorted(_ids(ResumableStream(cfg, source=src), ROWS)) == list(range(ROWS))
    assert _count(site) == {("GET", "ranged"): len(src.shards)}
    site.reset_stats()
    given = open_source(cfg.source_spec, index=src.index)
    assert sorted(_ids(ResumableStream(cfg, source=given), ROWS)) == list(range(ROWS))
    assert _count(site) == {("GET", "ranged"): len(src.shards) + FILES}


# ---------------------------------------------------------------------------- index file / CLI
def test_index_command_then_index_path_opens_without_requests(site, tmp_path, capsys):
    cfg = site.config()
    (tmp_path / "data.yaml").write_text(json.dumps({"data": {"dataset_name_or_path": "parquet",
                                                             "data_files": cfg.data_files}}))
    out = tmp_path / "idx" / "index.json"
    assert cli_main(["index", str(tmp_path / "data.yaml"), "-o", str(out), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] == FILES and summary["row_groups"] == FILES * ROWS // FILES // GROUP
    assert summary["rows"] == ROWS and summary["columns"] == ["id", "text", "label"]
    assert len(site.requests) == FILES          # each file's identity and footer: one GET of its last bytes
    reference = _ids(ResumableStream(cfg.replace(prefetch_blocks=0)), 300)    # no fetch left in flight

    site.reset_stats()
    trusting = ResumableStream(cfg.replace(index_path=str(out), verify_files=False, prefetch_blocks=0))
    assert len(site.requests) == 0                       # nothing resolved, no footer re-read
    assert _ids(trusting, 300) == reference
    site.reset_stats()
    ResumableStream(cfg.replace(index_path=str(out)))
    assert _count(site) == {("HEAD", "whole"): FILES}    # verify_files: one identity request per file


def test_an_indexed_source_hands_on_every_footer_it_read_and_a_source_given_them_reads_none(site):
    """What rank 0 broadcasts with the index (job_source): the footers it read, so the other ranks read none."""
    cfg = site.config(prefetch_blocks=0)
    src = open_source(cfg.source_spec)
    assert sorted(src.footers) == sorted(cfg.data_files)
    assert all(f.endswith(b"PAR1") for f in src.footers.values())
    site.reset_stats()
    other = open_source(cfg.source_spec, index=src.index, footers=src.footers)
    rows = [next(other.read(s)).num_rows for s in range(len(other.shards))]
    assert rows == [GROUP] * (ROWS // GROUP)
    assert _count(site) == {("GET", "ranged"): ROWS // GROUP}          # one per row group, no footer read
    sizes = {os.path.basename(p): os.path.getsize(p) for p in site.paths}
    assert not [r for r in site.requests if r.range.endswith(f"-{sizes[os.path.basename(r.path)] - 1}")]


def test_index_path_is_written_once_then_reused(site, tmp_path):
    path = tmp_path / "index.json"
    cfg = site.config(index_path=str(path), verify_files=False)
    ResumableStream(cfg)
    assert path.is_file() and len(load_index(str(path))["files"]) == FILES
    site.reset_stats()
    ResumableStream(cfg)
    assert len(site.requests) == 0


def test_index_for_other_settings_or_changed_data_is_an_error_naming_it(site, tmp_path):
    path = tmp_path / "index.json"
    cfg = site.config(index_path=str(path))
    ResumableStream(cfg)
    other = cfg.replace(data_files=cfg.data_files[:-1])
    with pytest.raises(StreamMismatchError, match=r"data\.data_files: index"):
        ResumableStream(other)
    # a file rewritten since the index was built (new size, new ETag): named, never used silently
    victim = site.paths[2]
    pq.write_table(pq.read_table(victim).slice(0, 10), victim)
    with pytest.raises(StreamMismatchError) as info:
        ResumableStream(cfg)
    assert cfg.data_files[2] in str(info.value) and "resumable-stream index" in str(info.value)
    for broken in (b"{", b'{"format": "resumable-stream-index", "version": 1}', b"[]"):
        path.write_bytes(broken)
        with pytest.raises(SourceError, match="dataset index") as info:
            ResumableStream(cfg)
        assert str(path) in str(info.value)


# ---------------------------------------------------------------------------- checkpoint: saved, reused
def test_warm_restart_from_checkpoint_makes_no_request(site, tmp_path):
    """A checkpoint saves the index (listed in the manifest); resuming with a warm block cache reaches its
    first samples with zero requests when verify_files is off, one HEAD per file when on."""
    cfg = site.config(cache_dir=str(tmp_path / "cache"))
    filler = ResumableStream(cfg)
    reference = _ids(filler, ROWS)                       # also fills the cache with every block
    filler.source.flush()
    first = ResumableStream(cfg)
    assert _ids(first, 200) == reference[:200]
    state = tmp_path / "ckpt" / "stream_state"
    first.save_sidecar(str(state))
    first.source.flush()
    manifest = json.loads((state / "manifest.json").read_text())
    assert manifest["index"]["file"] == "index.bin" and (state / "index.bin").is_file()

    site.reset_stats()
    resumed = ResumableStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt"), verify_files=False))
    assert _ids(resumed, 300) == reference[200:500]
    assert len(site.requests) == 0
    site.reset_stats()
    resumed = ResumableStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt")))
    assert _ids(resumed, 300) == reference[200:500]
    assert _count(site) == {("HEAD", "whole"): FILES}

    # an index that no longer matches the manifest is refused
    (state / "index.bin").write_bytes((state / "index.bin").read_bytes().replace(b'"row_groups', b'"row_grouqs'))
    with pytest.raises(SidecarError, match="index.bin"):
        ResumableStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt")))


# ---------------------------------------------------------------------------- content identity
def _rewrite_same_size_same_mtime(path: str) -> None:
    """New values, same byte size and modification time (no dictionary, no compression: fixed widths)."""
    st = os.stat(path)
    table = pq.read_table(path)
    rows = pq.ParquetFile(path).metadata.row_group(0).num_rows
    new = table.set_column(0, "id", pa.array([i + 100_000 for i in table.column("id").to_pylist()], pa.int64()))
    pq.write_table(new, path, row_group_size=rows, use_dictionary=False, compression="none", write_statistics=True)
    assert os.path.getsize(path) == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def plain_files(tmp_path):
    """Local parquet files that can be rewritten at the same size."""
    out = []
    for i in range(4):
        ids = list(range(i * 200, (i + 1) * 200))
        out.append(str(tmp_path / f"part-{i}.parquet"))
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}), out[-1], row_group_size=50,
                       use_dictionary=False, compression="none")
    return out


def test_same_size_same_mtime_rewrite_of_a_later_file_is_detected_on_resume(plain_files, tmp_path):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=plain_files, shuffle=True, buffer_size=32,
                       interleave_shards=1)
    first = ResumableStream(cfg)
    taken = _ids(first, 10)
    first.save_sidecar(str(tmp_path / "state"))
    holder = {plain_files[i // 200] for i in taken}
    victim = next(f for f in plain_files if f not in holder)      # does not hold the first resumed sample
    _rewrite_same_size_same_mtime(victim)
    for verify in (True, False):    # checked at open (local footer read) or when its footer is read
        with pytest.raises(StreamMismatchError) as info:
            resumed = ResumableStream(cfg.replace(resume_state_path=str(tmp_path / "state"), verify_files=verify))
            _ids(resumed, 800)
        assert victim in str(info.value) and "footer" in str(info.value)


def test_rewritten_file_is_never_served_stale_from_the_cache(plain_files, tmp_path):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=plain_files, cache_dir=str(tmp_path / "c"))
    warm = ResumableStream(cfg)
    assert sorted(_ids(warm, 800)) == list(range(800))
    warm.source.flush()
    _rewrite_same_size_same_mtime(plain_files[1])
    fresh = sorted(_ids(ResumableStream(cfg), 800))
    assert fresh == sorted(_ids(ResumableStream(cfg.replace(cache_dir=None)), 800))
    assert fresh == list(range(200)) + list(range(400, 800)) + list(range(100_200, 100_400))


# ---------------------------------------------------------------------------- one resolution per job
_RANK_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from resumable_stream import ResumableStream, StreamConfig
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    urls = [line.strip() for line in open(sys.argv[1])]
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=urls, retries=2, retry_backoff_s=0.05)
    stream = ResumableStream(cfg, rank=rank, world_size=world)
    dist.barrier()
    with open(os.path.join(sys.argv[2], f"rank{rank}.txt"), "w") as f:
        f.write(f"{len(stream.source.shards)} {stream.source.fingerprint['num_shards']}")
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_four_ranks_open_48_remote_files_with_two_requests_per_file(tmp_path):
    files = 48
    write_parquet_dataset(str(tmp_path / "d"), rows=files * 40, files=files, row_group_size=20)
    with FileServer(tmp_path / "d") as srv:
        (tmp_path / "urls.txt").write_text("\n".join(srv.url(f"part-{i:05d}.parquet") for i in range(files)))
        (tmp_path / "rank.py").write_text(_RANK_SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(tmp_path / "rank.py"), str(tmp_path / "urls.txt"),
                               str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(4)] == [f"{files * 2} {files * 2}"] * 4
        assert len(srv.requests) <= 2 * files + 20, _count(srv)


# ---------------------------------------------------------------------------- plan-driven prefetch
def _first_two_gets_meet():
    """A server fault under which the first two GETs wait for each other: the barrier is broken (after its
    timeout) unless two GETs were in flight together."""
    import threading

    together, gets = threading.Barrier(2, timeout=3), itertools.count()

    def meet(rec):
        if rec.method == "GET" and next(gets) < 2:
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait()

    return together, meet


@pytest.mark.slow
def test_prefetch_fetches_concurrently_and_hands_over_in_plan_order(site):
    """Row groups of the plan are fetched ahead on threads: the first two GETs of a stream are in flight
    together (each waits at a barrier for the other), responses arrive in random order (random latency per
    request), and the rows are exactly those read without prefetch."""
    import random

    cfg = site.config(interleave_shards=2, timeout_s=30.0)     # no client timeout while a GET waits
    src = open_source(cfg.replace(prefetch_blocks=0).source_spec)
    reference = _ids(ResumableStream(cfg.replace(prefetch_blocks=0), source=src), ROWS + 100)
    jitter = random.Random(5)
    site.faults.append(lambda rec: time.sleep(jitter.random() * 0.02))
    try:
        for depth, concurrent in ((0, False), (8, True)):
            src = open_source(cfg.replace(prefetch_blocks=depth).source_spec)      # the index: read before the barrier
            together, meet = _first_two_gets_meet()
            site.faults.insert(0, meet)
            stream = ResumableStream(cfg.replace(prefetch_blocks=depth), source=src)
            assert _ids(stream, ROWS + 100) == reference
            assert together.broken is not concurrent
            site.faults.remove(meet)
    finally:
        site.faults.clear()


@pytest.mark.slow
def test_prefetch_fills_the_block_cache_and_skips_what_it_holds(site, tmp_path, caplog):
    """With ``cache_dir`` set, a cold read still fetches ahead (the first two GETs are in flight together)
    and the cache fills from those fetches: a second stream over the same cache makes no request at all and
    both give the rows of a cache-off read without prefetch."""

    cfg = site.config(interleave_shards=2, timeout_s=30.0)
    reference = _ids(ResumableStream(cfg.replace(prefetch_blocks=0)), ROWS + 100)
    for depth, concurrent in ((0, False), (8, True)):
        cached = cfg.replace(prefetch_blocks=depth, cache_dir=str(tmp_path / f"cache{depth}"))
        src = open_source(cached.source_spec)                       # the index: read before the barrier
        together, meet = _first_two_gets_meet()
        site.faults.append(meet)
        try:
            with caplog.at_level("WARNING", logger="resumable_stream.cache"):
                cold = ResumableStream(cached, source=src)
                assert _ids(cold, ROWS + 100) == reference
        finally:
            site.faults.remove(meet)
        assert not [r for r in caplog.records if "lookup" in r.getMessage()]   # (a cache.db being created)
        assert together.broken is not concurrent
        cold.source.flush()
        warm = ResumableStream(cached, source=open_source(cached.source_spec))
        site.reset_stats()
        assert _ids(warm, ROWS + 100) == reference
        assert site.requests == [], _count(site)        # every row group came from the cache, none prefetched
        assert warm.source.stats()["hits"] > 0


def test_prefetch_threads_end_with_the_stream(site):
    import gc
    import threading

    before = set(threading.enumerate())       # (other tests' streams may still be alive)
    stream = ResumableStream(site.config(prefetch_blocks=4))
    _ids(stream, 100)
    threads = [t for t in threading.enumerate() if t.name.startswith("rs-prefetch") and t not in before]
    assert threads
    del stream
    for _ in range(60):        # a fetch still in flight holds the source until it ends: collect again after
        gc.collect()
        for t in threads:
            t.join(timeout=0.5)
        if not any(t.is_alive() for t in threads):
            break
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("key,bad", [("prefetch_blocks", -1), ("prefetch_blocks", 257), ("verify_files", "yes"),
                                     ("index_path", "")])
def test_new_keys_are_validated(key, bad):
    from resumable_stream import ConfigError

    with pytest.raises(ConfigError, match=rf"data\.{key}: got"):
        StreamConfig(dataset_name_or_path="parquet", data_files=["x.parquet"], **{key: bad})


def test_index_command_refuses_data_it_cannot_index(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from resumable_stream.testing import synthetic_rows

    files = [str(tmp_path / "a.csv")]
    pacsv.write_csv(pa.table(synthetic_rows(0, 20)), files[0])
    (tmp_path / "data.yaml").write_text(json.dumps({"dataset_name_or_path": "csv", "data_files": files}))
    assert cli_main(["index", str(tmp_path / "data.yaml"), "-o", str(tmp_path / "i.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "which has no dataset index" in err and "(jsonl, parquet, webdataset; docs/formats.md)" in err and "'csv'" in err
    assert not (tmp_path / "i.json").exists()


# ---------------------------------------------------------------------------- trainer restarts
@pytest.mark.slow
def test_trainer_restart_reuses_the_index_saved_with_its_checkpoint(tmp_path):
    """``resumable-stream train`` opens its stream knowing the checkpoint it will resume: a restart reuses
    that checkpoint's index (no resolving: zero requests with verify_files off, one HEAD per file on) and
    the resumed run ends where an uninterrupted one does."""
    import yaml

    from resumable_stream.app.train import build_trainer, resolve_resume
    from resumable_stream.config.trainer import TrainerConfig

    tiny = os.path.join(REPO_ROOT, "examples", "tiny")
    data = os.path.join(tiny, "data")
    files = sorted(f for f in os.listdir(data) if f.endswith(".parquet"))
    with FileServer(data) as srv:
        def config(name, max_steps, **data_keys):
            with open(os.path.join(tiny, "train_lm.yaml"), encoding="utf-8") as f:
                doc = yaml.safe_load(f)
            doc["data"].pop("consumed_log")
            doc["data"].update(data_files=[srv.url(f) for f in files], **FAST, **data_keys)
            doc["model"]["tokenizer"] = os.path.join(tiny, "tokenizer")
            doc["train"].update(output_dir=str(tmp_path / name), max_steps=max_steps, save_steps=2, logging_steps=1,
                                disable_tqdm=True)
            p = tmp_path / f"{name}-{max_steps}.yaml"
            p.write_text(yaml.safe_dump(doc))
            return TrainerConfig.from_yaml(str(p))

        def final_loss(trainer):
            return [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]

        whole = build_trainer(config("whole", 4))
        whole.train()
        first = build_trainer(config("cut", 2, verify_files=False))
        first.train()
        srv.reset_stats()
        restarted = build_trainer(config("cut", 4, verify_files=False))
        assert srv.requests == []                     # the stream opened from checkpoint-2's index
        restarted.train(resume_from_checkpoint=resolve_resume(config("cut", 4), restarted))
        assert final_loss(restarted) == final_loss(whole)
        srv.reset_stats()
        build_trainer(config("cut", 4))               # verify_files (default): one identity request per file
        assert _count(srv) == {("HEAD", "whole"): len(files)}
