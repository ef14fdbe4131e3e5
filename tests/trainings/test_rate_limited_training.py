"""A 2-rank torchrun training (gloo, the tiny model) streaming from a loopback Hub that lets 10 resolver requests
per 2 s window through (per token), with a request budget set above that (``data.max_requests_per_s: 8``, as
a wrong tier or a second job on the same token would leave it): a 429 storm all along. SIGKILLed while the storm
goes on and restarted, it trains exactly as an uninterrupted run (same losses, same samples on every rank); the
checkpoint holds no budget, and the restart sends no more requests per second than the budget allows;
``train_log.jsonl`` shows the 429s and the waits (issue 51).

It is also the test of a training streamed from the Hub killed and restarted (test_hub_training.py, merged
here: it trained the same 2-rank job from the loopback Hub without the storm and asserted what this test
asserts: killed by SIGKILL before the end, resumed from the last complete checkpoint, the same losses and
samples on every rank as the uninterrupted run, the data fetched through the Hub's ``/resolve/`` URLs)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from hub_server import HubServer, hub_env
from kill_resume_harness import assert_resumed_from, assert_same_training
from training_helpers import Procs, complete_checkpoints, count_lines, train_log_records, write_config

from resumable_stream.testing import write_parquet_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_STEPS, SAVE_STEPS = 40, 10          # assert_same_training compares steps 1..40
REPO = "org/limited"
QUOTA, WINDOW_S = 10, 2                 # the Hub's resolver requests per window, per token
BUDGET = 8.0                            # the job's plan: 16 per window, over the quota
RANKS = 2


def test_a_kill_in_a_429_storm_resumes_exactly_without_a_burst(tmp_path):
    repo = tmp_path / "repo"
    write_parquet_dataset(str(repo / "data"), rows=4000, files=4, row_group_size=25)     # 160 row groups
    procs = Procs(str(tmp_path))
    with HubServer(tmp_path / "hub-store") as hub:
        hub.commit(REPO, directory=repo, message="data")
        hub.tokens.update({"ref-token", "job-token"})        # the reference is another client: its own quota
        hub.set_rate_limit(resolvers=QUOTA, window_s=WINDOW_S)
        data = {"dataset_name_or_path": REPO, "data_files": "data/*.parquet", "max_requests_per_s": BUDGET,
                "retry_backoff_s": 0.2}
        try:
            ref_config, ref_out = write_config(str(tmp_path), "reference", max_steps=MAX_STEPS,
                                               save_steps=SAVE_STEPS, data=data)
            reference = procs.start(ref_config, "reference", nproc=RANKS,
                                    env=hub_env(hub, tmp_path / "home-ref", token="ref-token"))
            config, out = write_config(str(tmp_path), "killed", max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                                       data=data)
            env = hub_env(hub, tmp_path / "home-job", token="job-token")
            run = procs.start(config, "killed", nproc=RANKS, env=env)
            log = os.path.join(out, "train_log.jsonl")

            def storming() -> bool:     # the job's token met a 429 in the last window
                now = time.monotonic()
                return any(r.status == 429 and r.client == "job-token" and now - r.at < WINDOW_S
                           for r in list(hub.requests))

            run.wait_until(lambda: count_lines(log) >= SAVE_STEPS + 5 and complete_checkpoints(out) and storming(),
                           "a complete checkpoint, 5 more steps, and a 429 in the last window", timeout=400)
            run.kill()
            assert run.proc.returncode == -signal.SIGKILL and count_lines(log) < MAX_STEPS, run.describe()
            resume_step = complete_checkpoints(out)[-1]
            # the data state holds no budget: nothing of it is saved, a restart starts with empty buckets
            state_dir = os.path.join(out, f"checkpoint-{resume_step}", "stream_state")
            for name in os.listdir(state_dir):
                with open(os.path.join(state_dir, name), "rb") as f:
                    raw = f.read()
                assert all(word not in raw for word in (b"max_requests", b"budget", b"rate_limit", b"bucket")), name
            killed_at = time.monotonic()
            restart = procs.start(config, "restart", nproc=RANKS, env=env)
            restart.wait_ok(timeout=600)
            reference.wait_ok(timeout=600)
            note = f"[429 storm, resumed from checkpoint-{resume_step}]"
            assert_resumed_from(restart, out, resume_step, note, MAX_STEPS)
            assert_same_training(ref_out, out, RANKS, note, MAX_STEPS)
            # what the restart sent (let through or answered 429): per second, never more than the budget allows
            # (its rate, plus one request per consumer at once); an unpaced restart sends its first window's
            # fetches ahead at once (8 per partition) and every rank its footers
            sent = sorted(r.at for r in hub.requests if "/resolve/" in r.path and r.at > killed_at and r.range
                          and r.client == "job-token")
            assert sent, "the restart fetched no data through the Hub's /resolve/ URLs"
            first = sent[0]
            per_s = [sum(1 for t in sent if first + s <= t < first + s + 1) for s in range(10)]
            print(f"\nrestart: requests per second from its first one: {per_s} (budget {BUDGET:g}/s, "
                  f"{RANKS} consumers); 429s in all {hub.rate_limited}")
            assert max(per_s) <= BUDGET + RANKS, per_s
            # 429s and the waits for their resets are in train_log.jsonl, for the killed run and the restart
            records = train_log_records(out)
            limited = sum(r.get("data_rate_limited", 0) for r in records)
            waited = sum(r.get("data_rate_limit_wait_s", 0) for r in records)
            paced = sum(r.get("data_budget_wait_s", 0) for r in records)
            print(f"train_log.jsonl: data_rate_limited {limited}, data_rate_limit_wait_s {waited:.1f}, "
                  f"data_budget_wait_s {paced:.1f} over {len(records)} records")
            assert limited > 0 and waited > 0 and paced > 0
            assert all(r.get("data_retries", 0) == 0 for r in records)        # no retry spent on a 429
            assert hub.rate_limited > 0
            with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
                assert any("data_rate_limited" in json.loads(line) for line in f)
        finally:
            procs.cleanup()
