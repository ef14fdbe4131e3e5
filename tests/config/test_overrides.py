"""``key=value`` overrides on the command line: parsed as yaml values, validated like yaml keys, errors naming
the override as typed; relative paths from the current directory (the yaml's own: from its folder)."""

import json
import os
import shutil

import pytest
import yaml
from helpers import take_ids
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, ResumableStream, StreamConfig
from resumable_stream.app.cli import main
from resumable_stream.config.overrides import parse
from resumable_stream.config.trainer import TrainerConfig

ROOT = REPO_ROOT
TRAIN_LM = os.path.join(ROOT, "examples", "tiny", "train_lm.yaml")


@pytest.mark.parametrize(("text", "value"), [
    ("a=5", 5), ("a=true", True), ("a=[x, y]", ["x", "y"]), ("a=null", None), ("a=", ""), ("a=0.5", 0.5),
    ("a=x=y", "x=y"), ("a={b: 1}", {"b": 1}), ("a=runs/x", "runs/x")])
def test_values_are_read_as_yaml(text, value):
    assert parse(text) == ("a", value)


def test_trainer_yaml_takes_nested_overrides():
    cfg = TrainerConfig.from_yaml(TRAIN_LM, ["train.max_steps=5", "data.shuffle_seed=7", "data.packing=false",
                                             "data.eval.num_samples=8", "train.eval_strategy=steps",
                                             "train.eval_steps=2", "model.config.num_hidden_layers=1"])
    assert cfg.train["max_steps"] == 5 and cfg.stream.shuffle_seed == 7 and cfg.transform.packing is False
    assert cfg.eval_samples == 8 and cfg.model.config["num_hidden_layers"] == 1
    assert cfg.train["learning_rate"] == 0.001          # the yaml's other keys stay


@pytest.mark.parametrize(("override", "message"), [
    ("train.max_stepz=5", "override 'train.max_stepz=5': unknown key train.max_stepz; did you mean train.max_steps?"),
    ("data.shuffle_sed=7", "override 'data.shuffle_sed=7': unknown key data.shuffle_sed; did you mean "
                           "data.shuffle_seed?"),
    ("trian.max_steps=5", "override 'trian.max_steps=5': unknown key trian; did you mean train.max_steps?"),
    ("data.evl.num_samples=8", "override 'data.evl.num_samples=8': unknown key data.evl; did you mean data.eval.num_samples?"),
    ("model.dtyp=float32", "override 'model.dtyp=float32': unknown key model.dtyp; did you mean model.dtype?"),
    ("train.max_steps=-1", "override 'train.max_steps=-1': train.max_steps: got -1; allowed: an integer > 0"),
    ("data.buffer_size=big", "override 'data.buffer_size=big': data.buffer_size: got 'big'; allowed: an integer"),
    ("max_steps", "override 'max_steps': expected key=value"),
    ("=5", "override '=5': the key before '=' is empty"),
    ("train..max_steps=5", "override 'train..max_steps=5': the key before '=' is empty or has an empty part"),
    ("data.shuffle_seed=[1", "override 'data.shuffle_seed=[1': not valid yaml"),
    ("data.split.x=1", "override 'data.split.x=1': data.split is 'train' in the yaml, not a mapping"),
])
def test_a_bad_override_is_a_config_error_naming_it(override, message):
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_yaml(TRAIN_LM, [override])
    assert message in str(e.value)


def _bare_data_yaml(tmp_path, directory) -> str:
    p = tmp_path / "data_only.yaml"
    p.write_text(f"dataset_name_or_path: parquet\ndata_files: {directory}/*.parquet\nshuffle: true\n"
                 "buffer_size: 64\n")
    return str(p)


def test_a_data_only_yaml_takes_bare_keys_and_data_keys(parquet_small, tmp_path):
    path = _bare_data_yaml(tmp_path, parquet_small)
    assert StreamConfig.from_yaml(path, ["shuffle_seed=7"]).shuffle_seed == 7
    assert StreamConfig.from_yaml(path, ["data.shuffle_seed=8"]).shuffle_seed == 8
    with pytest.raises(ConfigError, match=r"override 'shuffle_sed=7': unknown key shuffle_sed; did you mean "
                                          r"shuffle_seed\?"):
        StreamConfig.from_yaml(path, ["shuffle_sed=7"])
    with pytest.raises(ConfigError, match=r"override 'train.max_steps=3': only data keys apply here"):
        StreamConfig.from_yaml(path, ["train.max_steps=3"])


def test_a_trainer_yaml_read_for_its_data_takes_only_data_keys():
    assert StreamConfig.from_yaml(TRAIN_LM, ["data.shuffle_seed=3"]).shuffle_seed == 3
    with pytest.raises(ConfigError, match=r"override 'shuffle_seed=3': only data keys apply here .*; write "
                                          r"data.shuffle_seed=3"):
        StreamConfig.from_yaml(TRAIN_LM, ["shuffle_seed=3"])
    with pytest.raises(ConfigError, match=r"override 'train.max_steps=3': only data keys apply here"):
        StreamConfig.from_yaml(TRAIN_LM, ["train.max_steps=3"])


def test_mixture_source_items_are_addressed_by_index(tmp_path, parquet_small):
    p = tmp_path / "mix.yaml"
    p.write_text(yaml.safe_dump({"data": {"sources": [
        {"dataset_name_or_path": "parquet", "data_files": f"{parquet_small}/*.parquet", "weight": 1},
        {"dataset_name_or_path": "parquet", "data_files": f"{parquet_small}/*.parquet", "weight": 1}]}}))
    assert StreamConfig.from_yaml(str(p), ["data.sources.1.weight=3"]).weights == (1, 3)
    with pytest.raises(ConfigError, match=r"override 'data.sources.1.wieght=3': unknown key data.sources.1.wieght; "
                                          r"did you mean data.sources.1.weight\?"):
        StreamConfig.from_yaml(str(p), ["data.sources.1.wieght=3"])
    with pytest.raises(ConfigError, match=r"override 'data.sources.5.weight=3': '5' is not an item of the list "
                                          r"data.sources"):
        StreamConfig.from_yaml(str(p), ["data.sources.5.weight=3"])


def test_relative_paths_yaml_from_its_folder_override_from_the_current_directory(parquet_small, tmp_path,
                                                                                   monkeypatch):
    """The yaml's data_files 'data/*.parquet' is found next to the yaml; the same text typed as an override
    is the current directory's data/ (here other files), even though the yaml's folder has a data/ too."""
    conf, cwd = tmp_path / "conf", tmp_path / "work"
    shutil.copytree(parquet_small, conf / "data")
    shutil.copytree(parquet_small, cwd / "data")
    os.remove(cwd / "data" / sorted(os.listdir(cwd / "data"))[0])     # 3 files here, 4 next to the yaml
    (conf / "c.yaml").write_text("data:\n  dataset_name_or_path: parquet\n  data_files: data/*.parquet\n")
    monkeypatch.chdir(cwd)
    from_yaml = StreamConfig.from_yaml(str(conf / "c.yaml"))
    assert from_yaml.data_files == str(conf / "data" / "*.parquet")
    overridden = StreamConfig.from_yaml(str(conf / "c.yaml"), ["data.data_files=data/*.parquet"])
    assert overridden.data_files == str(cwd / "data" / "*.parquet")
    listed = StreamConfig.from_yaml(str(conf / "c.yaml"), ["data.data_files=[data/*.parquet]"])
    assert listed.data_files == [str(cwd / "data" / "*.parquet")]
    tokenizer = os.path.join(ROOT, "examples", "tiny", "tokenizer")
    model = TrainerConfig.from_yaml(TRAIN_LM, [f"model.tokenizer={os.path.relpath(tokenizer)}"])
    assert model.model.tokenizer == tokenizer


def test_cli_takes_overrides_before_and_after_options(parquet_small, tmp_path, capsys):
    path = _bare_data_yaml(tmp_path, parquet_small)

    def ids(argv):
        assert main(argv) == 0
        return [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]

    default = ids(["peek", path, "--num", "5", "--fields", "id"])
    seven = ids(["peek", path, "shuffle_seed=7", "--num", "5", "--fields", "id"])
    assert seven == ids(["peek", path, "--num", "5", "--fields", "id", "shuffle_seed=7"]) != default
    assert seven == take_ids(ResumableStream(StreamConfig.from_yaml(path, ["shuffle_seed=7"])), 5)
    assert main(["peek", path, "shuffle_sed=7"]) == 2
    assert "override 'shuffle_sed=7': unknown key shuffle_sed; did you mean shuffle_seed?" in capsys.readouterr().err

