"""`resumable-stream llamafactory train` on 2 CPU ranks (gloo) with LLaMA-Factory's pinned accelerate and
transformers: launched as llamafactory-cli launches (FORCE_TORCHRUN=1) and with a plain `torchrun -m`, the two
give the same training; data-parallel (the ranks end with equal parameters); killed after a checkpoint and
started again, it continues exactly (losses and every rank's consumed samples); killed on one rank and resumed on
two (data.elastic_determinism), it trains the uninterrupted run's steps."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml
from lf_helpers import ENV, assert_losses_equal, consumed, losses, ours, write_yaml
from training_helpers import complete_checkpoints, count_lines, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = {"max_steps": 30, "save_steps": 10, "buffer_size": 32, "dataset": "alpaca,sharegpt",
        "mix_strategy": "interleave_over", "interleave_probs": "0.5,0.5", "ddp_backend": "gloo"}
FORCE = {**ENV, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}


def _config(tmp_path, name: str, model: str, data: str) -> tuple[str, str]:
    return write_yaml(str(tmp_path), name, model, data, consumed_log=True, **KEYS)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *args]


def test_two_ranks_force_torchrun_and_plain_torchrun_train_the_same_data_parallel_model(assets, procs, tmp_path):
    model, data = assets
    forced, forced_out = _config(tmp_path, "forced", model, data)
    procs.start(forced, "forced", env=FORCE, command=ours(forced)).wait_ok(600)
    plain, plain_out = _config(tmp_path, "plain", model, data)
    # the plain torchrun, through a probe that records each rank's parameters at the end
    run = procs.start(plain, "plain", env=ENV, command=_torchrun(os.path.join(HERE, "dp_probe.py"), plain))
    run.wait_ok(600)
    assert_losses_equal(losses(forced_out), losses(plain_out), 0.0, "[FORCE_TORCHRUN vs torchrun -m]")
    for rank in (0, 1):
        assert consumed(forced_out, rank) == consumed(plain_out, rank)
    assert set(consumed(forced_out, 0)[1]).isdisjoint(consumed(forced_out, 1)[1])   # each rank its own samples
    sums = [json.load(open(os.path.join(plain_out, f"parameters-rank{r}.json"))) for r in (0, 1)]
    assert sums[0] == sums[1], f"the ranks ended with different parameters: {sums}"


def test_two_ranks_killed_after_a_checkpoint_continue_exactly(assets, procs, tmp_path):
    model, data = assets
    reference, ref_out = _config(tmp_path, "reference", model, data)
    procs.start(reference, "reference", env=FORCE, command=ours(reference)).wait_ok(600)
    config, out = _config(tmp_path, "killed", model, data)
    run = procs.start(config, "killed", env=FORCE, command=ours(config))
    log = os.path.join(out, "trainer_log.jsonl")
    run.wait_until(lambda: 10 in complete_checkpoints(out) and count_lines(log) >= 13, "checkpoint-10 + 3 steps")
    run.kill()
    procs.start(config, "restart", env=FORCE, command=ours(config)).wait_ok(600)
    assert_losses_equal(losses(ref_out), losses(out), 0.0, "[2 ranks, killed after checkpoint-10]")
    for rank in (0, 1):
        assert consumed(ref_out, rank) == consumed(out, rank)


def test_killed_on_one_rank_and_resumed_on_two_trains_the_identical_steps(assets, procs, tmp_path, record_property):
    """data.elastic_determinism through LLaMA-Factory's own trainer: num_partitions 4, a global batch of 4
    micro-batches (gradient_accumulation_steps 4 on one rank, 2 on two), an interleaved mixture shuffled, with a
    DataLoader worker. Killed on one rank after step 4 (checkpoint 3) and resumed on two (FORCE_TORCHRUN): every
    step's samples are those of the uninterrupted one-rank run, its losses equal within the float reduction order.
    An accumulation of 1 on one rank is refused before the model loads, naming the keys."""
    model, data = assets
    # one process: no ddp_backend (accelerate would take gloo as a process group to join and find none)
    keys = {k: v for k, v in KEYS.items() if k != "ddp_backend"} | {"max_steps": 8, "save_steps": 3}

    def config(name, accumulation, **ours_keys):
        ranks = {"ddp_backend": "gloo"} if accumulation == 2 else {}    # the two-rank resume
        path, out = write_yaml(str(tmp_path), name, model, data, consumed_log=True, **keys, **ranks,
                               gradient_accumulation_steps=accumulation)
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        doc["resumable_stream"].update(num_partitions=4, elastic=True, **ours_keys)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f)
        return path, out

    wrong, _ = config("wrong", 1)
    run = procs.start(wrong, "wrong", env=ENV, command=ours(wrong))
    assert run.wait(300) == 2, run.describe()
    assert "gradient_accumulation_steps: got 1 on 1 rank(s) x dataloader_num_workers 1 with " \
           "resumable_stream.num_partitions 4" in run.stderr, run.describe()
    reference, ref_out = config("reference", 4)
    procs.start(reference, "reference", env=ENV, command=ours(reference)).wait_ok(600)
    one, out = config("elastic", 4)
    run = procs.start(one, "one", env=ENV, command=ours(one))
    run.wait_until(lambda: 3 in complete_checkpoints(out) and count_lines(os.path.join(out, "trainer_log.jsonl")) >= 4,
                   "checkpoint-3 + a step")
    run.kill()
    two, _ = config("elastic", 2)
    procs.start(two, "two", env=FORCE, command=ours(two)).wait_ok(600)

    ref_steps = consumed(ref_out, 0)
    got = {rank: consumed(out, rank) for rank in (0, 1)}
    assert sorted(got[0]) == sorted(ref_steps) == list(range(1, 9)) and sorted(got[1]) == list(range(4, 9))
    for step in ref_steps:
        keys_of_step = got[0][step] + (got[1][step] if step > 3 else [])
        assert sorted(keys_of_step) == sorted(ref_steps[step]), f"step {step}: other samples than the reference"
    a, b = losses(ref_out), losses(out)
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    record_property("figure", f"LLaMA-Factory, 1 -> 2 ranks: largest relative loss difference {worst:.2e}")
    assert_losses_equal(a, b, 1e-4 * max(a.values()), "[1 -> 2 ranks, killed after checkpoint-3]")
