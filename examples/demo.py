"""Quick-start main job: train the tiny model on the bundled data, SIGKILL it mid-run, resume, compare.

    python examples/demo.py [--config examples/tiny/train_lm.yaml] [--steps 120] [--save-steps 40] [--workers 0]
                            [--out DIR]          # make demo OUT=DIR

1. an uninterrupted training run (the reference);
2. the same run, killed with SIGKILL at a random step after its first checkpoint;
3. a restart with the same output dir, which resumes from the last complete checkpoint.
Then the samples consumed at every step (data.consumed_log) and the per-step losses of 2+3 are
compared with 1, and the sample keys (shard:row) the killed and the resumed run consumed around the
resume point are printed beside the reference run's. The exit code is 0 only if they are identical.
With ``--out DIR`` the runs stay in DIR (``DIR/uninterrupted``, ``DIR/killed-and-resumed``) and the demo ends
with the ``resumable-stream inspect`` / ``report`` commands for them; without it they are in a temporary
directory, removed at the end.

The trainings run with one torch thread (OMP_NUM_THREADS=1 unless set): the model is tiny, and on a busy
machine more threads only wait for each other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
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
    cfg["data"]["consumed_log"] = True        # the run's own output_dir/consumed
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
            if not line.endswith("\n"):   # a line being written (or cut short by the kill)
                break
            rec = json.loads(line)
            out[rec["step"]] = rec.get("samples", rec.get("loss"))
    return out


def train(config: str, kill_after_step: int | None = None) -> tuple[int, float, str]:
    """Run examples/train_lm.py; with kill_after_step, SIGKILL it once train_log.jsonl reaches that step."""
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **os.environ}
    proc = subprocess.Popen([sys.executable, TRAIN, config], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
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


def show_ids(ids: list[str] | None, first: int = 3) -> str:
    """A step's sample keys, shortened: the first few and how many more."""
    if ids is None:
        return "-"
    return " ".join(ids[:first]) + (f" +{len(ids) - first}" if len(ids) > first else "")


def print_around_resume(killed: dict, run: dict, ref: dict, resumed_at: int) -> None:
    """Side by side, what the killed run, the resumed run and the reference consumed at the steps around the
    checkpoint the restart resumed from and the kill. The resumed run's steps are those after the checkpoint
    (``run`` holds the killed run's up to it)."""
    killed_at = max(killed)
    steps = sorted({s for s in (*range(resumed_at - 1, resumed_at + 3), *range(killed_at - 1, killed_at + 3))
                    if s in ref})
    width = max(len(show_ids(ref[s])) for s in steps)
    print("  sample keys (shard:row) consumed around the resume point, the first 3 of each step and how many more:")
    print(f"  {'step':>5} | {'killed run':<{width}} | {'resumed run':<{width}} | uninterrupted run")
    previous = None
    for step in steps:
        if previous is not None and step > previous + 1:
            print(f"  {'...':>5} |")
        note = {resumed_at: f"  <- checkpoint-{resumed_at}: the restart resumed after this step",
                killed_at: "  <- SIGKILL: the killed run's last step"}.get(step, "")
        cells = [show_ids(killed.get(step)), show_ids(run.get(step) if step > resumed_at else None),
                 show_ids(ref[step])]
        print((f"  {step:>5} | " + " | ".join(f"{c:<{width}}" for c in cells) + note).rstrip())
        previous = step


def command_line() -> str:
    """How to call the command line from where the demo was started: the console script beside this Python
    (``.venv/bin/resumable-stream`` after ``make demo``), else ``python -m resumable_stream``."""
    script = os.path.join(os.path.dirname(sys.executable), "resumable-stream")
    if os.path.isfile(script):
        return shlex.quote(shown_path(script))
    return f"{shlex.quote(shown_path(sys.executable))} -m resumable_stream"


def shown_path(path: str) -> str:
    """``path`` relative to the current directory when it is below it (shorter to copy), else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return os.path.abspath(path) if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def print_next_steps(ref_out: str, run_out: str) -> None:
    """The commands that look into the kept runs: the stream state of the newest complete checkpoint, and
    the picture of each run (the resumed one marks where it resumed)."""
    cli = command_line()
    lines = [(f"{cli} inspect {shlex.quote(shown_path(run_out))}", "the newest checkpoint's stream state")]
    lines += [(f"{cli} report {shlex.quote(shown_path(out))}", f"-> {shown_path(os.path.join(out, 'report.png'))}")
              for out in (run_out, ref_out)]
    width = max(len(command) for command, _ in lines)
    print("  the runs are kept; look into them with:")
    for command, what in lines:
        print(f"    {command:<{width}}  # {what}")
    if importlib.util.find_spec("matplotlib") is None:
        print("    (report draws with matplotlib: pip install 'resumable-stream[report]')")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(HERE, "tiny", "train_lm.yaml"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--out", help="keep the runs in this directory (make demo OUT=DIR); default: a temporary "
                                 "directory, removed afterwards")
    args = p.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="resumable-stream-demo-")
    os.makedirs(work, exist_ok=True)
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
    # the restart cuts the consumed log back to its checkpoint: keep what the killed run consumed
    killed_log = os.path.join(work, "killed-consumed.jsonl")
    shutil.copyfile(os.path.join(run_out, "consumed", "rank-00000.jsonl"), killed_log)
    _, secs, err = train(run_cfg)
    resumed = [line.split("resuming from ", 1)[1].split()[0] for line in err.splitlines() if "resuming from " in line]
    where = os.path.basename(resumed[0]) if resumed else "NOTHING (started over)"
    print(f"  3. restarted with the same output dir: resumed from {where}, no batch replayed, finished "
          f"({secs:.1f} s)")

    ref_ids = read_jsonl(os.path.join(ref_out, "consumed", "rank-00000.jsonl"))
    run_ids = read_jsonl(os.path.join(run_out, "consumed", "rank-00000.jsonl"))
    if resumed:
        print_around_resume(read_jsonl(killed_log), run_ids, ref_ids, int(where.split("-")[1]))
    same_data = ref_ids == run_ids
    ref_loss = read_jsonl(os.path.join(ref_out, "train_log.jsonl"))
    run_loss = read_jsonl(os.path.join(run_out, "train_log.jsonl"))
    worst = max(abs(ref_loss[s] - run_loss.get(s, float("inf"))) for s in ref_loss)
    print(f"  samples consumed at each of the {args.steps} steps: "
          f"{'identical to' if same_data else 'DIFFERENT from'} the uninterrupted run")
    print(f"  per-step losses: largest difference {worst:.2e}")
    exact = same_data and worst <= 1e-6
    print("RESULT: the resumed run consumed exactly what an uninterrupted one would" if exact else "RESULT: MISMATCH")
    if args.out:
        print_next_steps(ref_out, run_out)
    else:
        shutil.rmtree(work, ignore_errors=True)
        print("  the runs were in a temporary directory, now removed; make demo OUT=DIR (examples/demo.py --out "
              "DIR) keeps them to inspect and report on")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
