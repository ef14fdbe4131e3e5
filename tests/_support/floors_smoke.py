"""Smoke test for the dependency floors: run by ``.ci/floors`` in a venv holding exactly the lower bounds
pyproject.toml declares for datasets / transformers / accelerate / torch (plain python, no pytest).

    python tests/_support/floors_smoke.py WORKDIR

1. a shuffled stream read by ``python -m resumable_stream peek`` in new processes: 30 samples, the state
   saved, then 20 more resumed from it, equal the first 50 of one uninterrupted peek;
2. the tiny LM trained 4 steps uninterrupted, and 2 steps (a checkpoint) then restarted to 4: same samples
   and losses at every step;
3. one step of the tiny vision-language model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(args)}\n{r.stderr[-4000:]}")
    return r.stdout


def peek(*args: str) -> list:
    out = run("-m", "resumable_stream", "peek", os.path.join(TINY, "stream.yaml"), "--fields", "id", *args)
    return [json.loads(line)["id"] for line in out.splitlines()]


def write(work: str, template: str, name: str, max_steps: int, **data) -> tuple[str, str]:
    with open(os.path.join(TINY, template), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    out = os.path.join(work, name)
    for key in ("tokenizer", "processor"):
        if key in doc["model"]:
            doc["model"][key] = os.path.join(TINY, doc["model"][key])
    doc["data"].update(data_files=os.path.join(TINY, doc["data"]["data_files"]),
                       consumed_log=os.path.join(out, "consumed"), **data)
    doc["train"].update(output_dir=out, max_steps=max_steps, save_steps=2, logging_steps=1, disable_tqdm=True,
                        per_device_train_batch_size=4, save_total_limit=1)   # rotation runs too
    text = doc["model"]["config"].get("text_config", {})
    if "rope_parameters" in text and int(transformers_version().split(".")[0]) < 5:
        rope = dict(text["rope_parameters"])   # transformers 4.x names them rope_theta + rope_scaling
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope
    path = os.path.join(work, f"{name}-{max_steps}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path, out


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def lines(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def main(work: str) -> None:
    import accelerate
    import datasets
    import torch
    import transformers

    print(f"versions: torch {torch.__version__}, datasets {datasets.__version__}, transformers "
          f"{transformers.__version__}, accelerate {accelerate.__version__}")

    state = os.path.join(work, "peek-state")
    whole = peek("--num", "50")
    head = peek("--num", "30", "--save-state", state)
    tail = peek("--num", "20", "--resume-from", state)
    assert head + tail == whole, "peek: the resumed samples differ from the uninterrupted ones"
    print("1. shuffled stream resumed exactly in a new process (peek)")

    config, ref = write(work, "train_lm.yaml", "ref", 4)
    run("-m", "resumable_stream", "train", config)
    first, out = write(work, "train_lm.yaml", "restarted", 2)
    run("-m", "resumable_stream", "train", first)
    second, _ = write(work, "train_lm.yaml", "restarted", 4)
    run("-m", "resumable_stream", "train", second)
    for name in ("consumed/rank-00000.jsonl", "train_log.jsonl"):
        a, b = lines(os.path.join(ref, name)), lines(os.path.join(out, name))
        assert sorted(a) == sorted(b) == [1, 2, 3, 4], f"{name}: steps {sorted(a)} / {sorted(b)}"
        for step in a:
            if "loss" in a[step]:
                assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-6, f"step {step}: loss {a[step]} / {b[step]}"
            else:
                assert a[step] == b[step], f"{name} step {step}: {a[step]} / {b[step]}"
    # the Trainer's epoch after the resume is the uninterrupted run's (a run of 4 steps: N / 4), also where
    # transformers' skip of trained batches is accelerate's skip_first_batches (4.x)
    epochs = [{s: r["epoch"] for s, r in lines(os.path.join(d, "train_log.jsonl")).items()} for d in (ref, out)]
    assert [epochs[0][s] for s in (3, 4)] == [epochs[1][s] for s in (3, 4)] == [0.75, 1.0], f"epochs {epochs}"
    for name in ("trainer_state.json", "train_results.json", "all_results.json"):   # save_state / save_metrics
        assert os.path.isfile(os.path.join(out, name)), f"{name}: missing in {out}"
    assert os.path.isdir(os.path.join(out, "checkpoint-4", "stream_state"))
    assert not os.path.exists(os.path.join(out, "checkpoint-2")), "checkpoint-2 was not rotated away"
    print("2. tiny LM: 2 steps + restart to 4 = 4 uninterrupted steps (samples, losses, epochs), old checkpoint "
          "rotated, the run's results in output_dir")

    config, out = write(work, "train_vl.yaml", "vl", 1)
    run("-m", "resumable_stream", "train", config)
    assert sorted(lines(os.path.join(out, "train_log.jsonl"))) == [1]
    print("3. tiny VL model: one training step")
    print("floors smoke: OK")


if __name__ == "__main__":
    main(sys.argv[1])
