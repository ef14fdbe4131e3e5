"""WebDataset tars over the loopback HTTP server: the same samples as datasets gives, faults harmless,
warmup fills the block cache so that reading makes no request."""

from __future__ import annotations

import itertools
import os

import pytest
from http_server import FileServer
from wds_data import mixed_samples, write_tars

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.app.warmup import run_warmup
from resumable_stream.sources import open_source, tar_index

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]
FAST = {"retries": 8, "retry_backoff_s": 0.02, "timeout_s": 2.0}
SAMPLES, FILES = 30, 3


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("wds_http")
    paths = write_tars(d, FILES, SAMPLES, mixed_samples)
    srv = FileServer(d).start()
    yield srv, [srv.url(os.path.basename(p)) for p in paths]
    srv.stop()


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    monkeypatch.setattr(tar_index, "SHARD_MAX_SAMPLES", 8)     # 4 shards per tar


def _cfg(urls, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="webdataset", data_files=list(urls), **{**FAST, **kw})


def _take(stream, n: int) -> list[dict]:
    return list(itertools.islice(stream, n))


def test_http_samples_equal_datasets_row_by_row(site):
    import datasets

    srv, urls = site
    srv.clear_faults()
    src = open_source(_cfg(urls).source_spec)
    assert len(src.shards) == FILES * 4
    ours = [r for s in range(len(src.shards)) for t in src.read(s) for r in t.to_pylist()]
    theirs = list(datasets.load_dataset("webdataset", data_files=urls, split="train", streaming=True).decode(False))
    assert len(ours) == len(theirs) == FILES * SAMPLES
    assert all(a.pop("__bad_sample__") is None for a in ours)       # every sample read whole
    assert all(a == {k: b[k] for k in a} for a, b in zip(ours, theirs))


def test_faults_change_nothing_and_resume_is_exact(site):
    srv, urls = site
    srv.clear_faults()
    cfg = _cfg(urls, shuffle=True, buffer_size=16, block_rows=4)
    n = FILES * SAMPLES
    reference = [r["__key__"] for r in _take(ResumableStream(cfg), n)]
    srv.set_faults(rate=0.3, kinds=("503", "truncate", "reset", "500"), seed=3, methods=["GET"])
    try:
        s = ResumableStream(cfg)
        head = [r["__key__"] for r in _take(s, 37)]
        again = ResumableStream(cfg)
        again.load_state_dict(s.state_dict())
        assert head + [r["__key__"] for r in _take(again, n - 37)] == reference
        assert srv.stats()["faults_injected"] > 0
    finally:
        srv.clear_faults()


def test_warmup_then_reading_makes_no_request(site, tmp_path):
    srv, urls = site
    srv.clear_faults()
    cfg = _cfg(urls, shuffle=True, buffer_size=16, cache_dir=str(tmp_path / "cache"))
    reference = [r["__key__"] for r in _take(ResumableStream(_cfg(urls, shuffle=True, buffer_size=16)), 50)]
    run_warmup(cfg, 50, ranks=[0], world_size=1, progress=False)
    stream = ResumableStream(cfg, source=open_source(cfg.source_spec))     # opening indexes the tars again (no saved index)
    before = len(srv.requests)
    assert [r["__key__"] for r in _take(stream, 50)] == reference
    assert srv.requests[before:] == []                         # every sample came from the block cache


@pytest.mark.slow
def test_s3_tars_resume_exactly_as_local_ones(tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    from s3_server import S3Server

    local = write_tars(tmp_path / "d", FILES, SAMPLES, mixed_samples)
    with S3Server(readable=("data",)) as srv:
        for key, value in srv.env().items():
            monkeypatch.setenv(key, value)
        s3 = srv.admin()
        s3.create_bucket(Bucket="data")
        for p in local:
            s3.upload_file(p, "data", f"wds/{os.path.basename(p)}")
        cfg = StreamConfig(dataset_name_or_path="webdataset", data_files="s3://data/wds/*.tar", shuffle=True,
                           buffer_size=16, retry_backoff_s=0.05, timeout_s=10.0,
                           storage_options={"endpoint_url": srv.endpoint})
        reference = [r["__key__"] for r in _take(ResumableStream(_cfg(local, shuffle=True, buffer_size=16)), 90)]
        s = ResumableStream(cfg)
        assert [f["path"] for f in s.source.fingerprint["files"]] == [f"s3://data/wds/{os.path.basename(p)}"
                                                                      for p in local]
        head = [r["__key__"] for r in _take(s, 41)]
        again = ResumableStream(cfg)
        again.load_state_dict(s.state_dict())
        assert head + [r["__key__"] for r in _take(again, 90 - 41)] == reference


@pytest.mark.slow
def test_hub_tars_are_pinned_indexed_and_resume_exactly(tmp_path):
    from hub_server import HubServer, use_hub

    src = tmp_path / "repo"
    local = write_tars(src / "data", FILES, SAMPLES, mixed_samples)
    (src / "README.md").write_text("# org/tars\n")
    with HubServer(tmp_path / "hub-store") as srv:
        srv.create_repo("org/tars")
        commit = srv.commit("org/tars", directory=src, message="initial")
        with use_hub(srv, tmp_path / "hf-home"):
            cfg = StreamConfig(dataset_name_or_path="org/tars", data_files="data/*.tar", shuffle=True,
                               buffer_size=16, prefetch_blocks=0)
            s = ResumableStream(cfg)
            assert s.source.fingerprint["builder"] == "webdataset"
            assert s.source.fingerprint["hub_commits"] == {"org/tars": commit}
            reference = [r["__key__"] for r in _take(ResumableStream(_cfg(local, shuffle=True, buffer_size=16)), 90)]
            head = [r["__key__"] for r in _take(s, 29)]
            again = ResumableStream(cfg)
            again.load_state_dict(s.state_dict())
            assert head + [r["__key__"] for r in _take(again, 90 - 29)] == reference
