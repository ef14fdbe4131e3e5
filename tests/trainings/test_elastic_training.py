"""Elastic determinism in real training (``resumable-stream train`` under torchrun, gloo): a run killed at a step
resumes on another number of ranks and DataLoader workers and continues the identical sequence of optimizer
steps, with the losses of the uninterrupted run.

``data.num_partitions: 12`` and a global batch of 12 micro-batches of 2 packed blocks (gradient accumulation
12 on one rank, 6 on two): every step takes the next micro-batch of each partition. One uninterrupted run on
one rank is the reference. The elastic run is SIGKILLed after step 4 on 1 rank (checkpoint 3), resumed on
2 ranks with 2 DataLoader workers each, SIGKILLed after step 7 (checkpoint 6), and resumed on 1 rank with 1
worker to step 9: both kills fall inside packed blocks (tokens carried over in every partition), and the
partitions pass epoch ends on the way (an epoch is ~2.4 steps). Every step's multiset of sample keys (the
consumed logs of the ranks that trained it last) equals the reference's, and every loss equals it within the
float reduction order (the largest difference is reported).

Refused, before the model is built: a change without ``data.elastic`` (naming it), and a gradient
accumulation that does not take one micro-batch of every partition per step (naming
``train.gradient_accumulation_steps`` and what is allowed).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from training_helpers import (
    complete_checkpoints,
    consumed,
    count_lines,
    train_log_records,
    train_losses,
    write_config,
)

from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.slow

PARTITIONS, BATCH, STEPS = 12, 2, 9
LOSS_TOLERANCE = 1e-4        # relative: the float reduction order of the gradients (all-reduce, accumulation)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic_data")
    write_parquet_dataset(str(d), rows=288, files=12, row_group_size=12)    # 2 shards (24 rows) a partition
    return str(d)


def _config(tmp_path, data_dir, name, ranks, workers, **data):
    keys = {"data_files": os.path.join(data_dir, "*.parquet"), "num_partitions": PARTITIONS, "elastic": True,
            "buffer_size": 32, **data}
    return write_config(str(tmp_path), name, max_steps=STEPS, save_steps=3, packing=True, workers=workers,
                        data=keys, save_total_limit=None, per_device_train_batch_size=BATCH,
                        gradient_accumulation_steps=PARTITIONS // ranks)


def step_multisets(out: str, ranks_of_step: dict[int, int]) -> dict[int, Counter]:
    """step -> the multiset of the sample keys every rank of the run that trained it last consumed in it."""
    logs = {rank: consumed(out, rank) for rank in range(max(ranks_of_step.values()))}
    return {step: sum((Counter(logs[rank][step]) for rank in range(ranks)), Counter())
            for step, ranks in ranks_of_step.items()}


def _killed_after(run, out: str, step: int) -> None:
    run.wait_until(lambda: count_lines(os.path.join(out, "train_log.jsonl")) >= step, f"step {step} logged")
    run.kill()


@pytest.mark.timeout(900)
def test_a_run_killed_and_resumed_on_other_ranks_and_workers_trains_the_identical_steps(procs, tmp_path, data_dir,
                                                                                       record_property):
    # the uninterrupted run, the refused one and the first of the elastic run are independent one-rank processes of
    # one thread each: they train side by side on the 2 cores
    reference, ref_out = _config(tmp_path, data_dir, "reference", 1, 0)
    uninterrupted = procs.start(reference, "reference")

    # a gradient accumulation of 4 on one rank takes 4 of the 12 partitions a step: refused, naming the keys
    wrong, _ = write_config(str(tmp_path), "wrong", max_steps=STEPS, save_steps=3, gradient_accumulation_steps=4,
                            data={"data_files": os.path.join(data_dir, "*.parquet"), "num_partitions": PARTITIONS})
    wrong_run = procs.start(wrong, "wrong")

    first, out = _config(tmp_path, data_dir, "run", 1, 0)
    _killed_after(procs.start(first, "first"), out, 4)
    assert complete_checkpoints(out) == [3]

    run = wrong_run
    assert run.wait() == 2, run.describe()
    assert ("train.gradient_accumulation_steps: got 4 on 1 rank(s) x train.dataloader_num_workers 0 with "
            "data.num_partitions 12") in run.stderr, run.describe()
    assert "a multiple of num_partitions / ranks = 12" in run.stderr, run.describe()

    refused, _ = _config(tmp_path, data_dir, "run", 1, 2, elastic=False)    # a change without data.elastic
    run = procs.start(refused, "refused")
    assert run.wait() == 2, run.describe()
    assert "data.elastic: true" in run.stderr and "num_workers: saved 0, now 2" in run.stderr, run.describe()

    second, _ = _config(tmp_path, data_dir, "run", 2, 2)             # 1 -> 2 ranks, 0 -> 2 workers
    run = procs.start(second, "second", nproc=2)
    _killed_after(run, out, 7)
    assert "resuming from" in run.stderr and "checkpoint-3" in run.stderr, run.describe()
    assert complete_checkpoints(out) == [3, 6]

    third, _ = _config(tmp_path, data_dir, "run", 1, 1)              # 2 -> 1 rank, 2 -> 1 worker
    run = procs.start(third, "third").wait_ok()
    assert "checkpoint-6" in run.stderr, run.describe()
    uninterrupted.wait_ok()

    ranks_of_step = {s: 1 if s <= 3 or s > 6 else 2 for s in range(1, STEPS + 1)}
    expected = step_multisets(ref_out, {s: 1 for s in range(1, STEPS + 1)})
    got = step_multisets(out, ranks_of_step)
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], \
            f"step {step} ({ranks_of_step[step]} rank(s)) trained on other samples than the uninterrupted run"
        assert sum(got[step].values()) >= PARTITIONS * BATCH    # packed blocks hold several samples
    ref_losses, losses = train_losses(ref_out), train_losses(out)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    worst = max(abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in losses)
    record_property("figure", f"largest relative loss difference from the uninterrupted run over {STEPS} steps "
                              f"(1 -> 2 -> 1 ranks): {worst:.2e}")
    assert worst <= LOSS_TOLERANCE, f"losses {losses} vs the uninterrupted run's {ref_losses}"
    # the partitions passed epoch ends on the way (the data's epoch, a mean over partitions)
    assert train_log_records(ref_out)[-1]["data_epoch"] > 3


# ---------------------------------------------------------------------------------------------- a plain loop
LOOP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_support", "elastic_loop.py")
LOOP_STEPS = 10


def _loop(procs, out: str, data: str, label: str, ranks: int, workers: int):
    import sys

    from training_helpers import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), LOOP, out, data, "--steps", str(LOOP_STEPS),
               "--workers", str(workers)]
    return procs.start(out, label, command=command)


def _loop_steps(out: str) -> dict[int, dict]:
    import json

    with open(os.path.join(out, "steps.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    steps = {r["step"]: r for r in records}
    assert len(steps) == len(records), f"a step logged twice in {out}/steps.jsonl"
    return steps


@pytest.mark.timeout(900)
def test_a_plain_loop_killed_and_resumed_on_other_ranks_trains_the_identical_steps(procs, tmp_path,
                                                                                  record_property):
    """tests/_support/elastic_loop.py (StreamLoader, resumable_stream.Checkpoints, DDP): 4 ranks killed after step
    4 (checkpoint 3), resumed on 2 ranks with a DataLoader worker each and killed after step 7 (checkpoint 6),
    resumed on 3 ranks to step 10: every step's samples (ids) are the uninterrupted one-rank run's, and its loss
    within the float reduction order; epochs end every 6 steps."""
    data = str(tmp_path / "data")
    write_parquet_dataset(data, rows=144, files=12, row_group_size=6)     # 12 rows a partition: 6 steps an epoch
    ref_out, out = str(tmp_path / "reference"), str(tmp_path / "run")
    os.makedirs(ref_out)
    os.makedirs(out)
    uninterrupted = _loop(procs, ref_out, data, "reference", 1, 2)     # side by side with the first 4 ranks

    def killed_after(run, step):
        run.wait_until(lambda: count_lines(os.path.join(out, "steps.jsonl")) >= step, f"step {step} logged")
        run.kill()

    killed_after(_loop(procs, out, data, "four", 4, 0), 4)           # 4 ranks
    uninterrupted.wait_ok(300)
    killed_after(_loop(procs, out, data, "two", 2, 1), 7)            # 4 -> 2 ranks, 0 -> 1 worker
    _loop(procs, out, data, "three", 3, 0).wait_ok(300)              # 2 -> 3 ranks, 1 -> 0 workers

    reference, got = _loop_steps(ref_out), _loop_steps(out)
    assert sorted(got) == sorted(reference) == list(range(1, LOOP_STEPS + 1))
    assert [got[s]["ranks"] for s in sorted(got)] == [4, 4, 4, 2, 2, 2, 3, 3, 3, 3]
    for step in reference:
        assert got[step]["ids"] == reference[step]["ids"], f"step {step}: other samples than the uninterrupted run"
        assert len(got[step]["ids"]) == 12 * 2
    worst = max(abs(got[s]["loss"] - reference[s]["loss"]) / reference[s]["loss"] for s in reference)
    record_property("figure", f"largest relative loss difference of the plain loop (4 -> 2 -> 3 ranks) from the "
                              f"uninterrupted run over {LOOP_STEPS} steps: {worst:.2e}")
    assert worst <= LOSS_TOLERANCE
