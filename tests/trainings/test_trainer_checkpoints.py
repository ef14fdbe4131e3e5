"""Exact inside every trainer's own checkpoint: torch.distributed.checkpoint, accelerate, Lightning and torchdata's
StatefulDataLoader each keep the loader's state their own way (DCP merges the ranks' copies of a value, accelerate
and Lightning write rank 0's), on 1 and 2 ranks (torchrun, gloo) with 2 DataLoader workers each, shuffled. A run
is SIGKILLed (every process of it) a few steps after a checkpoint; the restart resumes through the package's own
calls (tests/_support/trainer_checkpoints_train.py) and must train the steps after the checkpoint on the very
samples, with the very losses, the killed run trained them on."""

from __future__ import annotations

import json
import os
import sys

import pytest
from training_helpers import Procs, free_port, wait_until_each

from resumable_stream.testing import write_parquet_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "_support", "trainer_checkpoints_train.py")
EVERY, STEPS = 4, 7          # checkpoint after step 4; killed after step 7; resumed: steps 5..7 again

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("trainer_ckpt_data"))
    write_parquet_dataset(d, rows=600, files=6, row_group_size=25)
    return d


def _command(via: str, ranks: int, out: str, data: str, hold: bool) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), SCRIPT, via, out, data, "--steps", str(STEPS),
            "--every", str(EVERY), *(["--hold"] if hold else [])]


def _logged(out: str, rank: int, run: str) -> dict[int, dict]:
    with open(os.path.join(out, f"log-rank{rank}.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r for r in records if r["run"] == run}


VIAS = ["dcp", "accelerate", "lightning", "statefuldl"]


def _held_then_resumed(procs: Procs, runs: dict[str, tuple[str, int]], data: str) -> dict[str, str | None]:
    """Runs each (via -> (out, ranks)) held at step ``STEPS``, SIGKILLed once every rank is there, and restarted;
    all at once (their processes share the cores). Returns via -> None, or what went wrong."""
    held = {via: procs.start(out, f"{via}-held", command=_command(via, ranks, out, data, hold=True))
            for via, (out, ranks) in runs.items()}
    what = f"every rank past step {STEPS} with the checkpoint of step {EVERY} written"
    waits = {via: (run, lambda out=runs[via][0], ranks=runs[via][1]:
                   all(os.path.exists(os.path.join(out, f"held-{r}")) for r in range(ranks)), what)
             for via, run in held.items()}
    resumed, failed = {}, {}
    for via, failure in wait_until_each(waits, timeout=300):
        if failure is not None:
            failed[via] = failure
            continue
        out, ranks = runs[via]
        held[via].kill()
        resumed[via] = procs.start(out, f"{via}-resumed", command=_command(via, ranks, out, data, hold=False))
    for via, run in resumed.items():
        try:
            if run.wait(300) != 0:
                failed[via] = f"training process failed\n{run.describe()}"
        except AssertionError as e:      # still running after 300 s (killed)
            failed[via] = str(e)
    return {via: failed.get(via) for via in runs}


@pytest.fixture(scope="module")
def one_rank_runs(data, tmp_path_factory):
    """The one-rank case of every trainer, held, killed and resumed side by side (a one-rank run leaves a core
    idle while it starts, imports and saves): via -> (output dir, None or what went wrong)."""
    root = tmp_path_factory.mktemp("one_rank")
    runs = {via: (str(root / via), 1) for via in VIAS}
    for out, _ in runs.values():
        os.makedirs(out)
    procs = Procs(str(root))
    try:
        failures = _held_then_resumed(procs, runs, data)
    finally:
        procs.cleanup()
    return {via: (runs[via][0], failures[via]) for via in VIAS}


@pytest.mark.timeout(900)      # the first one-rank case waits for all four
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("via", VIAS)
def test_a_sigkill_after_the_packages_own_checkpoint_resumes_exactly(via, ranks, data, tmp_path, request):
    if ranks == 1:
        out, failure = request.getfixturevalue("one_rank_runs")[via]
        assert failure is None, failure
    else:
        out = str(tmp_path / "run")
        os.makedirs(out)
        procs = Procs(str(tmp_path))
        try:
            failure = _held_then_resumed(procs, {via: (out, ranks)}, data)[via]
        finally:
            procs.cleanup()
        assert failure is None, failure
    trained = set()
    for rank in range(ranks):
        before, after = _logged(out, rank, "held"), _logged(out, rank, "resumed")
        assert sorted(before) == list(range(1, STEPS + 1)), f"rank {rank}: the held run trained {sorted(before)}"
        assert sorted(after) == list(range(EVERY + 1, STEPS + 1)), \
            f"rank {rank}: the restart trained steps {sorted(after)}, expected {EVERY + 1}..{STEPS} from the checkpoint"
        for step in after:
            assert after[step]["ids"] == before[step]["ids"], \
                f"rank {rank} step {step}: resumed on {after[step]['ids']}, the killed run trained {before[step]['ids']}"
            assert after[step]["loss"] == before[step]["loss"], \
                f"rank {rank} step {step}: loss {after[step]['loss']!r} after the resume, {before[step]['loss']!r} before"
        trained |= {i for step in before.values() for i in step["ids"]}
    every_sample = sum(len(step["ids"]) for rank in range(ranks) for step in _logged(out, rank, "held").values())
    assert len(trained) == every_sample, "a sample was trained on twice (or by two ranks)"


def test_lightning_refuses_a_loader_that_does_not_count_the_batch_it_takes_ahead(data, tmp_path):
    """Lightning's fit loop takes one batch ahead of the one it trains on (over a loader without a length); a
    StreamLoader that does not say so (trainer_prefetch=0) would resume one batch late: refused when Lightning
    saves its first checkpoint, naming the fix, never found out at resume."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    procs = Procs(str(tmp_path))
    try:
        run = procs.start(out, "late", command=[*_command("lightning", 1, out, data, hold=False), "--trainer-prefetch", "0"])
        assert run.wait(300) != 0
    finally:
        procs.cleanup()
    assert "trainer_prefetch: got 0; Lightning's fit loop holds 1 batch(es) taken ahead" in run.stderr, run.describe()
    assert not os.path.exists(os.path.join(out, "ckpt", "step-4.ckpt")), "a checkpoint that would resume late was kept"


def test_a_dcp_checkpoint_of_two_ranks_resumes_on_one_with_the_identical_steps(data, tmp_path, record_property):
    """data.elastic_determinism through DCP (torchtitan's pattern): 2 ranks, 2 workers each, every step one
    micro-batch of each of the 4 partitions (gradient accumulation 2 per rank), checkpointed by dcp.save after step
    4 and SIGKILLed after step 7; restarted on 1 rank (accumulation 4), dcp.load of the same dict restores the model,
    the optimizer and the loader from the 2-rank checkpoint, and steps 5..7 train on the samples of the killed
    run's, with its losses up to the order of the float additions."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    procs = Procs(str(tmp_path))
    try:
        held = procs.start(out, "held", command=[*_command("dcp", 2, out, data, hold=True), "--accumulate"])
        held.wait_until(lambda: all(os.path.exists(os.path.join(out, f"held-{r}")) for r in range(2)),
                        f"both ranks past step {STEPS} with the checkpoint of step {EVERY} written", timeout=300)
        held.kill()
        procs.start(out, "resumed", command=[*_command("dcp", 1, out, data, hold=False), "--accumulate"]).wait_ok(300)
    finally:
        procs.cleanup()
    before = [_logged(out, rank, "held") for rank in (0, 1)]
    after = _logged(out, 0, "resumed")
    assert sorted(after) == list(range(EVERY + 1, STEPS + 1))
    worst = 0.0
    for step in after:
        killed = sorted(before[0][step]["ids"] + before[1][step]["ids"])
        assert sorted(after[step]["ids"]) == killed, f"step {step}: other samples on 1 rank than on 2"
        assert len(killed) == 4 * 4          # a micro-batch of 4 from each of the 4 partitions
        assert before[0][step]["loss"] == before[1][step]["loss"]      # all-reduced: the global loss
        worst = max(worst, abs(after[step]["loss"] - before[0][step]["loss"]) / before[0][step]["loss"])
    record_property("figure", f"DCP, 2 -> 1 ranks: largest relative loss difference {worst:.2e}")
    assert worst <= 1e-5
