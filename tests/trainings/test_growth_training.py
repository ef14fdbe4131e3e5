"""data.growth: append under real training: a run SIGKILLed mid-epoch, a file added, the run restarted."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from training_helpers import PAUSED_TRAIN, Procs, consumed, write_config

from resumable_stream.sources.index import load_index
from resumable_stream.testing import synthetic_rows, write_parquet_dataset

pytestmark = pytest.mark.slow

ROWS, BATCH = 160, 8            # 2 files of 80 rows: an epoch is 20 steps of the tiny yaml's batch of 8


def _data(directory) -> str:
    data = directory / "data"
    write_parquet_dataset(str(data), rows=ROWS, files=2, row_group_size=20)
    return data


def _paused_run(procs, directory, name: str, pause_at: int, save_steps: int) -> dict:
    data = _data(directory)
    config, out = write_config(str(directory), name, max_steps=50, save_steps=save_steps,
                               data={"data_files": str(data / "*.parquet"), "growth": "append"})
    signals = directory / "signals"
    signals.mkdir()
    env = {"RS_TEST_PAUSE_AT": str(pause_at), "RS_TEST_PAUSE_DIR": str(signals)}
    return {"data": data, "config": config, "out": out, "signals": signals,
            "run": procs.start(config, name, env=env, script=PAUSED_TRAIN)}


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """The first process of each one-rank test below, started together: one thread each, they train side by side
    on the 2 cores rather than one after the other (each test then goes on with its own run)."""
    base = tmp_path_factory.mktemp("growth_runs")
    procs = Procs(str(base))
    try:
        runs = {"grow": _paused_run(procs, base / "grow", "grow-first", pause_at=15, save_steps=10),
                "live": _paused_run(procs, base / "live", "live", pause_at=12, save_steps=5)}
        follow = base / "follow"
        data = _data(follow)
        config, out = write_config(str(follow), "follow", max_steps=50, save_steps=100,
                                   data={"data_files": str(data / "*.parquet"), "growth": "follow",
                                         "poll_interval_s": 0.05, "follow_timeout_s": 1.0})
        runs["follow"] = {"out": out, "run": procs.start(config, "follow")}
        yield procs, runs
    finally:
        procs.cleanup()


@pytest.mark.timeout(600)
def test_file_added_between_sigkill_and_restart_joins_at_the_next_epoch(one_rank_runs):
    procs, runs = one_rank_runs
    data, config, out, signals, first = (runs["grow"][k] for k in ("data", "config", "out", "signals", "run"))
    first.wait_until(lambda: (signals / "paused").exists(), "the run paused after step 15")
    first.kill()                                   # SIGKILL mid-epoch 0; checkpoint-10 is the last complete one
    pq.write_table(pa.table(synthetic_rows(5000, 80)), str(data / "part-00002.parquet"), row_group_size=20)
    procs.start(config, "grow-again").wait_ok(timeout=400)
    steps = consumed(out)
    assert sorted(steps) == list(range(1, 51))
    ids = [int(k) for s in sorted(steps) for k in steps[s]]
    epoch0, epoch1 = ids[:ROWS], ids[ROWS:ROWS + ROWS + 80]
    assert sorted(epoch0) == list(range(ROWS))                                  # epoch 0 as it was, each row once
    assert sorted(epoch1) == sorted([*range(ROWS), *range(5000, 5080)])         # epoch 1 with the new file
    assert len(ids) == 50 * BATCH == 2 * ROWS + 80 and os.path.isdir(os.path.join(out, "checkpoint-50"))


@pytest.mark.timeout(600)
def test_file_added_while_training_joins_at_the_next_save_and_its_next_epoch(one_rank_runs):
    """Without a restart: a file written while the run trains is taken in at the next checkpoint (every rank
    refreshes there, the saved index has it) and read from the next epoch."""
    _, runs = one_rank_runs
    data, out, signals, run = (runs["live"][k] for k in ("data", "out", "signals", "run"))
    run.wait_until(lambda: (signals / "paused").exists(), "the run paused after step 12")
    pq.write_table(pa.table(synthetic_rows(5000, 80)), str(data / "part-00002.parquet"), row_group_size=20)
    (signals / "go").touch()
    run.wait_ok(timeout=400)
    steps = consumed(out)
    ids = [int(k) for s in sorted(steps) for k in steps[s]]
    assert sorted(ids[:ROWS]) == list(range(ROWS))
    assert sorted(ids[ROWS:]) == sorted([*range(ROWS), *range(5000, 5080)])
    state = os.path.join(out, "checkpoint-50", "stream_state")
    index = load_index(os.path.join(state, json.load(open(os.path.join(state, "manifest.json")))["index"]["file"]))
    assert [g["from_epoch"] for g in index["growth"]["generations"]] == [0, 1]


@pytest.mark.timeout(600)
def test_follow_timeout_ends_the_run_with_a_checkpoint(one_rank_runs):
    """data.growth: follow under the Trainer: the data read once (no second epoch over it), then no new file
    within data.follow_timeout_s: the run ends before max_steps, cleanly, with a checkpoint at its last step."""
    _, runs = one_rank_runs
    out = runs["follow"]["out"]
    run = runs["follow"]["run"].wait_ok(timeout=400)
    steps = consumed(out)
    ids = sorted(int(k) for s in steps.values() for k in s)
    assert ids == list(range(ROWS))                        # each row once, and nothing after
    last = ROWS // BATCH
    assert sorted(steps) == list(range(1, last + 1))
    assert os.path.isdir(os.path.join(out, f"checkpoint-{last}"))
    assert os.path.isdir(os.path.join(out, f"checkpoint-{last}", "stream_state"))
    log_text = run.stdout + run.stderr
    assert "follow: no new files for" in log_text and "the run ends at step 20 with a checkpoint" in log_text


@pytest.mark.timeout(600)
def test_follow_over_two_ranks_ends_in_step_with_a_checkpoint_on_every_rank(procs, tmp_path):
    """data.growth: follow under torchrun (2 ranks, gloo): the ranks train in step on the data read once; no new
    file within data.follow_timeout_s ends the run on both at the same step, with one checkpoint holding every
    rank's stream state; no row is trained on twice."""
    data = tmp_path / "data"
    write_parquet_dataset(str(data), rows=ROWS, files=2, row_group_size=20)
    config, out = write_config(str(tmp_path), "follow2", max_steps=50, save_steps=100,
                               data={"data_files": str(data / "*.parquet"), "growth": "follow",
                                     "poll_interval_s": 0.05, "follow_timeout_s": 1.0})
    run = procs.start(config, "follow2", nproc=2).wait_ok(timeout=500)
    ranks = [consumed(out, rank) for rank in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1]) and sorted(ranks[0]) == list(range(1, len(ranks[0]) + 1))
    last = len(ranks[0])
    assert 0 < last < 50
    ids = [int(k) for steps in ranks for s in steps.values() for k in s]
    assert len(ids) == len(set(ids)) and set(ids) <= set(range(ROWS))
    state = os.path.join(out, f"checkpoint-{last}", "stream_state")
    manifest = json.load(open(os.path.join(state, "manifest.json")))
    assert manifest["world_size"] == 2
    log_text = run.stdout + run.stderr
    assert f"the run ends at step {last} with a checkpoint" in log_text
    # a file added, the run started again: it resumes from that checkpoint, reads the new file in step, and
    # ends again after the timeout with a checkpoint; still no row twice
    pq.write_table(pa.table(synthetic_rows(5000, 80)), str(data / "part-00002.parquet"), row_group_size=20)
    again = procs.start(config, "follow2-again", nproc=2).wait_ok(timeout=500)
    ranks = [consumed(out, rank) for rank in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1]) and sorted(ranks[0]) == list(range(1, len(ranks[0]) + 1))
    assert len(ranks[0]) > last
    ids = [int(k) for steps in ranks for s in steps.values() for k in s]
    assert len(ids) == len(set(ids)) and set(ids) <= set(range(ROWS)) | set(range(5000, 5080))
    assert set(ids) & set(range(5000, 5080))
    assert os.path.isdir(os.path.join(out, f"checkpoint-{len(ranks[0])}", "stream_state"))
    assert f"the run ends at step {len(ranks[0])} with a checkpoint" in again.stdout + again.stderr
