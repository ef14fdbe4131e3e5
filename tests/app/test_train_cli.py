"""``resumable-stream train``: overrides on the command line, the startup summary, the final model and the
run's results in output_dir (also after a resume with nothing left to train), per-run paths under output_dir,
no tied-weights warning on resume, threads."""

import logging
import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
from repo_paths import REPO_ROOT
from safetensors.torch import load_file
from training_helpers import consumed, run_results, train_losses, write_config

from resumable_stream.app.startup import quiet_tied_weights, startup_summary
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.runtime import threads

TINY_QWEN3 = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128,
              "tie_word_embeddings": True}


def _train(procs, config, label, *overrides):
    """`resumable-stream train CONFIG key=value ...` in the config's folder (relative override paths: there)."""
    return procs.start(config, label, command=[sys.executable, "-m", "resumable_stream", "train", config,
                                               *overrides]).wait_ok()


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def _mtimes(top):
    return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
            for root, _, names in os.walk(top) for name in names}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_train_takes_overrides_prints_a_summary_and_saves_the_final_model(procs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, _ = write_config(str(tmp_path), "yaml_out", max_steps=50, save_steps=50)
    out = str(tmp_path / "run")          # train.output_dir=run below: relative to the current directory
    # data.consumed_log true (as the example yamls have it): output_dir/consumed, whatever output_dir is given
    common = ["train.output_dir=run", "train.save_steps=2", "data.shuffle_seed=7", "data.consumed_log=true"]
    first = _train(procs, config, "first", "train.max_steps=4", *common)
    err = first.stderr
    assert "resumable-stream train: starting afresh (no complete checkpoint in output_dir), 4 steps" in err, err
    assert f"output_dir {out}" in err and "1 rank on cpu" in err and "OMP_NUM_THREADS=1" in err
    assert "shuffle seed 7, buffer 256" in err and "batch size per device 8" in err
    assert "cache_dir off" in err and "prefetch_blocks adaptive" in err and "dataloader_num_workers 0" in err
    assert sorted(train_losses(out)) == [1, 2, 3, 4] and not os.path.exists(tmp_path / "yaml_out")
    assert sorted(consumed(out)) == [1, 2, 3, 4]
    # the end of an HF / LLaMA-Factory run: save_state and save_metrics("train", ...) in output_dir
    results = run_results(out)
    state = results["trainer_state.json"]
    assert state["global_step"] == 4 and [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    assert results["train_results.json"]["epoch"] == 1.0 and "train_loss" in results["train_results.json"]
    assert results["all_results.json"] == results["train_results.json"]

    final = _weights(out)       # the final model and tokenizer, loadable; the weights of the last step
    assert _same(final, _weights(os.path.join(out, "checkpoint-4")))
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(out).eos_token is not None

    os.remove(os.path.join(out, "model.safetensors"))   # a rerun with nothing left to train writes it again
    again = _train(procs, config, "again", "train.max_steps=4", *common)
    assert "resuming from run/checkpoint-4 (step 4 of 4)" in again.stderr, again.stderr
    assert _same(_weights(out), final), "not the checkpoint's model"
    assert run_results(out) == results, "a rerun that trained nothing replaced the results of the run that did"

    more = _train(procs, config, "more", "train.max_steps=6", *common)
    assert "resuming from run/checkpoint-4 (step 4 of 6)" in more.stderr
    assert "missing keys" not in more.stderr, more.stderr          # lm_head.weight: tied to the embeddings
    assert sorted(train_losses(out)) == [1, 2, 3, 4, 5, 6]
    assert _same(_weights(out), _weights(os.path.join(out, "checkpoint-6")))
    assert sorted(consumed(out)) == [1, 2, 3, 4, 5, 6]
    state = run_results(out)["trainer_state.json"]   # the epoch goes on from the checkpoint: 5/6, 6/6
    assert [(h["step"], h["epoch"]) for h in state["log_history"] if "loss" in h][-2:] == [(5, 5 / 6), (6, 1.0)]

    # another output_dir, the same yaml and overrides: nothing of the first run is written again
    before = _mtimes(out)
    _train(procs, config, "other", "train.max_steps=2", *[o for o in common if "output_dir" not in o],
           "train.output_dir=run2")
    assert sorted(consumed(str(tmp_path / "run2"))) == [1, 2]
    after = _mtimes(out)
    assert after == before, "a run with another output_dir wrote into the first run's"


def _missing_warning(keys):
    return f"There were missing keys in the checkpoint model loaded: {keys}."


def test_only_the_tied_weights_missing_keys_warning_is_hidden(caplog):
    """Transformers' warning (its text, on its logger) is dropped when every missing key is tied to another
    weight; a genuinely missing weight is still reported."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_QWEN3))
    logger = logging.getLogger("transformers.trainer")
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"), quiet_tied_weights(model):
        logger.warning(_missing_warning(["lm_head.weight"]))
        logger.warning(_missing_warning(["model.norm.weight"]))
        logger.warning(_missing_warning(["lm_head.weight", "model.layers.0.mlp.up_proj.weight"]))
    shown = [r.getMessage() for r in caplog.records]
    assert shown == [_missing_warning(["model.norm.weight"]),
                     _missing_warning(["lm_head.weight", "model.layers.0.mlp.up_proj.weight"])]
    caplog.clear()
    untied = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_QWEN3, "tie_word_embeddings": False}))
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"), quiet_tied_weights(untied):
        logger.warning(_missing_warning(["lm_head.weight"]))
    assert len(caplog.records) == 1            # not tied here: really missing


def test_trainer_threads_are_the_cores_per_local_process_unless_the_user_set_them(monkeypatch):
    before = torch.get_num_threads()
    try:
        for name in threads.USER_SETTINGS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        described = threads.set_trainer_threads()
        assert torch.get_num_threads() == max(1, threads.cores() // 2)
        assert f"({threads.cores()} cores / 2 local processes)" in described
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert threads.set_trainer_threads() == "3 (OMP_NUM_THREADS=3)" and torch.get_num_threads() == 3
        threads.worker_threads(0)
        assert torch.get_num_threads() == 3             # the user's choice, also in workers
        monkeypatch.delenv("OMP_NUM_THREADS")
        threads.worker_threads(0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_startup_summary_names_the_metrics_url():
    yaml_path = os.path.join(REPO_ROOT, "examples", "tiny", "train_lm.yaml")
    args = SimpleNamespace(max_steps=4, output_dir="run", world_size=1, device="cpu", ddp_backend=None,
                           per_device_train_batch_size=8, gradient_accumulation_steps=1, dataloader_num_workers=0)

    def summary(*overrides):
        return startup_summary(TrainerConfig.from_yaml(yaml_path, overrides), args, None, "1").splitlines()

    assert "  metrics endpoint off (data.metrics_port)" in summary()
    assert "  metrics http://127.0.0.1:9400/metrics (served on 127.0.0.1)" in summary(
        "data.metrics_port=9400", "data.metrics_addr=127.0.0.1")
    assert f"  metrics http://{socket.gethostname()}:9400/metrics (served on 0.0.0.0, every IPv4 interface)" in \
        summary("data.metrics_port=9400")
    args.world_size = 2
    assert "  metrics http://[::1]:9400/metrics (served on ::1; another rank on the port + its local rank)" in \
        summary("data.metrics_port=9400", "data.metrics_addr=::1")
