"""The preference stages (issue 38 item 2) against the real llamafactory 0.9.5: ``stage: dpo`` / ``rm``
(pairwise rows, ``ranking: true``) and ``kto`` (a ``kto_tag`` column) through LLaMA-Factory's pairwise /
feedback processors, its collators and its trainers (CustomDPOTrainer, PairwiseTrainer, CustomKTOTrainer):
per-step losses equal to llamafactory-cli's with shuffling off; shuffled, SIGKILLed after a checkpoint and
started again, the same losses and samples as an uninterrupted run; ``ppo`` refused with the reason."""

from __future__ import annotations

import os

import pytest
from lf_helpers import ENV, assert_losses_equal, consumed, llamafactory_cli, losses, ours, write_yaml
from training_helpers import complete_checkpoints, count_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LORA = {"finetuning_type": "lora", "lora_rank": 4, "lora_target": "all"}
STAGES = {
    # DPO with LoRA (the reference is the model without its adapter), on multi-turn sharegpt pairs
    "dpo": {"stage": "dpo", "dataset": "pairs_sharegpt", **LORA},
    # KTO in full fine-tuning (a reference model loaded beside it); chunks of 6 rows make its KL pairs, so a
    # checkpoint falls inside a chunk
    "kto": {"stage": "kto", "dataset": "feedback", "preprocessing_batch_size": 6},
    # a reward model: LoRA, as LLaMA-Factory resumes only that (it does not resume a full / freeze rm)
    "rm": {"stage": "rm", "dataset": "pairs", **LORA},
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_per_step_losses_equal_those_of_llamafactory_cli(assets, procs, tmp_path, stage):
    model, data = assets
    keys = {**STAGES[stage], "max_steps": 12, "save_steps": 12}
    cli_yaml, cli_out = write_yaml(str(tmp_path), "cli", model, data, streaming=True, **keys)
    our_yaml, our_out = write_yaml(str(tmp_path), "ours", model, data, **keys)
    procs.start(cli_yaml, "cli", env=ENV, command=llamafactory_cli(cli_yaml)).wait_ok(600)
    procs.start(our_yaml, "ours", env=ENV, command=ours(our_yaml)).wait_ok(600)
    reference = losses(cli_out)
    assert len(reference) == 12 and len(set(reference.values())) > 1
    assert_losses_equal(reference, losses(our_out), 1e-6, f"[{stage}]")
    assert os.path.isdir(os.path.join(our_out, "checkpoint-12", "stream_state"))


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_sigkilled_run_started_again_continues_exactly(assets, procs, tmp_path, stage):
    model, data = assets
    keys = {**STAGES[stage], "max_steps": 20, "save_steps": 8, "buffer_size": 32}
    ref_yaml, ref_out = write_yaml(str(tmp_path), "reference", model, data, consumed_log=True, **keys)
    procs.start(ref_yaml, "reference", env=ENV, command=ours(ref_yaml)).wait_ok(600)
    config, out = write_yaml(str(tmp_path), "killed", model, data, consumed_log=True, **keys)
    log = os.path.join(out, "trainer_log.jsonl")
    run = procs.start(config, "killed", env=ENV, command=ours(config))
    run.wait_until(lambda: 8 in complete_checkpoints(out) and count_lines(log) >= 11, "checkpoint-8 + 3 steps")
    run.kill()
    assert count_lines(log) < 21
    restart = procs.start(config, "restart", env=ENV, command=ours(config)).wait_ok(600)
    printed = restart.stdout + restart.stderr
    assert f"Resuming training from {os.path.join(out, 'checkpoint-8')}." in printed
    assert "Will skip the first" not in printed                   # no batch is replayed
    assert_losses_equal(losses(ref_out), losses(out), 0.0, f"[{stage} killed after checkpoint-8]")
    assert consumed(ref_out) == consumed(out)
    assert sorted(consumed(out)) == list(range(1, 21))


@pytest.mark.parametrize(("keys", "message"), [
    ({"stage": "ppo", "dataset": "alpaca", "reward_model": "x"}, "stage: got 'ppo'"),
    ({"stage": "dpo", "dataset": "alpaca"}, "dataset 'alpaca.jsonl' (dataset_info.json): got ranking: false"),
    ({"stage": "sft", "dataset": "pairs"}, "dataset 'pairs.jsonl' (dataset_info.json): got ranking: true"),
    ({"stage": "kto", "dataset": "alpaca"}, "dataset 'alpaca.jsonl' (dataset_info.json): no kto_tag column"),
])
def test_what_a_preference_stage_cannot_take_is_refused_naming_it(assets, procs, tmp_path, keys, message):
    model, data = assets
    config, _ = write_yaml(str(tmp_path), "refused", model, data, **keys)
    run = procs.start(config, "refused", env=ENV, command=ours(config))
    assert run.wait(300) == 2, run.describe()
    assert message in run.stderr, run.describe()


def test_dpo_on_two_ranks_killed_after_a_checkpoint_continues_exactly(assets, procs, tmp_path):
    """FORCE_TORCHRUN=1 on 2 CPU ranks (gloo): every rank's samples and the losses of a killed and restarted run
    are those of an uninterrupted one, and the ranks read different samples."""
    model, data = assets
    force = {**ENV, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    keys = {**STAGES["dpo"], "max_steps": 12, "save_steps": 4, "buffer_size": 16, "ddp_backend": "gloo"}
    ref_yaml, ref_out = write_yaml(str(tmp_path), "reference", model, data, consumed_log=True, **keys)
    procs.start(ref_yaml, "reference", env=force, command=ours(ref_yaml)).wait_ok(600)
    config, out = write_yaml(str(tmp_path), "killed", model, data, consumed_log=True, **keys)
    run = procs.start(config, "killed", env=force, command=ours(config))
    log = os.path.join(out, "trainer_log.jsonl")
    run.wait_until(lambda: 4 in complete_checkpoints(out) and count_lines(log) >= 7, "checkpoint-4 + 3 steps")
    run.kill()
    procs.start(config, "restart", env=force, command=ours(config)).wait_ok(600)
    assert_losses_equal(losses(ref_out), losses(out), 0.0, "[dpo, 2 ranks, killed after checkpoint-4]")
    for rank in (0, 1):
        assert consumed(ref_out, rank) == consumed(out, rank)
    assert set(consumed(out, 0)[1]).isdisjoint(consumed(out, 1)[1])
