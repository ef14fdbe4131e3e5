"""One training job per output_dir, with real ``resumable-stream train`` processes: a second job on a running
job's output_dir exits 2 naming the directory and the holder (every rank of it, under torchrun), the running
job is unharmed; a SIGKILLed job's lock does not block its restart, which resumes.

The first job runs ``tests/_support/paused_train.py``: it waits after step 3 (checkpoint-2 complete) while the test
starts the second job or kills it, so no timing decides what the test sees."""

import json
import os
import re

import pytest
from training_helpers import (
    PAUSED_TRAIN,
    checkpoint_path,
    complete_checkpoints,
    consumed,
    printed_steps,
    write_config,
)

from resumable_stream.runtime.output_lock import LOCK_FILE

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_STEPS, PAUSE_AT = 6, 2, 3


def _start_paused(procs, tmp_path, name: str, nproc: int = 1):
    """A job paused after step PAUSE_AT, holding its output_dir. Returns (config, out, run, go file)."""
    config, out = write_config(str(tmp_path), name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS)
    signals = tmp_path / f"{name}-signals"
    signals.mkdir()
    env = {"RS_TEST_PAUSE_AT": str(PAUSE_AT), "RS_TEST_PAUSE_DIR": str(signals)}
    run = procs.start(config, f"{name}-first", nproc=nproc, env=env, script=PAUSED_TRAIN)
    run.wait_until(lambda: (signals / "paused").exists(), f"the first job paused after step {PAUSE_AT}")
    return config, out, run, signals / "go"


def _holder(out: str) -> dict:
    with open(os.path.join(out, LOCK_FILE), encoding="utf-8") as f:
        return json.loads(f.read())


def _steps(out: str) -> list[int]:
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        return [rec["step"] for rec in map(json.loads, f) if "loss" in rec]


def _refusals(run, out: str, holder: int) -> list[str]:
    """The refusals a job printed (ranks print at once: their lines may run into each other): for each, the
    "rank 0: " prefix of a rank that reports rank 0's refusal, or ""."""
    return re.findall(rf"resumable-stream: error: (rank 0: )?output_dir {re.escape(repr(out))} is in use by another "
                      rf"training job: pid {holder} on host [^,]+, started ", run.stderr)


def test_a_second_job_on_a_running_jobs_output_dir_exits_2_and_the_first_is_unharmed(procs, tmp_path):
    config, out, first, go = _start_paused(procs, tmp_path, "run")
    assert _holder(out)["pid"] == first.proc.pid

    second = procs.start(config, "second")
    assert second.wait(timeout=180) == 2, second.describe()
    assert _refusals(second, out, first.proc.pid) == [""], second.describe()

    go.touch()
    first.wait_ok()
    assert _steps(out) == list(range(1, MAX_STEPS + 1)), "two jobs wrote train_log.jsonl"
    assert sorted(consumed(out)) == list(range(1, MAX_STEPS + 1))
    assert complete_checkpoints(out) == [4, 6]       # save_total_limit 2 rotated, the lock file is no checkpoint
    assert os.path.isfile(os.path.join(out, LOCK_FILE))


def test_a_killed_jobs_lock_is_taken_over_by_its_restart_which_resumes(procs, tmp_path):
    config, out, first, _ = _start_paused(procs, tmp_path, "killed")
    first.kill()
    assert _holder(out)["pid"] == first.proc.pid, "the killed job's details are left in the lock file"
    assert complete_checkpoints(out) == [SAVE_STEPS]

    restart = procs.start(config, "restart").wait_ok()
    assert f"resuming from {checkpoint_path(out, SAVE_STEPS)}" in restart.stderr, restart.describe()
    assert printed_steps(restart) == MAX_STEPS - SAVE_STEPS
    assert _steps(out) == list(range(1, MAX_STEPS + 1))


def test_a_second_torchrun_job_fails_on_every_rank_without_hanging(procs, tmp_path):
    config, out, first, go = _start_paused(procs, tmp_path, "ddp", nproc=2)
    holder = _holder(out)["pid"]
    assert holder in {p.pid for p in first.members()}, "the lock is held by a rank of the first job"

    second = procs.start(config, "second", nproc=2)
    assert second.wait(timeout=240) != 0, second.describe()
    # each rank raised and printed it itself (none was left waiting for rank 0 and killed by torchrun)
    assert sorted(_refusals(second, out, holder)) == ["", "rank 0: "], second.describe()

    go.touch()
    first.wait_ok()
    assert _steps(out) == list(range(1, MAX_STEPS + 1))
