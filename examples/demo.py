"""Quick-start main job: train the tiny model on the bundled data, SIGKILL it mid-run, resume, compare.

    python examples/demo.py [--config examples/tiny/train_lm.yaml] [--steps 200] [--save-steps 50] [--workers 0]

1. an uninterrupted training run (the reference);
2. the same run, killed with SIGKILL at a random step after its first checkpoint;
3. a restart with the same output dir, which resumes from the last complete checkpoint.
Then the samples consumed at every step (data.consumed_log) and the per-step losses of 2+3 are
compared with 1. The exit code is 0 only if they are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train_lm.py")


def write_config(base: str, out: str, args) -> str:
    with open(base, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    base_dir = os.path.dirname(os.path.abspath(base))
    cfg["model"]["tokenizer"] = os.path.join(base_dir, cfg["model"]["tokenizer"])
    cfg["data"]["data_files"] = os.path.join(base_dir, cfg["data"]["data_files"])
    cfg["data"]["consumed_log"] = os.path.join(out, "consumed")
    cfg["train"].update(output_dir=out, max_steps=args.steps, save_steps=args.save_steps, logging_steps=1,
                        dataloader_num_workers=args.workers, disable_tqdm=True)
    path = out + ".yaml"
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)
    return path


def read_jsonl(path: str) -> dict[int, object]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec.get("samples", rec.get("loss"))
    return out


def train(config: str, kill_after_step: int | None = None) -> tuple[int, float, str]:
    """Run examples/train_lm.py; with kill_after_step, SIGKILL it once train_log.jsonl reaches that step."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, TRAIN, config], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    if kill_after_step is None:
        _, err = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"training failed:\n{err[-3000:]}")
        return proc.returncode, time.perf_counter() - t0, err
    with open(config, encoding="utf-8") as f:
        log = os.path.join(yaml.safe_load(f)["train"]["output_dir"], "train_log.jsonl")
    while proc.poll() is None:
        if os.path.exists(log) and max(read_jsonl(log), default=0) >= kill_after_step:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    return proc.returncode, time.perf_counter() - t0, ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(HERE, "tiny", "train_lm.yaml"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--out", help="work directory (default: a temp dir, removed afterwards)")
    args = p.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="resumable-stream-demo-")
    ref_out, run_out = os.path.join(work, "uninterrupted"), os.path.join(work, "killed-and-resumed")
    for d in (ref_out, run_out):
        shutil.rmtree(d, ignore_errors=True)
    ref_cfg, run_cfg = write_config(args.config, ref_out, args), write_config(args.config, run_out, args)

    print(f"resumable-stream demo: tiny Qwen3-style model, {os.path.relpath(args.config)}, {args.steps} steps, "
          f"checkpoint every {args.save_steps}")
    _, secs, _ = train(ref_cfg)
    print(f"  1. uninterrupted run: {args.steps} steps ({secs:.1f} s)")
    kill_at = random.Random().randint(args.save_steps + 1, args.steps - 2)
    code, _, _ = train(run_cfg, kill_after_step=kill_at)
    ckpts = sorted(int(d.split("-")[1]) for d in os.listdir(run_out) if d.startswith("checkpoint-"))
    print(f"  2. second run: killed with SIGKILL at step {kill_at} (exit {code}); checkpoints on disk: {ckpts}")
    _, secs, err = train(run_cfg)
    resumed = [line.split("resuming from ", 1)[1].strip() for line in err.splitlines() if "resuming from " in line]
    where = os.path.basename(resumed[0]) if resumed else "NOTHING (started over)"
    print(f"  3. restarted with the same output dir: resumed from {where}, no batch replayed, finished "
          f"({secs:.1f} s)")

    same_data = read_jsonl(os.path.join(ref_out, "consumed", "rank-00000.jsonl")) == \
        read_jsonl(os.path.join(run_out, "consumed", "rank-00000.jsonl"))
    ref_loss = read_jsonl(os.path.join(ref_out, "train_log.jsonl"))
    run_loss = read_jsonl(os.path.join(run_out, "train_log.jsonl"))
    worst = max(abs(ref_loss[s] - run_loss.get(s, float("inf"))) for s in ref_loss)
    print(f"  samples consumed at each of the {args.steps} steps: "
          f"{'identical to' if same_data else 'DIFFERENT from'} the uninterrupted run")
    print(f"  per-step losses: largest difference {worst:.2e}")
    exact = same_data and worst <= 1e-6
    print("RESULT: the resumed run consumed exactly what an uninterrupted one would" if exact else "RESULT: MISMATCH")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
