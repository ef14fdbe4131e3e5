"""A checkpoint written under MindSpore resumes under PyTorch (StreamLoader, torch collate) and the other way
round, with the same next batches and sample keys: the sidecar format is one. The PyTorch side runs in a
venv with torch (torch_side.py), this side in the MindSpore venv, which has none."""

import json
import os
import subprocess

import ms_helpers

HERE = os.path.dirname(os.path.abspath(__file__))


def torch_side(torch_python, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "_support"), ms_helpers.ROOT])}
    done = subprocess.run([torch_python, os.path.join(HERE, "torch_side.py"), str(out), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def mindspore_batches(source, n):
    return {"batches": ms_helpers.take(source.iterate(source.dataset()), n), "keys": source.pop_consumed_keys()}


def test_the_same_batches_under_both(torch_python, tmp_path):
    assert torch_side(torch_python, tmp_path, "ref", 30) == mindspore_batches(ms_helpers.mindspore_source(), 30)


def test_mindspore_checkpoint_resumes_under_pytorch(torch_python, tmp_path):
    reference = mindspore_batches(ms_helpers.mindspore_source(), 30)
    source = ms_helpers.mindspore_source()
    head = mindspore_batches(source, 13)
    source.save_sidecar(str(tmp_path / "ms_state"))
    tail = torch_side(torch_python, tmp_path, "resumed", 17, "--load", tmp_path / "ms_state")
    assert head["batches"] + tail["batches"] == reference["batches"]
    assert head["keys"] + tail["keys"] == reference["keys"]


def test_pytorch_checkpoint_resumes_under_mindspore(torch_python, tmp_path):
    reference = mindspore_batches(ms_helpers.mindspore_source(), 30)
    head = torch_side(torch_python, tmp_path, "head", 0, "--skip", 11, "--save", tmp_path / "pt_state")
    assert head["batches"] == []
    source = ms_helpers.mindspore_source()
    source.load_sidecar(str(tmp_path / "pt_state"))
    tail = mindspore_batches(source, 19)
    assert tail["batches"] == reference["batches"][11:]
    assert tail["keys"] == reference["keys"][-len(tail["keys"]):]
