"""examples/train_lm_mindspore.py, MindSpore's own layers on the CPU: SIGKILLed after a checkpoint and
restarted, it consumes exactly the samples of an uninterrupted run, step by step."""

import os

import yaml
from training_helpers import TINY, checkpoint_steps, consumed


def write_config(tmp_path, name: str, max_steps: int, save_steps: int) -> tuple[str, str]:
    with open(os.path.join(TINY, "train_lm_mindspore.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    out = str(tmp_path / name)
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    doc["data"].update(data_files=os.path.join(TINY, "data", "*.parquet"), consumed_log=os.path.join(out, "consumed"),
                       id_column="id")
    doc["train"].update(output_dir=out, max_steps=max_steps, save_steps=save_steps)
    path = str(tmp_path / f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path, out


def logged_steps(out: str) -> int:
    """Lines of the consumed log so far (the last one may still be half written)."""
    path = os.path.join(out, "consumed", "rank-00000.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.endswith("\n"))


def test_killed_and_resumed_consumes_the_same_samples(procs, tmp_path):
    steps, every = 30, 10
    ref_cfg, ref_out = write_config(tmp_path, "ref", steps, every)
    cfg, out = write_config(tmp_path, "killed", steps, every)
    reference = procs.start(ref_cfg, "ref")
    victim = procs.start(cfg, "victim")
    # killed once its first checkpoint is complete and it trained past it (those steps are lost and redone)
    victim.wait_until(lambda: checkpoint_steps(out) and logged_steps(out) >= every + 3, "a checkpoint and 3 steps")
    victim.kill()
    assert victim.proc.returncode == -9
    resumed = procs.start(cfg, "resumed")
    reference.wait_ok()
    resumed.wait_ok()
    assert "resumed from" in resumed.stdout and "done at step 30" in resumed.stdout
    want, got = consumed(ref_out), consumed(out)
    assert sorted(want) == list(range(1, steps + 1))
    assert got == want
    assert all(len(keys) >= 8 for keys in want.values())     # 8 packed rows a step, each of >= 1 sample
