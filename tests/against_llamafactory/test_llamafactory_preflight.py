"""``resumable-stream llamafactory train`` refuses bad data before LLaMA-Factory parses its arguments, loads the
tokenizer and builds the model (issue 49, item 7): a dataset that dataset_info.json does not define, a
``file_name`` that is not there, a missing dataset_info.json, our resume_state_path, resume_from_checkpoint.
Measured by the modules imported when the error comes, not by the clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from lf_helpers import ENV, write_yaml

HEAVY = ("torch", "transformers", "llamafactory.model", "llamafactory.train")


def _run(config: str) -> tuple[int, list[str], str]:
    script = ("import json, sys\nfrom resumable_stream.app.cli import main\n"
              f"code = main(['llamafactory', 'train', {config!r}])\n"
              f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **ENV})
    code, heavy = json.loads(run.stdout.strip().splitlines()[-1])
    return code, heavy, run.stderr


@pytest.fixture
def data_dir(tmp_path):
    directory = tmp_path / "data"
    directory.mkdir()
    (directory / "here.jsonl").write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
    (directory / "dataset_info.json").write_text(json.dumps({
        "here": {"file_name": "here.jsonl"}, "gone": {"file_name": "gone.jsonl"},
        "hub": {"hf_hub_url": "org/name"}}))
    return str(directory)


@pytest.mark.parametrize("keys, says", [
    ({"dataset": "gone"}, "dataset 'gone.jsonl' (dataset_info.json file_name): '{data}/gone.jsonl' not found"),
    ({"dataset": "here,nope"}, "dataset: 'nope' is not an entry of '{data}/dataset_info.json'; its entries: gone, "
                               "here, hub"),
    ({"dataset": "here", "dataset_dir": "{data}/none"}, "'{data}/none/dataset_info.json' cannot be read"),
    ({"dataset": "here", "resumable_stream": {"resume_state_path": "/no/such/state"}},
     "resumable_stream.resume_state_path: stream state '/no/such/state': not found"),
    ({"dataset": "here", "resume_from_checkpoint": "/no/such/checkpoint-4"},
     "checkpoint '/no/such/checkpoint-4': not found"),
])
def test_bad_data_is_refused_before_llamafactory_loads_anything(tmp_path, data_dir, keys, says):
    keys = {k: (v.format(data=data_dir) if isinstance(v, str) else v) for k, v in keys.items()}
    ours = keys.pop("resumable_stream", None)
    config, _ = write_yaml(str(tmp_path), "run", "/no/model/needed", data_dir, **keys)
    if ours:
        import yaml

        with open(config, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        doc["resumable_stream"] = ours
        with open(config, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f)
    code, heavy, err = _run(config)
    assert code == 2 and says.format(data=data_dir) in err, err
    assert heavy == [], f"imported {heavy} before refusing the data"


def test_remote_entries_are_left_to_llamafactory(data_dir):
    from resumable_stream.app.llamafactory import check_data

    check_data({"dataset": "here,hub", "dataset_dir": data_dir}, {})
    check_data({"dataset": "x", "dataset_dir": "ONLINE"}, {})


@pytest.mark.parametrize("text, override, says", [
    ("dataset: here\nl0: &l0 [" + ", ".join(["lol"] * 9) + "]\n" + "".join(
        f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9)), None,
     "its aliases expand"),
    ("dataset: here\nloop: &a [*a]\n", None, "holds an alias of itself"),
    ("dataset: here\n", "dataset={a: &a [*a]}", "override 'dataset={a: &a [*a]}': the node anchored"),
])
def test_a_hostile_yaml_is_refused_before_omegaconf_expands_it(tmp_path, text, override, says):
    from resumable_stream.errors import ConfigError
    from resumable_stream.integrations.llamafactory.settings import read

    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("{", r"\{").replace("*", r"\*")):
        read(str(path), [override] if override else [])
