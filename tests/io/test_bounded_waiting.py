"""Bounded waiting (issue 20, item 5): one deadline per request (data.timeout_s), one budget per read across
its retries (data.retry_budget_s). A stuck server makes a read fail with a SourceError naming the URL within
retry_budget_s + timeout_s (a step of two requests: + 2 x timeout_s), and a training job exits non-zero with
its last checkpoint resumable."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest
from http_server import FileServer
from kill_resume_harness import assert_resumed_from, assert_same_training
from training_helpers import TINY, Procs, complete_checkpoints, count_lines, write_config

from resumable_stream import ResumableStream, SourceError, StreamConfig
from resumable_stream.sources import open_source
from resumable_stream.testing import write_parquet_dataset

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("hub_offline")]

SLACK_S = 2.0        # thread scheduling, a loaded CI machine


class Blackhole:
    """Accepts connections, reads what comes, never answers (a hung server or a dead proxy)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self.conns.append(conn)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/{name}"

    def close(self) -> None:
        self._stop.set()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def blackhole():
    b = Blackhole()
    yield b
    b.close()


def test_the_default_bound_is_five_minutes():
    d = StreamConfig(dataset_name_or_path="org/name")
    assert d.timeout_s == 60 and d.retry_budget_s + 2 * d.timeout_s <= 300


def test_a_server_that_never_answers_fails_the_open_within_the_budget(blackhole):
    url = blackhole.url("a.parquet")
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[url], timeout_s=1.0, retry_budget_s=3.0,
                       retries=100, retry_backoff_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as err:
        ResumableStream(cfg)
    elapsed = time.monotonic() - t0
    assert elapsed <= cfg.retry_budget_s + 2 * cfg.timeout_s + SLACK_S, elapsed
    assert url in str(err.value) and "data.retry_budget_s" in str(err.value)
    assert blackhole.accepted >= 2                  # it was tried again within the budget


def test_a_read_stuck_mid_stream_fails_within_the_budget(tmp_path):
    write_parquet_dataset(str(tmp_path), rows=2000, files=1, row_group_size=200)
    with FileServer(tmp_path) as srv:
        url = srv.url("part-00000.parquet")
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[url], timeout_s=1.0, retry_budget_s=2.0,
                           retries=100, retry_backoff_s=0.1, prefetch_blocks=0, interleave_shards=1)
        stream = ResumableStream(cfg, source=open_source(cfg.source_spec))
        it = iter(stream)
        for _ in range(150):
            next(it)
        srv.stall_s = 30.0
        srv.faults.append(lambda rec: "stall")           # headers, then nothing: a body that never comes
        t0 = time.monotonic()
        with pytest.raises(SourceError) as err:
            for _ in range(2000):
                next(it)
        elapsed = time.monotonic() - t0
        assert elapsed <= cfg.retry_budget_s + cfg.timeout_s + SLACK_S, elapsed
        assert url in str(err.value) and "row group" in str(err.value) or "shard" in str(err.value)
        srv.faults.clear()


MAX_STEPS = 80      # 59 steps after the stall: more than the reads ahead (prefetch_blocks) hold


@pytest.mark.slow
def test_a_training_job_on_a_stuck_server_exits_and_resumes_from_its_checkpoint(tmp_path):
    www = tmp_path / "www"
    shutil.copytree(os.path.join(TINY, "data"), www)
    procs = Procs(str(tmp_path))
    with FileServer(www) as srv:
        data = {"data_files": [srv.url(n) for n in sorted(os.listdir(www))], "timeout_s": 1.0,
                "retry_budget_s": 3.0, "retry_backoff_s": 0.2, "prefetch_blocks": 2}
        try:
            ref_config, ref_out = write_config(str(tmp_path), "reference", max_steps=MAX_STEPS, save_steps=20, data=data)
            procs.start(ref_config, "reference").wait_ok(timeout=300)
            config, out = write_config(str(tmp_path), "stuck", max_steps=MAX_STEPS, save_steps=20, data=data)
            run = procs.start(config, "stuck")
            log = os.path.join(out, "train_log.jsonl")
            run.wait_until(lambda: complete_checkpoints(out) and count_lines(log) >= 21, "checkpoint-20")
            srv.stall_s = 120.0
            srv.faults.append(lambda rec: "stall")     # from now on nothing answers
            t0 = time.monotonic()
            code = run.wait(timeout=120)
            assert code != 0 and count_lines(log) < MAX_STEPS, run.describe()
            assert time.monotonic() - t0 < 60, run.describe()
            assert srv.base_url in run.stderr and "data.retry_budget_s" in run.stderr, run.describe()
            resume_step = complete_checkpoints(out)[-1]
            srv.faults.clear()                         # the server is back
            restart = procs.start(config, "restart").wait_ok(timeout=300)
            note = f"[stuck server, resumed from checkpoint-{resume_step}]"
            assert_resumed_from(restart, out, resume_step, note, MAX_STEPS)
            assert_same_training(ref_out, out, 1, note, MAX_STEPS)
        finally:
            procs.cleanup()
