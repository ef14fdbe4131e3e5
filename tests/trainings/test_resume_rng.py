"""A resume restores the checkpoint's RNG state where the uninterrupted run stood: with dropout and a DataLoader
worker the resumed steps draw the masks the uninterrupted run drew (the Trainer restores the state before the
loader's iterator draws its base seed from it, a draw the uninterrupted run made at step 0)."""

import os
import shutil

import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream.app.train import build_trainer
from resumable_stream.config.trainer import TrainerConfig

TINY = os.path.join(REPO_ROOT, "examples", "tiny")


def _config(tmp_path, out: str) -> TrainerConfig:
    with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].pop("consumed_log")
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    doc["model"]["config"]["attention_dropout"] = 0.3          # the masks come from the torch RNG
    doc["data"]["data_files"] = os.path.join(TINY, "data", "*.parquet")
    doc["train"].update(output_dir=str(tmp_path / out), max_steps=8, save_steps=4, logging_steps=1, dataloader_num_workers=1,
                        disable_tqdm=True)
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return TrainerConfig.from_yaml(str(path))


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.mark.slow          # trains a tiny model in-process, twice
def test_a_resumed_run_with_dropout_draws_the_masks_of_the_uninterrupted_run(tmp_path):
    whole = build_trainer(_config(tmp_path, "whole"))
    whole.train()
    os.makedirs(tmp_path / "resumed")
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    resumed = build_trainer(_config(tmp_path, "resumed"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-4"))
    expected = _losses(whole)
    assert len(set(expected.values())) == 8
    assert {s: v for s, v in _losses(resumed).items() if s > 4} == {s: expected[s] for s in range(5, 9)}
