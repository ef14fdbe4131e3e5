"""A bad data config is refused before the model is built (issue 49, item 7): the checks that need no model and no
network (data files and folders, the split, data.resume_state_path, train.resume_from_checkpoint) run before
anything heavy is imported and before the startup summary; what only the opened stream can tell (its columns) is
said before the tokenizer and the model load. Measured by the modules imported and the order of calls, not by
the clock (it took 16-19 s, after the summary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream.app import preflight
from resumable_stream.app.startup import startup_summary
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.errors import ConfigError, SidecarError, SourceError

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
PARQUET = os.path.join(TINY, "data", "*.parquet")
# what building a model needs and a data check does not (torch alone ~1.5 s of CPU on 2 cores)
HEAVY = ("torch", "transformers", "datasets", "accelerate")


def _trainer_yaml(tmp_path, **data) -> str:
    with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    doc["data"].update({"data_files": PARQUET, "consumed_log": None, **data})
    if "sources" in data:        # a mixture names its datasets in its sources only
        del doc["data"]["dataset_name_or_path"], doc["data"]["data_files"]
    doc["train"].update(output_dir=str(tmp_path / "run"), max_steps=2)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _train_in_a_fresh_interpreter(config: str, *overrides: str) -> tuple[int, list[str], str]:
    """`resumable-stream train CONFIG ...` through the CLI's main in a fresh interpreter: its exit code, the heavy
    modules imported by the time it returned, its stderr. (Not `-m resumable_stream train`: the fast lane's
    guard takes that for a training; this one must stop before anything trains.)"""
    script = ("import json, sys\nfrom resumable_stream.app.cli import main\n"
              f"code = main(['train', {config!r}, *{list(overrides)!r}])\n"
              f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    code, heavy = json.loads(run.stdout.strip().splitlines()[-1])
    return code, heavy, run.stderr


@pytest.mark.parametrize("overrides, says", [
    (["data.data_files=" + os.path.join(TINY, "data", "missing", "*.parquet")],
     "data.data_files '{tiny}/data/missing/*.parquet': '{tiny}/data/missing/*.parquet' matches no file for split "
     "'train'"),
    (["data.split=validation"], "data.split: got 'validation'; this dataset has the splits: train"),
    (["data.dataset_name_or_path=./no/such/folder", "data.data_files=null"],
     "data.dataset_name_or_path: got './no/such/folder'; no such file or directory"),
    (["data.resume_state_path=/no/such/state"],
     "data.resume_state_path: stream state '/no/such/state': not found"),
    (["train.resume_from_checkpoint=/no/such/checkpoint-5"], "checkpoint '/no/such/checkpoint-5': not found"),
])
def test_a_bad_data_config_is_refused_before_anything_heavy_is_imported(tmp_path, overrides, says):
    code, heavy, err = _train_in_a_fresh_interpreter(_trainer_yaml(tmp_path), *overrides)
    assert code == 2 and says.format(tiny=TINY) in err, err
    assert heavy == [], f"imported {heavy} before refusing the data"
    assert "resumable-stream train:" not in err, "the startup summary came first"


def test_each_local_data_check(tmp_path):
    def refused(error, **keys):
        with pytest.raises(error) as e:
            preflight.check_training_data(_trainer_yaml(tmp_path, **keys))
        return str(e.value)

    os.makedirs(tmp_path / "folder" / "sub")
    (tmp_path / "folder" / "sub" / "a.parquet").write_bytes(b"")
    folder = str(tmp_path / "folder")
    assert "data.data_dir: got 'nope'; no such folder in" in refused(
        SourceError, dataset_name_or_path=folder, data_files=None, data_dir="nope")
    # inside a dataset folder the patterns are the folder's (as datasets reads them)
    preflight.check_training_data(_trainer_yaml(tmp_path, dataset_name_or_path=folder, data_files="sub/*.parquet"))
    assert "'none/*.parquet' matches no file for split 'train' (looked for in" in refused(
        SourceError, dataset_name_or_path=folder, data_files="none/*.parquet")
    assert "data.split: got 'test'; this dataset has the splits: train, validation" in refused(
        ConfigError, data_files={"train": PARQUET, "validation": PARQUET}, split="test")
    assert "data.sources[1].data_files" in refused(SourceError, sources=[
        {"dataset_name_or_path": "parquet", "data_files": PARQUET},
        {"dataset_name_or_path": "parquet", "data_files": str(tmp_path / "x" / "*.parquet")}])
    assert refused(SourceError, eval={"num_samples": 4, "data_files": str(tmp_path / "x.parquet")}).startswith(
        "data.eval.data_files")
    assert "data.dataset_name_or_path: got '/no/dir'; no such directory (backend 'local'" in refused(
        SourceError, backend="local", streaming=False, dataset_name_or_path="/no/dir", data_files=None)
    (tmp_path / "state").mkdir()
    assert "data.resume_state_path: stream state" in refused(SidecarError, resume_state_path=str(tmp_path / "state"))
    # what is not local is left to the resolution: a Hub id, a remote pattern
    for keys in ({"dataset_name_or_path": "org/name", "data_files": None},
                 {"data_files": "https://example.invalid/x.parquet"}):
        preflight.check_training_data(_trainer_yaml(tmp_path, **keys))


def test_an_incomplete_checkpoint_named_by_resume_from_checkpoint_is_refused_first(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(SidecarError, match=r"checkpoint .*checkpoint-3': no trainer_state.json"):
        preflight.check_training_data(_trainer_yaml(tmp_path),
                                      [f"train.resume_from_checkpoint={tmp_path / 'checkpoint-3'}"])


def test_what_only_the_stream_can_tell_is_said_before_the_tokenizer_and_the_model_load(tmp_path, monkeypatch):
    """A text column the data does not have: found when the stream opens, which build_trainer does first."""
    from resumable_stream.app import train

    built = []
    monkeypatch.setattr(train, "_load_tokenizer", lambda cfg: built.append("tokenizer"))
    monkeypatch.setattr(train, "_load_model", lambda *a: built.append("model"))
    monkeypatch.setattr(train, "startup_summary", lambda *a: built.append("summary") or "")
    with pytest.raises(ConfigError, match=r"data.text_column: got 'body'; the dataset's columns are: "):
        train.run_training(_trainer_yaml(tmp_path, text_column="body"))
    assert built == []


def test_the_startup_summary_says_where_the_data_continues_from(tmp_path):
    args = SimpleNamespace(max_steps=4, output_dir="run", world_size=1, device="cpu", ddp_backend=None,
                           per_device_train_batch_size=8, gradient_accumulation_steps=1, dataloader_num_workers=0)
    cfg = TrainerConfig.from_yaml(_trainer_yaml(tmp_path), ["data.resume_state_path=/runs/a/checkpoint-5"])
    head = startup_summary(cfg, args, None, "1").splitlines()[0]
    assert head == ("resumable-stream train: starting at step 0 (no complete checkpoint in output_dir), 4 steps; "
                    "the data continues from data.resume_state_path /runs/a/checkpoint-5")
    assert "starting afresh" in startup_summary(TrainerConfig.from_yaml(_trainer_yaml(tmp_path)), args, None, "1")

