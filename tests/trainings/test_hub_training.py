"""A 2-rank torchrun training (gloo, the tiny model) streaming a dataset repo from the loopback Hub: killed
with SIGKILL after a checkpoint and restarted, it trains exactly as an uninterrupted run (same losses, same
samples on every rank)."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from hub_server import HubServer, use_hub
from kill_resume_harness import assert_resumed_from, assert_same_training
from training_helpers import TINY, Procs, complete_checkpoints, count_lines, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_STEPS, SAVE_STEPS = 80, 20          # assert_same_training compares steps 1..80
REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(TINY, "data"), repo / "data")
    with HubServer(tmp_path / "hub-store") as srv:
        srv.commit(REPO, directory=repo, message="tiny data")
        with use_hub(srv, tmp_path / "hf-home") as env:
            srv.env = env
            yield srv


def test_two_rank_training_from_the_hub_killed_and_restarted_equals_an_uninterrupted_run(hub, tmp_path):
    procs = Procs(str(tmp_path))
    data = {"dataset_name_or_path": REPO, "data_files": "data/*.parquet"}
    try:
        ref_config, ref_out = write_config(str(tmp_path), "reference", max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                                           data=data)
        reference = procs.start(ref_config, "reference", nproc=2, env=hub.env)
        config, out = write_config(str(tmp_path), "killed", max_steps=MAX_STEPS, save_steps=SAVE_STEPS, data=data)
        run = procs.start(config, "killed", nproc=2, env=hub.env)
        log = os.path.join(out, "train_log.jsonl")
        run.wait_until(lambda: count_lines(log) >= SAVE_STEPS + 7 and complete_checkpoints(out),
                       "a complete checkpoint and 7 more steps")
        run.kill()
        assert run.proc.returncode == -signal.SIGKILL and count_lines(log) < MAX_STEPS, run.describe()
        resume_step = complete_checkpoints(out)[-1]
        restart = procs.start(config, "restart", nproc=2, env=hub.env).wait_ok(timeout=600)
        reference.wait_ok(timeout=600)
        note = f"[hub training, resumed from checkpoint-{resume_step}]"
        assert_resumed_from(restart, out, resume_step, note)
        assert_same_training(ref_out, out, 2, note)
        assert any("/resolve/" in r.path for r in hub.requests)     # the data did come from the Hub
    finally:
        procs.cleanup()
