#!/usr/bin/env python
"""Restart cost with LLaMA-Factory: `llamafactory-cli train` (it replays every consumed batch) against
`resumable-stream llamafactory train` (it restores the stream's cursor), after checkpoint-N for N = 500 and 2000.

The same generated alpaca data (8,000 rows of ~400 words each, jsonl: what a replay costs is reading and
tokenizing the rows again, so they are long; cutoff_len 64 keeps the training steps cheap), the same tiny
random-init Qwen3 and yaml (template qwen, streaming, buffer_size 1, one DataLoader worker, batch 4), CPU. Each tool trains 2,000 steps once, saving every
500; then, for each N, a fresh output_dir holding only checkpoint-N is resumed for one more step, in a new
process, timed from the process start and from the call of ``trainer.train()`` to the end of step N + 1.
Run it in the venv of .ci/llamafactory:

    .venv-llamafactory/bin/python benchmarks/llamafactory_resume.py [--steps 500,2000] [--format jsonl|parquet]
        [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "against_llamafactory"))

from lf_helpers import ENV, make_model, write_yaml  # noqa: E402

ROWS, WORDS, BATCH = 8000, 400, 4
_WORDS = "stream resume shard window cursor epoch rank worker sample token batch model data order".split()


def _data(directory: str, fmt: str = "jsonl") -> str:
    """The alpaca rows as one jsonl file, or one parquet file of row groups of 1,000 rows."""
    os.makedirs(directory, exist_ok=True)
    rows = []
    for i in range(ROWS):
        words = " ".join(_WORDS[(i * 7 + j * 5) % len(_WORDS)] for j in range(WORDS + i % 7))
        rows.append({"instruction": f"Task {i}: {words}", "input": "", "output": f"Done {i}. {words}"})
    name = f"alpaca.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), os.path.join(directory, name), row_group_size=1000)
    else:
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(directory, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({"alpaca": {"file_name": name}}, f)
    return directory


def _child(tool: str, config: str, result: str, spawned: float) -> None:
    """In the restarted process: train with a callback that notes when train() was called and step N+1 ended."""
    import transformers
    from transformers import TrainerCallback

    marks: dict[str, float] = {"spawned": spawned, "imported": time.time()}

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.setdefault("first_step", time.time())

    original = transformers.Trainer.train

    def timed_train(self, *a, **k):
        marks.setdefault("train_called", time.time())
        return original(self, *a, **k)

    transformers.Trainer.train = timed_train          # under LLaMA-Factory's subclasses and our patch
    if tool == "llamafactory-cli":
        from llamafactory.hparams.parser import read_args
        from llamafactory.train.tuner import run_exp

        sys.argv = ["llamafactory-cli", config]
        run_exp(args=read_args(), callbacks=[FirstStep()])
    else:
        from resumable_stream.app import llamafactory as run

        run.train(config, [], callbacks=(FirstStep(),))
    with open(result, "w", encoding="utf-8") as f:
        json.dump(marks, f)


def _run(cmd: list[str], log: str) -> None:
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV}).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="500,2000")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", help="the data file's format")
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    p.add_argument("--child", nargs=4, metavar=("TOOL", "CONFIG", "RESULT", "SPAWNED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(a.child[0], a.child[1], a.child[2], float(a.child[3]))
        return
    steps = sorted(int(s) for s in a.steps.split(","))
    work = tempfile.mkdtemp(prefix="rs-lf-bench-")
    try:
        model, data = make_model(os.path.join(work, "model")), _data(os.path.join(work, "data"), a.format)
        keys = {"cutoff_len": 64, "max_steps": steps[-1], "save_steps": steps[0], "logging_steps": 100,
                "save_total_limit": None, "per_device_train_batch_size": BATCH}
        results = {}
        for tool in ("llamafactory-cli", "resumable-stream"):
            name = "cli" if tool == "llamafactory-cli" else "ours"
            config, out = write_yaml(work, f"{name}-train", model, data, **keys)
            t0 = time.perf_counter()
            cmd = ([os.path.join(os.path.dirname(sys.executable), "llamafactory-cli"), "train", config]
                   if name == "cli" else [sys.executable, "-m", "resumable_stream", "llamafactory", "train", config])
            _run(cmd, os.path.join(work, f"{name}-train.log"))
            print(f"{tool}: trained {steps[-1]} steps in {time.perf_counter() - t0:.1f} s", flush=True)
            for n in steps:
                restart_cfg, restart_out = write_yaml(work, f"{name}-restart-{n}", model, data,
                                                      **{**keys, "max_steps": n + 1, "save_steps": 10**6})
                os.makedirs(restart_out)
                shutil.copytree(os.path.join(out, f"checkpoint-{n}"), os.path.join(restart_out, f"checkpoint-{n}"))
                result = os.path.join(work, f"{name}-{n}.json")
                spawned = time.time()
                _run([sys.executable, os.path.abspath(__file__), "--child", tool, restart_cfg, result, str(spawned)],
                     os.path.join(work, f"{name}-restart-{n}.log"))
                with open(result, encoding="utf-8") as f:
                    m = json.load(f)
                results[(tool, n)] = {"from_process_start_s": m["first_step"] - m["spawned"],
                                      "from_train_s": m["first_step"] - m["train_called"]}
        print(f"\nrestart to the first step after checkpoint-N (tiny Qwen3, CPU, batch {BATCH}, {ROWS} alpaca rows of "
              f"~{WORDS} words, {a.format})\n")
        print(f"  {'N':>5}  {'tool':18} {'from process start':>19} {'from train()':>13}")
        for n in steps:
            for tool in ("llamafactory-cli", "resumable-stream"):
                r = results[(tool, n)]
                print(f"  {n:>5}  {tool:18} {r['from_process_start_s']:>17.2f} s {r['from_train_s']:>11.2f} s")
            cli, ours = results[("llamafactory-cli", n)], results[("resumable-stream", n)]
            print(f"  {'':>5}  {'ratio cli / ours':18} {cli['from_process_start_s'] / ours['from_process_start_s']:>17.2f}x"
                  f" {cli['from_train_s'] / ours['from_train_s']:>11.2f}x")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump({f"{t}@{n}": r for (t, n), r in results.items()}, f, indent=1)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
