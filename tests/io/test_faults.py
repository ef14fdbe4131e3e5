"""Network faults are harmless: real ``datasets`` streaming over a loopback server that misbehaves.

The server (``tests/http_server.FileServer``) resets connections, answers 500 / 503, cuts bodies
short and stalls responses, chosen per request from a seeded RNG. With retries on, the stream
yields exactly the rows of a fault-free run (resolution and reads, across a save / resume);
stalled responses time out after ``data.timeout_s``; a lasting outage ends in a ``SourceError``
naming the URL, and the last saved state resumes exactly once the server is back. Local files
are never retried.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import os
import re
import socket
import threading
import time

import pyarrow as pa
import pytest
from http_server import FAULT_KINDS, FileServer

from resumable_stream import ResumableStream, SourceError, StreamConfig
from resumable_stream.sources import READ_BATCH_ROWS, open_source
from resumable_stream.sources.parquet import ParquetSource
from resumable_stream.testing import write_jsonl_dataset, write_parquet_dataset

PARQUET_ROWS, PARQUET_FILES, ROW_GROUP = 480, 3, 40      # 12 row groups -> 12 shards
JSONL_ROWS, JSONL_FILES = 400, 4
ROWS = {"parquet": PARQUET_ROWS, "jsonl": JSONL_ROWS}
BUILDER = {"parquet": "parquet", "jsonl": "json"}
BUFFER = 64
AFTER = 64
# Quick retries for tests: the defaults (5 retries, 1 s doubling) are for real networks.
FAST = {"retries": 8, "retry_backoff_s": 0.02, "timeout_s": 1.0}

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("hub_offline")]


# ---------------------------------------------------------------------------- fixtures
# hub_offline (the Hub made unreachable) comes from conftest.py
class Site:
    def __init__(self, srv: FileServer, paths: list[str], fmt: str):
        self.srv, self.paths, self.fmt = srv, paths, fmt
        self.urls = [srv.url(os.path.basename(p)) for p in paths]
        self.reference: list[int] | None = None

    def config(self, **kw) -> StreamConfig:
        kw = {"shuffle": True, "buffer_size": BUFFER, **FAST, **kw}
        return StreamConfig(dataset_name_or_path=BUILDER[self.fmt], data_files=list(self.urls), **kw)

    def healthy(self) -> None:
        self.srv.clear_faults()
        self.srv.latency_s, self.srv.bandwidth_bps = 0.0, None


def _write(fmt: str, directory: str) -> list[str]:
    if fmt == "parquet":
        return write_parquet_dataset(directory, rows=PARQUET_ROWS, files=PARQUET_FILES, row_group_size=ROW_GROUP)
    return write_jsonl_dataset(directory, rows=JSONL_ROWS, files=JSONL_FILES)


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    out, servers = {}, []
    for fmt in ("parquet", "jsonl"):
        d = tmp_path_factory.mktemp(f"faults_{fmt}")
        srv = FileServer(d).start()
        servers.append(srv)
        out[fmt] = Site(srv, _write(fmt, str(d)), fmt)
    yield out
    for srv in servers:
        srv.stop()


@pytest.fixture(params=["parquet", "jsonl"])
def site(request, sites):
    s = sites[request.param]
    s.healthy()
    yield s
    s.healthy()


def _take(stream, n: int) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


def _reference(site: Site) -> list[int]:
    """The fault-free stream: one epoch plus AFTER rows of the next."""
    if site.reference is None:
        site.healthy()
        site.reference = _take(ResumableStream(site.config(), rank=0, world_size=1), ROWS[site.fmt] + AFTER)
    return site.reference


# ---------------------------------------------------------------------------- the server's faults
def _request(port: int, method: str = "GET", path: str = "/f.bin", range_: str | None = None,
             timeout: float = 5.0):
    """One request on a fresh connection: (status, body) or the exception it ended with."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, headers={"Range": range_} if range_ else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except Exception as e:
        return e
    finally:
        conn.close()


@pytest.fixture
def blob_server(tmp_path):
    data = bytes(range(256)) * 1024                      # 256 KiB
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "g.txt").write_bytes(b"hello")
    srv = FileServer(tmp_path).start()
    yield srv, data
    srv.stop()


def test_server_fault_kinds(blob_server):
    srv, data = blob_server
    srv.stall_s = 3.0
    for kind in FAULT_KINDS:
        srv.faults[:] = [lambda rec, kind=kind: kind]
        got = _request(srv.port, timeout=0.5 if kind == "stall" else 5.0)
        if kind in ("500", "503"):
            assert isinstance(got, tuple) and got[0] == int(kind), kind
        elif kind == "reset":
            assert isinstance(got, (ConnectionError, http.client.HTTPException)), (kind, got)
        elif kind in ("reset_body", "truncate"):
            assert isinstance(got, (http.client.IncompleteRead, ConnectionError)), (kind, got)
        else:  # stall: headers, then nothing until the client gives up (0.5 s; the stall lasts 3 s)
            assert isinstance(got, (TimeoutError, socket.timeout)), (kind, got)
        head = _request(srv.port, "HEAD", timeout=0.5)
        if kind in ("500", "503"):
            assert head[0] == int(kind)
        else:                                           # no HEAD answer at all
            assert isinstance(head, (ConnectionError, http.client.HTTPException, TimeoutError)), (kind, head)
    srv.faults.clear()
    assert _request(srv.port) == (200, data)
    assert _request(srv.port, range_="bytes=10-19") == (206, data[10:20])
    st = srv.stats()
    # in a HEAD answer there is no body to cut short: reset_body and truncate reset instead
    assert st["faults"] == {"reset": 4, "reset_body": 1, "truncate": 1, "500": 2, "503": 2, "stall": 2}
    assert st["faults_injected"] == 2 * len(FAULT_KINDS)
    by_kind = {r.fault: r for r in srv.requests if r.method == "GET" and r.fault}
    assert 0 < by_kind["truncate"].bytes_sent < len(data) and by_kind["stall"].bytes_sent == 0


def test_server_faults_are_seeded_rate_and_filters(blob_server):
    srv, _ = blob_server

    def run(n: int = 60, **kw) -> list[str | None]:
        srv.reset_stats()
        srv.set_faults(**kw)
        for i in range(n):
            _request(srv.port, "HEAD" if i % 3 == 0 else "GET", "/g.txt" if i % 2 else "/f.bin")
        return [r.fault for r in srv.requests]

    kinds = ("reset", "500", "503", "truncate")
    a = run(rate=0.3, kinds=kinds, seed=7)
    st = srv.stats()
    assert st["faults_injected"] == sum(f is not None for f in a) == sum(st["faults"].values())
    assert 8 <= st["faults_injected"] <= 30
    assert {f for f in a if f} <= set(kinds)
    assert a == run(rate=0.3, kinds=kinds, seed=7)                # same seed, same faults
    assert a != run(rate=0.3, kinds=kinds, seed=8)
    # only some methods / paths, only the first N eligible requests
    only_head = run(rate=1.0, kinds=("503",), methods=("HEAD",))
    assert all((f is not None) == (r.method == "HEAD") for f, r in zip(only_head, srv.requests))
    only_txt = run(rate=1.0, kinds=("500",), paths=("*.txt",))
    assert all((f is not None) == r.path.endswith(".txt") for f, r in zip(only_txt, srv.requests))
    first = run(rate=1.0, kinds=("reset",), first=5)
    assert first == ["reset"] * 5 + [None] * 55
    srv.clear_faults()
    assert run(0, rate=0.0) == [] and _request(srv.port)[0] == 200


def test_server_latency_and_bandwidth_switch_at_runtime(blob_server, monkeypatch):
    """The waits the server asks for, on a clock that only its waits move: the latency once per request,
    the throttle pacing the body at bandwidth_bps; nothing once both are off."""
    import http_server

    srv, data = blob_server
    clock, waits = [0.0], []

    def wait(seconds):
        waits.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(srv, "_sleep", wait)
    monkeypatch.setattr(http_server, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    srv.latency_s = 0.3
    assert _request(srv.port, "HEAD")[0] == 200
    assert waits == [0.3]
    srv.latency_s, waits[:] = 0.0, []
    srv.bandwidth_bps = 400_000                           # 256 KiB at 400 kB/s: 0.655 s, in 20 kB chunks
    assert _request(srv.port) == (200, data)
    deadline = time.monotonic() + 10                     # the handler waits once more after its last chunk
    while srv.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(waits) == pytest.approx(len(data) / 400_000) and len(waits) == -(-len(data) // 20_000)
    srv.bandwidth_bps, waits[:] = None, []
    assert _request(srv.port) == (200, data)
    assert waits == []


def test_server_stop_is_bounded_with_stalled_and_idle_connections(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * 100_000)
    srv = FileServer(tmp_path).start()
    port = srv.port
    srv.set_faults(rate=1.0, kinds=("stall",), stall_s=60, methods=("GET",))
    stalled = threading.Thread(target=_request, args=(port,), kwargs={"timeout": 30}, daemon=True)
    stalled.start()
    deadline = time.monotonic() + 10          # the stall must be in place before faults are cleared
    while srv.stats()["faults"].get("stall", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    idle.request("HEAD", "/f.bin")
    assert idle.getresponse().status == 200              # a keep-alive connection left open
    srv.bandwidth_bps = 1000                             # and a throttled download in flight
    srv.clear_faults()
    slow = threading.Thread(target=_request, args=(port,), kwargs={"timeout": 30}, daemon=True)
    slow.start()
    time.sleep(0.3)
    assert srv.stats()["faults"]["stall"] == 1
    srv.stop()       # wakes the stalled and the throttled handler: none is left (they would sleep on)
    assert not [t for t in threading.enumerate() if t.name.startswith(f"FileServer:{port}")]
    stalled.join(5)
    slow.join(5)
    assert not stalled.is_alive() and not slow.is_alive()
    idle.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---------------------------------------------------------------------------- faults under a stream
@pytest.mark.slow
def test_every_fault_kind_same_sequence_and_resume(site, tmp_path):
    """~20% of all requests faulted, every kind, from opening the dataset on: the rows are exactly
    those of a fault-free run, and so are they after a save / resume made under faults."""
    ref = _reference(site)
    srv = site.srv
    srv.reset_stats()
    srv.set_faults(rate=0.2, kinds=FAULT_KINDS, seed=11, stall_s=3)
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    assert _take(stream, ROWS[site.fmt] + AFTER) == ref
    k = 150
    first = ResumableStream(site.config(), rank=0, world_size=1)
    assert _take(first, k) == ref[:k]
    first.save_sidecar(tmp_path)
    resumed = ResumableStream(site.config(resume_state_path=str(tmp_path)), rank=0, world_size=1)
    assert _take(resumed, ROWS[site.fmt] + AFTER - k) == ref[k:]
    st = srv.stats()
    assert st["faults_injected"] >= 10 and len(st["faults"]) >= 4, st["faults"]


def test_dataloader_workers_under_faults(sites):
    """Forked DataLoader workers read through the same retry layers (HTTP middleware, shard reopen)."""
    import torch.utils.data

    site = sites["parquet"]
    site.healthy()
    try:
        def run() -> list[int]:
            stream = ResumableStream(site.config(), rank=0, world_size=1, num_workers=2)
            loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, timeout=60)
            return [int(row["id"]) for row in itertools.islice(loader, PARQUET_ROWS)]

        clean = run()
        site.srv.reset_stats()
        site.srv.set_faults(rate=0.2, kinds=("reset", "reset_body", "500", "503", "truncate"), seed=4)
        assert run() == clean
        assert sorted(clean) == list(range(PARQUET_ROWS))
        assert site.srv.stats()["faults_injected"] > 0
    finally:
        site.healthy()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_resolution_survives_faults_on_every_request_type(sites, fmt):
    """The issue: with 20% of requests failing, resolving the data files gave up at once with a
    FileNotFoundError. Here the first requests of all (HEAD and GET) fail in turn."""
    site = sites[fmt]
    site.healthy()
    try:
        ref = _reference(site)
        site.srv.set_faults(rate=1.0, kinds=("reset", "503", "500", "truncate"), seed=3, first=12)
        src = open_source(site.config().source_spec)
        assert site.srv.stats()["faults_injected"] >= 12
        stream = ResumableStream(site.config(), rank=0, world_size=1, source=src)
        assert _take(stream, 100) == ref[:100]
    finally:
        site.healthy()


@pytest.mark.slow
def test_stalled_responses_time_out_and_are_retried(sites):
    site = sites["parquet"]
    site.healthy()
    try:
        ref = _reference(site)
        src = open_source(site.config(prefetch_blocks=0).source_spec)     # one read at a time: the two stalls in a row
        # A stalled body (headers sent, then nothing for 30 s) must not hang the reader.
        site.srv.reset_stats()
        site.srv.set_faults(rate=1.0, kinds=("stall",), methods=("GET",), first=2, stall_s=30)
        assert _take(ResumableStream(site.config(), source=src), 100) == ref[:100]
        stats = site.srv.stats()
        # both stalled responses are still stalling: the reader gave up on them (timeout_s = 1), not waited
        assert stats["faults"]["stall"] == 2 and stats["in_flight"] == 2, stats
        # Without retries, the first stalled read is an error (a timeout, long before the stall ends).
        src = open_source(site.config(retries=0).source_spec)
        site.srv.set_faults(rate=1.0, kinds=("stall",), stall_s=30)
        with pytest.raises(SourceError, match="Timeout"):
            _take(ResumableStream(site.config(retries=0), source=src), 10)
    finally:
        site.healthy()


def test_outage_after_start_raises_source_error_then_resumes(site, tmp_path, caplog):
    ref = _reference(site)
    cfg = site.config(retries=3)
    stream = ResumableStream(cfg, rank=0, world_size=1)
    k = 90
    assert _take(stream, k) == ref[:k]
    stream.save_sidecar(tmp_path)
    site.srv.set_faults(rate=1.0, kinds=("reset", "503", "truncate"), seed=5)
    caplog.set_level(logging.WARNING, logger="resumable_stream.sources")
    with pytest.raises(SourceError) as info:
        _take(stream, ROWS[site.fmt])
    msg = str(info.value)
    assert any(url in msg for url in site.urls), msg
    assert "failed after 4 attempt(s)" in msg and "last error" in msg, msg
    retries = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
               and "retry" in r.getMessage()]
    assert any(url in m and "retry 1 of 3" in m for m in retries for url in site.urls), retries[:5]
    assert any("retry 3 of 3" in m for m in retries)
    site.healthy()
    resumed = ResumableStream(cfg.replace(resume_state_path=str(tmp_path)), rank=0, world_size=1)
    assert _take(resumed, ROWS[site.fmt] + AFTER - k) == ref[k:]


def test_outage_while_opening_names_the_url(sites, caplog):
    site = sites["parquet"]
    site.healthy()
    try:
        site.srv.set_faults(rate=1.0, kinds=("503", "reset"))
        with caplog.at_level(logging.WARNING, logger="resumable_stream.sources"):
            with pytest.raises(SourceError) as info:
                open_source(site.config(retries=2).source_spec)
        assert any(url in str(info.value) for url in site.urls) and "failed after 3 attempt(s)" in str(info.value)
        # the waits between tries are the configured backoff (0.02 s, doubled), not datasets' own 5-60 s
        waits = [float(m) for r in caplog.records for m in re.findall(r"retry \d+ of \d+ in ([\d.]+) s",
                                                                       r.getMessage())]
        assert waits and max(waits) <= FAST["retry_backoff_s"] * 2 ** 2, waits
    finally:
        site.healthy()


def test_mid_shard_fault_reopens_at_the_next_row_not_yet_yielded(tmp_path, monkeypatch):
    """A shard that yields several tables fails after the first: the reader reopens it at the first
    row not yet yielded (not at the shard start, not skipping any)."""
    write_parquet_dataset(str(tmp_path), rows=20_000, files=1, row_group_size=20_000)
    with FileServer(tmp_path) as srv:
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url("part-00000.parquet")], **FAST)
        src = open_source(cfg.source_spec)
        assert isinstance(src, ParquetSource) and len(src.shards) == 1
        clean = pa.concat_tables(src.read(0, 5))
        opened: list[int] = []
        real = ParquetSource._tables_from

        def flaky(self, shard, start_row):
            opened.append(start_row)
            for i, table in enumerate(real(self, shard, start_row)):
                if len(opened) == 1 and i == 1:
                    raise ConnectionResetError("connection reset mid-shard")
                yield table

        monkeypatch.setattr(ParquetSource, "_tables_from", flaky)
        tables = list(src.read(0, 5))
        assert opened == [5, READ_BATCH_ROWS]       # the first table ended at row 8192
        assert pa.concat_tables(tables).equals(clean)
        assert clean.column("id").to_pylist() == list(range(5, 20_000))


def test_local_missing_files_fail_fast(tmp_path, caplog):
    """Retries are for the network: a missing local file is an error at once, default retries on."""
    files = write_parquet_dataset(str(tmp_path / "pq"), rows=100, files=2, row_group_size=50)
    caplog.set_level(logging.WARNING, logger="resumable_stream.sources")
    missing = str(tmp_path / "pq" / "nope.parquet")
    with pytest.raises(SourceError) as info:
        open_source(StreamConfig(dataset_name_or_path="parquet", data_files=[files[0], missing]).source_spec)
    assert missing in str(info.value)
    # ... and so is one that vanishes while streaming
    stream = ResumableStream(StreamConfig(dataset_name_or_path="parquet", data_files=files, buffer_size=8))
    for f in files:
        os.remove(f)
    with pytest.raises(SourceError):
        _take(stream, 100)
    assert not [r for r in caplog.records if "retry" in r.getMessage()]


def test_missing_remote_file_fails_fast_with_default_retries(sites, caplog):
    """A 404 is an answer, not a fault: no retries (and their 31 s of backoff) with the default retries."""
    site = sites["jsonl"]
    missing = site.srv.url("gone.jsonl")
    site.srv.reset_stats()
    caplog.set_level(logging.WARNING, logger="resumable_stream.sources")
    with pytest.raises(SourceError) as info:
        open_source(StreamConfig(dataset_name_or_path="json", data_files=[*site.urls, missing]).source_spec)
    assert missing in str(info.value)
    assert not [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    asked = [r for r in site.srv.requests if r.path.endswith("/gone.jsonl")]
    # (JSON lines by URL are indexed: fsspec's info() asks up to three times, each a 404, no retry of ours)
    assert asked and all(r.status == 404 for r in asked) and len(asked) <= 3, asked


def test_datasets_internal_retries_are_restored(sites):
    import datasets.config

    before = (datasets.config.STREAMING_READ_MAX_RETRIES, datasets.config.STREAMING_OPEN_RETRY_INTERVAL)
    site = sites["parquet"]
    site.healthy()
    _take(ResumableStream(site.config(), rank=0, world_size=1), 50)
    assert (datasets.config.STREAMING_READ_MAX_RETRIES, datasets.config.STREAMING_OPEN_RETRY_INTERVAL) == before
