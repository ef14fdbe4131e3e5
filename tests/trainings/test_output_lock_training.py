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


def _begin_paused(procs, tmp_path, name: str, nproc: int = 1):
    """A job that will pause after step PAUSE_AT, holding its output_dir. Returns (config, out, run, signals dir)."""
    config, out = write_config(str(tmp_path), name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS)
    signals = tmp_path / f"{name}-signals"
    signals.mkdir()
    env = {"RS_TEST_PAUSE_AT": str(PAUSE_AT), "RS_TEST_PAUSE_DIR": str(signals)}
    run = procs.start(config, f"{name}-first", nproc=nproc, env=env, script=PAUSED_TRAIN)
    return config, out, run, signals


def _paused(job) -> tuple:
    """Wait until a job of _begin_paused paused. Returns (config, out, run, go file)."""
    config, out, run, signals = job
    run.wait_until(lambda: (signals / "paused").exists(), f"the first job of {out} paused after step {PAUSE_AT}")
    return config, out, run, signals / "go"


def _start_paused(procs, tmp_path, name: str, nproc: int = 1):
    """A job paused after step PAUSE_AT, holding its output_dir. Returns (config, out, run, go file)."""
    return _paused(_begin_paused(procs, tmp_path, name, nproc))


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


def test_a_second_job_is_refused_and_a_killed_jobs_lock_is_taken_over_by_its_restart(procs, tmp_path):
    """Two cases, two output_dirs, their one-rank jobs side by side on the 2 cores (they were two tests, each
    waiting for its own job): a second job on a running job's output_dir exits 2 and the first is unharmed; a
    killed job's lock is taken over by its restart, which resumes."""
    running, killed = _begin_paused(procs, tmp_path, "run"), _begin_paused(procs, tmp_path, "killed")
    config, out, first, go = _paused(running)
    k_config, k_out, k_first, _ = _paused(killed)

    # the second job on a running job's output_dir
    assert _holder(out)["pid"] == first.proc.pid, "refused: the lock names another holder"
    second = procs.start(config, "second")

    # the killed job
    k_first.kill()
    assert _holder(k_out)["pid"] == k_first.proc.pid, "taken over: the killed job's details are left in the lock file"
    assert complete_checkpoints(k_out) == [SAVE_STEPS], "taken over: checkpoints of the killed job"
    restart = procs.start(k_config, "restart")

    assert second.wait(timeout=180) == 2, f"refused: exit of the second job\n{second.describe()}"
    assert _refusals(second, out, first.proc.pid) == [""], f"refused: the message\n{second.describe()}"
    go.touch()
    first.wait_ok()
    assert _steps(out) == list(range(1, MAX_STEPS + 1)), "refused: two jobs wrote train_log.jsonl"
    assert sorted(consumed(out)) == list(range(1, MAX_STEPS + 1)), "refused: the first job's consumed log"
    # save_total_limit 2 rotated, the lock file is no checkpoint
    assert complete_checkpoints(out) == [4, 6], "refused: the first job's checkpoints"
    assert os.path.isfile(os.path.join(out, LOCK_FILE)), "refused: the first job's lock file"

    restart.wait_ok()
    assert f"resuming from {checkpoint_path(k_out, SAVE_STEPS)}" in restart.stderr, \
        f"taken over: the restart did not resume\n{restart.describe()}"
    assert printed_steps(restart) == MAX_STEPS - SAVE_STEPS, "taken over: steps the restart trained"
    assert _steps(k_out) == list(range(1, MAX_STEPS + 1)), "taken over: train_log.jsonl of the killed job and its restart"


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
