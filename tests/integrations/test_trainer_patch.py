"""The patched transformers.Trainer: our loader, sidecars in every checkpoint, deferred rotation, no replay."""

import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from repo_paths import REPO_ROOT

from resumable_stream import SidecarError
from resumable_stream.app.train import build_trainer, resolve_resume
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.integrations import checkpoints as ck
from resumable_stream.integrations.transformers import stream_loader
from resumable_stream.loader import StreamLoader
from resumable_stream.state import output_dir

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny", "train_lm.yaml")


def _config(tmp_path, **train):
    with open(TINY, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].pop("consumed_log")
    doc["train"].update(output_dir=str(tmp_path / "out"), max_steps=12, save_steps=4, logging_steps=1,
                        disable_tqdm=True, **train)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(doc))
    # tokenizer / data paths are relative to the tiny example dir
    doc["model"]["tokenizer"] = os.path.join(ROOT, "examples", "tiny", "tokenizer")
    doc["data"]["data_files"] = os.path.join(ROOT, "examples", "tiny", "data", "*.parquet")
    p.write_text(yaml.safe_dump(doc))
    return TrainerConfig.from_yaml(str(p))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One uninterrupted 12-step run of ``_config`` (checkpoints 4, 8 and 12 kept, its consumed log in
    ``consumed/``): the run the tests below used to train first, each its own; each now takes a copy
    (``_copy_of_finished_run``) or only reads it."""
    base = tmp_path_factory.mktemp("finished_run")
    cfg = _config(base, save_total_limit=10)
    cfg = TrainerConfig(cfg.model, cfg.stream, cfg.transform.replace(consumed_log=str(base / "consumed")), cfg.train,
                        cfg.path)
    build_trainer(cfg).train()
    return base


def _copy_of_finished_run(finished_run, tmp_path, consumed_log: bool = False) -> TrainerConfig:
    """``_config(tmp_path, save_total_limit=10)`` whose output_dir holds a copy of the finished run (its
    consumed log too, and in the config, if ``consumed_log``)."""
    shutil.copytree(finished_run / "out", tmp_path / "out")
    cfg = _config(tmp_path, save_total_limit=10)
    if consumed_log:
        shutil.copytree(finished_run / "consumed", tmp_path / "consumed")
        cfg = TrainerConfig(cfg.model, cfg.stream, cfg.transform.replace(consumed_log=str(tmp_path / "consumed")),
                            cfg.train, cfg.path)
    return cfg


@pytest.mark.slow          # trains a tiny model in-process
def test_checkpoints_carry_sidecars_and_rotation_waits_for_the_manifest(tmp_path, monkeypatch):
    cfg = _config(tmp_path, save_total_limit=1)
    trainer = build_trainer(cfg)
    seen = []
    real_manifest = ck.finish

    def checking_manifest(state_dir, world_size):
        step = int(os.path.basename(os.path.dirname(state_dir)).split("-")[1])
        previous = os.path.join(cfg.train["output_dir"], f"checkpoint-{step - 4}")
        # the previous complete checkpoint must survive until this one is complete
        seen.append((step, step == 4 or os.path.isdir(previous)))
        return real_manifest(state_dir, world_size)

    monkeypatch.setattr(ck, "finish", checking_manifest)
    trainer.train()
    assert isinstance(stream_loader(trainer), StreamLoader), "the train dataloader is ours, not accelerate's"
    assert seen == [(4, True), (8, True), (12, True)]
    out = cfg.train["output_dir"]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-12"]
    state = os.path.join(out, "checkpoint-12", "stream_state")
    assert sorted(os.listdir(state)) == ["fingerprint.json", "index.bin", "manifest.json", "rank-00000.safetensors"]
    assert output_dir.is_complete(os.path.join(out, "checkpoint-12"))


@pytest.mark.slow          # trains a tiny model in-process
def test_resume_replays_no_batches(finished_run, tmp_path, monkeypatch):
    cfg = _copy_of_finished_run(finished_run, tmp_path)
    import transformers.trainer as tt

    def no_skip(*a, **k):
        raise AssertionError("the Trainer tried to replay consumed batches")

    monkeypatch.setattr(tt, "skip_first_batches", no_skip)
    cfg_more = TrainerConfig(cfg.model, cfg.stream, cfg.transform, dict(cfg.train, max_steps=16), cfg.path)
    trainer = build_trainer(cfg_more)
    checkpoint = resolve_resume(cfg_more, trainer)
    assert checkpoint.endswith("checkpoint-12")
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == 16
    # where the stream stands after 12 + 4 steps is where an uninterrupted 16-step run's stands
    whole = build_trainer(TrainerConfig(cfg.model, cfg.stream, cfg.transform,
                                        dict(cfg.train, max_steps=16, output_dir=str(tmp_path / "whole")), cfg.path))
    whole.train()
    np.testing.assert_equal(stream_loader(trainer).state_dict(), stream_loader(whole).state_dict())


@pytest.mark.slow          # trains a tiny model in-process
def test_incomplete_checkpoint_is_refused(finished_run, tmp_path):
    cfg = _copy_of_finished_run(finished_run, tmp_path)
    ckpt = os.path.join(cfg.train["output_dir"], "checkpoint-8")
    os.unlink(os.path.join(ckpt, "stream_state", "manifest.json"))
    trainer = build_trainer(cfg)
    with pytest.raises(SidecarError, match="manifest.json"):
        trainer.train(resume_from_checkpoint=ckpt)
    # the automatic choice skips it and takes the newest complete one
    assert output_dir.latest_complete_checkpoint(cfg.train["output_dir"]).endswith("checkpoint-12")
    os.unlink(os.path.join(cfg.train["output_dir"], "checkpoint-12", "stream_state", "manifest.json"))
    assert output_dir.latest_complete_checkpoint(cfg.train["output_dir"]).endswith("checkpoint-4")
    removed = output_dir.remove_incomplete_after(cfg.train["output_dir"], output_dir.latest_complete_checkpoint(cfg.train["output_dir"]))
    assert sorted(os.path.basename(p) for p in removed) == ["checkpoint-12", "checkpoint-8"]


def test_unpatched_datasets_keep_the_trainer_path(tmp_path):
    from transformers import Trainer, TrainingArguments

    from resumable_stream.integrations.transformers import patch_trainer

    patch_trainer(Trainer)

    class Tiny(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)])}

    args = TrainingArguments(output_dir=str(tmp_path / "o"), report_to="none", per_device_train_batch_size=4)
    trainer = Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=Tiny())
    loader = trainer.get_train_dataloader()
    assert not isinstance(loader, StreamLoader)
    assert len(loader) == 2


@pytest.mark.slow          # trains a tiny model in-process
def test_data_resume_state_path_continues_the_data_with_a_fresh_model(finished_run, tmp_path):
    import json

    (tmp_path / "a").mkdir()
    cfg = _copy_of_finished_run(finished_run, tmp_path / "a", consumed_log=True)     # run A
    log_a = tmp_path / "a" / "consumed"
    steps_a = [json.loads(line) for line in open(log_a / "rank-00000.jsonl")]

    log_b = tmp_path / "b" / "consumed"
    stream_b = cfg.stream.replace(resume_state_path=os.path.join(cfg.train["output_dir"], "checkpoint-4"))
    cfg_b = TrainerConfig(cfg.model, stream_b, cfg.transform.replace(consumed_log=str(log_b)),
                          dict(cfg.train, output_dir=str(tmp_path / "b" / "out"), max_steps=8), cfg.path)
    trainer = build_trainer(cfg_b)
    assert resolve_resume(cfg_b, trainer) is None          # a new run: fresh model, step 0 ...
    trainer.train()
    steps_b = [json.loads(line) for line in open(log_b / "rank-00000.jsonl")]
    # ... but the data continues where run A was at its step 4
    assert [s["samples"] for s in steps_b] == [s["samples"] for s in steps_a[4:12]]


@pytest.mark.slow          # trains a tiny model in-process
def test_checkpoint_wins_over_data_resume_state_path(finished_run, tmp_path):
    """A crash-restart of a run seeded with data.resume_state_path continues from its own checkpoint."""
    import json

    (tmp_path / "a").mkdir()
    cfg = _copy_of_finished_run(finished_run, tmp_path / "a")
    seed_state = os.path.join(cfg.train["output_dir"], "checkpoint-4")

    def run(name, max_steps):
        log = tmp_path / name / "consumed"
        c = TrainerConfig(cfg.model, cfg.stream.replace(resume_state_path=seed_state),
                          cfg.transform.replace(consumed_log=str(log)),
                          dict(cfg.train, output_dir=str(tmp_path / name / "out"), max_steps=max_steps,
                               save_total_limit=10), cfg.path)
        t = build_trainer(c)
        t.train(resume_from_checkpoint=resolve_resume(c, t))
        return [json.loads(line)["samples"] for line in open(log / "rank-00000.jsonl")]

    whole = run("whole", 12)
    run("cut", 8)                  # stops after checkpoint-8 ...
    assert run("cut", 12) == whole  # ... and the restart continues from it, not from the seed state


def test_wrong_text_column_is_a_config_error(tmp_path):
    from resumable_stream import ConfigError

    cfg = _config(tmp_path)
    cfg = TrainerConfig(cfg.model, cfg.stream, cfg.transform.replace(text_column="txt"), cfg.train, cfg.path)
    with pytest.raises(ConfigError, match="data.text_column: got 'txt'; the dataset's columns are: id, text, label"):
        build_trainer(cfg)


def test_patched_trainer_refuses_data_loading_arguments_it_would_ignore(tmp_path):
    """A user's own Trainer (patch_trainer) gets the same check as the yaml: accelerate's dispatch_batches
    would have rank 0 read for everyone, but the StreamLoader is never prepared by accelerate."""
    from resumable_stream import ConfigError

    trainer = build_trainer(_config(tmp_path))
    trainer.args.accelerator_config.dispatch_batches = True
    with pytest.raises(ConfigError, match="TrainingArguments.accelerator_config.dispatch_batches: got True"):
        trainer.get_train_dataloader()


def test_patched_trainer_refuses_ranks_that_would_each_train_their_own_model(tmp_path, monkeypatch):
    """torchrun's WORLD_SIZE=2 but accelerate not distributed (what a CPU run without use_cpu gets): refused,
    naming use_cpu, instead of every rank silently training its own copy."""
    from resumable_stream import ConfigError

    trainer = build_trainer(_config(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 processes were launched .* each rank would train its own copy. On "
                                          "CPU set use_cpu=True"):
        trainer.get_train_dataloader()


@pytest.mark.slow          # trains a tiny model in-process
def test_train_of_a_finished_run_trains_nothing_and_keeps_its_trainer_state(finished_run, tmp_path):
    """A workflow that calls save_state() after train() (LLaMA-Factory's does) must not write a state of step
    0 with an empty log over the finished run's."""
    import json

    cfg = _copy_of_finished_run(finished_run, tmp_path)
    again = build_trainer(cfg)
    out = again.train(resume_from_checkpoint=resolve_resume(cfg, again))
    assert out.global_step == 12 and again.state.global_step == 12
    again.save_state()
    with open(os.path.join(cfg.train["output_dir"], "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    assert state["global_step"] == 12 and [h["step"] for h in state["log_history"] if "loss" in h] == \
        list(range(1, 13))
