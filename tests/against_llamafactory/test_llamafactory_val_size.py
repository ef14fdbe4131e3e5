"""``val_size: N`` under `resumable-stream llamafactory train` (issue 38 item 3): the first N rows of the dataset
are LLaMA-Factory's evaluation set, the training stream never yields them, and a resume stays exact."""

from __future__ import annotations

import json
import os

import pytest
from lf_helpers import ENV, assert_losses_equal, consumed, llamafactory_cli, losses, ours, write_yaml
from training_helpers import complete_checkpoints, count_lines

from resumable_stream.errors import ConfigError
from resumable_stream.integrations.llamafactory.held_out import check_val_size

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _eval_losses(out: str) -> dict[int, float]:
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        return {h["step"]: h["eval_loss"] for h in json.load(f)["log_history"] if "eval_loss" in h}


def test_val_size_gives_the_train_and_eval_losses_of_llamafactory_cli(assets, procs, tmp_path):
    """Shuffling off on both sides: llamafactory-cli evaluates on ``take(10)`` and trains on ``skip(10)`` of its
    stream; ours must evaluate on the same 10 rows and train on the same rest (equal per-step and eval losses)."""
    model, data = assets
    keys = {"val_size": 10, "eval_strategy": "steps", "eval_steps": 10, "per_device_eval_batch_size": 4,
            "do_eval": True}
    cli_yaml, cli_out = write_yaml(str(tmp_path), "cli", model, data, streaming=True, **keys)
    our_yaml, our_out = write_yaml(str(tmp_path), "ours", model, data, **keys)
    procs.start(cli_yaml, "cli", env=ENV, command=llamafactory_cli(cli_yaml)).wait_ok(600)
    procs.start(our_yaml, "ours", env=ENV, command=ours(our_yaml)).wait_ok(600)
    assert sorted(_eval_losses(our_out)) == [10, 20]
    assert_losses_equal(_eval_losses(cli_out), _eval_losses(our_out), 1e-6, "[eval_loss, val_size 10]")
    assert_losses_equal(losses(cli_out), losses(our_out), 1e-6, "[train loss, val_size 10]")


def test_held_out_rows_are_never_trained_on_and_a_kill_resumes_exactly(assets, procs, tmp_path):
    """``other`` has 80 rows (one jsonl file: shard 0): val_size 10 holds out rows 0..9; 40 steps of 2 samples,
    shuffled, read past the end of the 70 rows left, so the second epoch is checked too. SIGKILLed after
    checkpoint-10 and started again: the same losses (train and eval) and consumed samples as an uninterrupted
    run; then another val_size on that output_dir is a mismatch naming it."""
    model, data = assets
    keys = {"dataset": "other", "val_size": 10, "buffer_size": 16, "max_steps": 40, "save_steps": 10,
            "eval_strategy": "steps", "eval_steps": 20, "per_device_eval_batch_size": 4}
    ref_yaml, ref_out = write_yaml(str(tmp_path), "reference", model, data, consumed_log=True, **keys)
    procs.start(ref_yaml, "reference", env=ENV, command=ours(ref_yaml)).wait_ok(600)
    held_out = {f"0:{r}" for r in range(10)}
    trained = [k for step in consumed(ref_out).values() for k in step]
    assert len(trained) == 80 and not held_out & set(trained)
    assert set(trained) == {f"0:{r}" for r in range(10, 80)}        # every other row, in both epochs

    config, out = write_yaml(str(tmp_path), "killed", model, data, consumed_log=True, **keys)
    log = os.path.join(out, "trainer_log.jsonl")
    run = procs.start(config, "killed", env=ENV, command=ours(config))
    run.wait_until(lambda: 10 in complete_checkpoints(out) and count_lines(log) >= 13, "checkpoint-10 + 3 steps")
    run.kill()
    restart = procs.start(config, "restart", env=ENV, command=ours(config)).wait_ok(600)
    assert f"Resuming training from {os.path.join(out, 'checkpoint-10')}." in restart.stdout + restart.stderr
    assert_losses_equal(losses(ref_out), losses(out), 0.0, "[killed, val_size]")
    assert_losses_equal(_eval_losses(ref_out), _eval_losses(out), 0.0, "[eval after resume, val_size]")
    assert sorted(_eval_losses(out)) == [20, 40]
    assert consumed(ref_out) == consumed(out)

    other = procs.start(config, "other", env=ENV, command=ours(config, "max_steps=50", "val_size=12"))
    assert other.wait(600) == 2, other.describe()
    assert "transform.held_out.val_size: saved 10, now 12" in other.stderr, other.describe()


@pytest.mark.parametrize(("keys", "message"), [
    ({"val_size": 0.1}, "val_size: got 0.1; not supported by resumable-stream llamafactory: a fraction"),
    ({"val_size": 10, "eval_dataset": "other"}, "val_size: got 10; not supported by resumable-stream "
                                                "llamafactory: given with eval_dataset 'other'"),
    ({"val_size": 10, "dataset": "alpaca,other", "mix_strategy": "interleave_under"},
     "val_size: got 10; not supported by resumable-stream llamafactory: with mix_strategy 'interleave_under'"),
])
def test_val_size_that_cannot_be_exact_is_refused_naming_it(assets, procs, tmp_path, keys, message):
    model, data = assets
    config, _ = write_yaml(str(tmp_path), "refused", model, data, **keys)
    run = procs.start(config, "refused", env=ENV, command=ours(config))
    assert run.wait(300) == 2, run.describe()
    assert message in run.stderr, run.describe()


@pytest.mark.parametrize("value", [-1, 2.5, "10", True])
def test_val_size_other_than_an_integer_is_refused(value):
    with pytest.raises(ConfigError, match=r"val_size: got .*allowed: an integer >= 1"):
        check_val_size({"val_size": value})


def test_val_size_as_llamafactory_reads_it():
    assert check_val_size({}) == 0 and check_val_size({"val_size": 0.0}) == 0      # its default: no split
    assert check_val_size({"val_size": 10.0, "dataset": "a,b"}) == 10             # concat: one dataset
