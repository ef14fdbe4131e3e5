"""Validation data (``data.eval``): a finite pass over the same ``num_samples`` examples at every
evaluation (also after a resume), its ``eval_loss`` in train_log.jsonl; misconfigurations are ConfigErrors."""

import json
import os

import pytest
import yaml
from repo_paths import REPO_ROOT
from training_helpers import StopAt

from resumable_stream import ConfigError
from resumable_stream.app.train import build_trainer, resolve_resume
from resumable_stream.config.trainer import TrainerConfig

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
EVAL = {"data_files": os.path.join(TINY, "data_notes", "*.parquet"), "shuffle": False, "num_samples": 16}


def _config(tmp_path, eval_section=EVAL, name="out", **train):
    with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].pop("consumed_log")
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    doc["data"]["data_files"] = os.path.join(TINY, "data", "*.parquet")
    if eval_section is not None:
        doc["data"]["eval"] = eval_section
    doc["train"].update(output_dir=str(tmp_path / name), max_steps=6, save_steps=2, logging_steps=1,
                        disable_tqdm=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    doc["train"].update(train)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return TrainerConfig.from_yaml(str(p))


def _evals(out):
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r}




@pytest.mark.parametrize(("change", "needle"), [
    ({"eval": None, "train": {"eval_strategy": "steps"}}, "train.eval_strategy: got 'steps' but there is no "
                                                          "validation data: add a data.eval section"),
    ({"train": {"eval_strategy": "no"}}, "data.eval: set train.eval_strategy: steps"),
    ({"train": {"eval_strategy": "epoch"}}, "train.eval_strategy: got 'epoch'; allowed: no, steps"),
    ({"eval": {**EVAL, "num_samples": 0}}, "data.eval.num_samples: got 0"),
    ({"eval": {**EVAL, "max_seq_len": 32}}, "data.eval.max_seq_len: the validation data is transformed like"),
    ({"eval": {**EVAL, "buffer_size": -1}}, "data.eval: data.buffer_size: got -1"),
    ({"eval": [1]}, "data.eval: got [1]; allowed: a mapping"),
])
def test_bad_eval_configs_are_config_errors(tmp_path, change, needle):
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, change.get("eval", EVAL), **change.get("train", {}))
    assert needle in str(e.value)


def test_num_samples_must_fill_whole_eval_batches(tmp_path):
    cfg = _config(tmp_path, {**EVAL, "num_samples": 12})
    with pytest.raises(ConfigError, match="data.eval.num_samples: got 12: 12 per rank is not a multiple of "
                                          "per_device_eval_batch_size 8"):
        build_trainer(cfg)


@pytest.mark.slow
def test_eval_is_the_same_pass_every_time_and_after_a_resume(tmp_path):
    reference = build_trainer(_config(tmp_path, name="ref"))
    reference.train()
    expected = _evals(tmp_path / "ref")
    assert sorted(expected) == [2, 4, 6]
    assert len(set(expected.values())) == 3, "the model changed between evaluations; the losses should too"
    # the same model evaluated again: the same samples, the same loss
    assert reference.evaluate()["eval_loss"] == pytest.approx(expected[6], abs=1e-6)
    passes = [[b["input_ids"].shape[0] for b in reference.get_eval_dataloader()] for _ in range(2)]
    assert passes == [[8, 8], [8, 8]], "num_samples 16 = 2 batches of per_device_eval_batch_size 8"
    first, second = ([b["input_ids"].tolist() for b in reference.get_eval_dataloader()] for _ in range(2))
    assert first == second

    cfg = _config(tmp_path, name="run")
    stopped = build_trainer(cfg)
    stopped.add_callback(StopAt(4))
    stopped.train()
    restarted = build_trainer(cfg)
    checkpoint = resolve_resume(cfg, restarted)
    assert checkpoint.endswith("checkpoint-4")
    restarted.train(resume_from_checkpoint=checkpoint)
    got = _evals(tmp_path / "run")
    assert sorted(got) == [2, 4, 6]
    assert all(abs(got[s] - expected[s]) <= 1e-6 for s in got), (got, expected)
