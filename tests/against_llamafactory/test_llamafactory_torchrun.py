"""`resumable-stream llamafactory train` on 2 CPU ranks (gloo) with LLaMA-Factory's pinned accelerate and
transformers: launched as llamafactory-cli launches (FORCE_TORCHRUN=1) and with a plain `torchrun -m`, the two
give the same training; data-parallel (the ranks end with equal parameters); killed after a checkpoint and
started again, it continues exactly (losses and every rank's consumed samples)."""

from __future__ import annotations

import json
import os
import sys

import pytest
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
