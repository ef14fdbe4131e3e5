"""Every command that takes a yaml (peek, index, warmup, train) checks every key of it as train does, with the
same ConfigError and exit 2, also the keys the command does not use; model.config problems and local model
paths that do not exist are ConfigErrors too, found before anything loads."""

import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream.app.cli import main

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
COMMANDS = {"peek": ["peek", "{cfg}", "--num", "1"], "index": ["index", "{cfg}", "-o", "{tmp}/index.json"],
            "warmup": ["warmup", "{cfg}", "--samples", "1", "--no-progress"],
            "train": ["train", "{cfg}", "train.output_dir={tmp}/run"]}


def _trainer_doc():
    with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    doc["data"].update(data_files=os.path.join(TINY, "data", "*.parquet"), consumed_log=None)
    return doc


def _run(capsys, tmp_path, command, doc, *overrides):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    argv = [*(a.format(cfg=cfg, tmp=tmp_path) for a in COMMANDS[command]), *overrides]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    return code, err.strip()


def _edit(doc, dotted, value):
    node = doc
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return doc


# (how the problem is given, the error every command prints)
OVERRIDES = [
    ("data.max_seq_len=[1,2]", "override 'data.max_seq_len=[1,2]': data.max_seq_len: got [1, 2]; allowed: an "
                               "integer from 8 to 1000000 (tokens)"),
    ("data.packing=[1,2]", "override 'data.packing=[1,2]': data.packing: got [1, 2]; allowed: true or false"),
    ("data.format=txt", "override 'data.format=txt': data.format: got 'txt'; allowed: one of text, messages, vl, "
                        "alpaca, sharegpt"),
    ("data.metrics_port=0", "override 'data.metrics_port=0': data.metrics_port: got 0; allowed: null or a port"),
]
IN_THE_YAML = [
    ("model.config.hidden_size", "abc", "model.config.hidden_size: got 'abc'; allowed: int (the qwen3 config's "
                                        "type)"),
    ("model.config.model_type", "qwen4", "model.config.model_type: got 'qwen4'; allowed: a model type of "
                                         "transformers (e.g. qwen3, llama) (did you mean qwen3"),
    ("model.config.hidden_size", -1, "model.config: model_type 'qwen3' with these fields does not make an "
                                     "AutoModelForCausalLM model (RuntimeError: Trying to create tensor with "
                                     "negative dimension -1"),
    ("model.tokenizer", "/nonexistent/tokenizer", "model.tokenizer: got '/nonexistent/tokenizer': no such file or "
                                                  "directory"),
    ("model.name_or_path", "./no/such/model", "model.name_or_path: got './no/such/model': no such file or "
                                              "directory"),
    ("model.dtype", "fp8", "model.dtype: got 'fp8'; allowed: auto, float32, bfloat16, float16"),
    ("train.lr_scheduler_type", "sideways", "train.lr_scheduler_type: got 'sideways'; allowed: linear, cosine,"),
    ("train.max_steps", 0, "train.max_steps: got 0; allowed: an integer > 0"),
    ("train.learning_rat", 0.1, "train.learning_rat: unknown key; did you mean 'learning_rate'?"),
    ("data.eval", {"num_samples": 0}, "data.eval.num_samples: got 0; allowed: an integer > 0"),
]


@pytest.mark.parametrize(("given", "error"), OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_every_command_refuses_a_bad_data_override_as_train_does(capsys, tmp_path, given, error):
    for command in COMMANDS:
        code, err = _run(capsys, tmp_path, command, _trainer_doc(), given)
        assert code == 2 and err.startswith(f"resumable-stream: error: {error}"), (command, err)
        assert len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "index.json") and not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(("key", "value", "error"), IN_THE_YAML, ids=[f"{k}={v}" for k, v, _ in IN_THE_YAML])
def test_every_command_checks_every_section_of_the_yaml(capsys, tmp_path, key, value, error):
    """A key peek / index / warmup do not use (model.*, train.*) is checked all the same."""
    for command in COMMANDS:
        started = time.monotonic()
        code, err = _run(capsys, tmp_path, command, _edit(_trainer_doc(), key, value))
        assert code == 2 and err.startswith(f"resumable-stream: error: {error}"), (command, err)
        assert time.monotonic() - started < 30, "no hub retries for a local path"
    assert not os.path.exists(tmp_path / "index.json") and not os.path.exists(tmp_path / "run")


def test_a_yaml_of_data_keys_is_checked_whole_and_a_trainer_yaml_has_only_its_sections(capsys, tmp_path):
    data = _trainer_doc()["data"]
    for command in ("peek", "index", "warmup"):
        code, err = _run(capsys, tmp_path, command, {**data, "packing": "yes"})
        assert (code, err) == (2, "resumable-stream: error: data.packing: got 'yes'; allowed: true or false")
        code, err = _run(capsys, tmp_path, command, {"data": data, "modle": {}})
        assert (code, err) == (2, "resumable-stream: error: config.modle: unknown key; did you mean 'model'?")


def test_a_valid_trainer_yaml_still_peeks_and_indexes(capsys, tmp_path):
    code, _ = _run(capsys, tmp_path, "peek", _trainer_doc())
    assert code == 0
    code, _ = _run(capsys, tmp_path, "index", _trainer_doc())
    assert code == 0 and os.path.isfile(tmp_path / "index.json")


def test_a_train_refused_after_it_took_the_output_dir_leaves_no_directory(capsys, tmp_path):
    """A tokenizer that does not load is found after the lock was taken (it creates the output_dir)."""
    (tmp_path / "not_a_tokenizer").mkdir()
    doc = _edit(_trainer_doc(), "model.tokenizer", str(tmp_path / "not_a_tokenizer"))
    code, err = _run(capsys, tmp_path, "train", doc, f"train.output_dir={tmp_path}/runs/a")
    assert code == 2 and "model.tokenizer: " in err and "cannot be loaded as a tokenizer" in err, err
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "run")


@pytest.mark.slow    # not a training, but the lane guard takes any `resumable_stream train` for one
def test_train_refuses_a_bad_key_before_it_imports_torch_or_transformers(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_edit(_trainer_doc(), "model.tokenizer", "/nonexistent/tokenizer")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "resumable_stream", "train", str(cfg),
                        f"train.output_dir={tmp_path}/run"], capture_output=True, text=True, timeout=120, env=env)
    imported = {m.group(1).split(".")[0] for m in re.finditer(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", r.stderr)}
    assert r.returncode == 2 and "model.tokenizer: got '/nonexistent/tokenizer': no such file" in r.stderr
    assert "resumable_stream" in imported and not imported & {"torch", "transformers", "datasets", "pyarrow"}
    assert not os.path.exists(tmp_path / "run")
