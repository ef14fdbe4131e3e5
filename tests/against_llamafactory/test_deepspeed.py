"""DeepSpeed ZeRO-2 and ZeRO-3 checkpoints (DeepSpeed's CPU accelerator, 2 ranks, gloo) carry the stream state
and resume exactly, with `resumable-stream llamafactory train` and with `resumable-stream train`: killed after
a checkpoint and started again, the per-step losses and every rank's consumed samples are those of an
uninterrupted run. (.ci/llamafactory installs deepspeed in LLaMA-Factory's venv.)"""

from __future__ import annotations

import json
import os
import sys

import pytest
from lf_helpers import ENV, assert_losses_equal, consumed, losses, ours, write_yaml
from training_helpers import Procs, complete_checkpoints, count_lines, free_port, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
FORCE = {**ENV, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}


def _ds_config(path: str, stage: int) -> str:
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                   "zero_allow_untested_optimizer": True, "zero_optimization": zero}, f)
    return path


def _kill_after_checkpoint_and_restart(procs, config: str, out: str, command, env: dict, log_name: str) -> None:
    """``command(config)``: a fresh command line per start (a torchrun's master port is not reused)."""
    run = procs.start(config, "killed", env=env, command=command(config))
    log = os.path.join(out, log_name)
    run.wait_until(lambda: 10 in complete_checkpoints(out) and count_lines(log) >= 13, "checkpoint-10 + 3 steps")
    run.kill()
    assert os.path.isdir(os.path.join(out, "checkpoint-10", "global_step10"))     # DeepSpeed's own layout
    procs.start(config, "restart", env=env, command=command(config)).wait_ok(900)


@pytest.mark.parametrize("stage", [2, 3])
def test_llamafactory_deepspeed_zero_resumes_exactly(assets, procs, tmp_path, stage):
    model, data = assets
    ds = _ds_config(str(tmp_path / f"ds_z{stage}.json"), stage)
    keys = {"max_steps": 24, "save_steps": 10, "buffer_size": 32, "deepspeed": ds, "ddp_backend": "gloo"}
    ref, ref_out = write_yaml(str(tmp_path), "reference", model, data, consumed_log=True, **keys)
    config, out = write_yaml(str(tmp_path), "killed", model, data, consumed_log=True, **keys)
    procs.start(ref, "reference", env=FORCE, command=ours(ref)).wait_ok(900)
    _kill_after_checkpoint_and_restart(procs, config, out, ours, FORCE, "trainer_log.jsonl")
    assert_losses_equal(losses(ref_out), losses(out), 0.0, f"[ZeRO-{stage}]")
    for rank in (0, 1):
        assert consumed(ref_out, rank) == consumed(out, rank)


def test_resumable_stream_train_deepspeed_zero3_resumes_exactly(tmp_path):
    ds = _ds_config(str(tmp_path / "ds_z3.json"), 3)
    procs = Procs(str(tmp_path))
    try:
        runs = {}
        for name in ("reference", "killed"):
            runs[name] = write_config(str(tmp_path), name, max_steps=24, save_steps=10, deepspeed=ds)
        from training_helpers import TRAIN_LM as script

        def command(config):
            return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), script, config]

        (ref, ref_out), (config, out) = runs["reference"], runs["killed"]
        procs.start(ref, "reference", env=ENV, command=command(ref)).wait_ok(900)
        _kill_after_checkpoint_and_restart(procs, config, out, command, ENV, "train_log.jsonl")
        from training_helpers import consumed as rs_consumed
        from training_helpers import train_losses

        assert_losses_equal(train_losses(ref_out), train_losses(out), 0.0, "[resumable-stream train, ZeRO-3]")
        for rank in (0, 1):
            assert rs_consumed(ref_out, rank) == rs_consumed(out, rank)
    finally:
        procs.cleanup()
