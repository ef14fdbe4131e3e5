"""Quick-start demo: read the bundled tiny dataset on 2 ranks, checkpoint, SIGKILL, resume, compare.

    python examples/stream_demo.py [--config examples/tiny/stream.yaml] [--world-size 2] [--steps 300]

Run 1 reads batches and writes stream state into checkpoint-N/stream_state every few steps; it is
killed with SIGKILL at a random step. Run 2 resumes from the last complete checkpoint. The samples
consumed after the checkpoint are compared with an uninterrupted run, rank by rank. For contrast,
the same is tried with HF datasets' own shuffled IterableDataset state_dict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "tiny", "stream.yaml")


def run_child(args: argparse.Namespace) -> None:
    """One 'training' process: every rank takes a batch per step; checkpoints every N steps."""
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.state.checkpoint import finish

    cfg = StreamConfig.from_yaml(args.config)
    start_step = 0
    if args.resume_from:
        cfg = cfg.replace(resume_state_path=args.resume_from)
        start_step = int(os.path.basename(args.resume_from.rstrip("/")).split("-")[-1])
    streams = [ResumableStream(cfg, rank=r, world_size=args.world_size) for r in range(args.world_size)]
    iters = [iter(s) for s in streams]
    run = "resumed" if args.resume_from else "first"
    logs = [open(os.path.join(args.out, f"consumed-rank-{r:05d}.{run}.jsonl"), "w", encoding="utf-8")
            for r in range(args.world_size)]
    for step in range(start_step + 1, args.steps + 1):
        for r, it in enumerate(iters):
            batch = [row["id"] for row in itertools.islice(it, args.batch_size)]
            logs[r].write(json.dumps({"step": step, "samples": batch}) + "\n")
            logs[r].flush()
        if step % args.save_every == 0:
            state_dir = os.path.join(args.out, "checkpoints", f"checkpoint-{step}", "stream_state")
            for s in streams:              # every rank writes its own sidecar ...
                s.save_sidecar(state_dir)
            finish(state_dir, args.world_size)   # ... then rank 0 completes the checkpoint (the manifest)
        print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)


def _child_cmd(args, out, resume_from=None, steps=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config, "--out", out,
           "--world-size", str(args.world_size), "--steps", str(steps or args.steps),
           "--batch-size", str(args.batch_size), "--save-every", str(args.save_every),
           "--step-sleep", str(args.step_sleep)]
    return cmd + (["--resume-from", resume_from] if resume_from else [])


def _read_log(path: str) -> dict[int, list]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):          # a line cut by the kill is not a consumed step
                rec = json.loads(line)
                out[rec["step"]] = rec["samples"]
    return out


def _latest_complete_checkpoint(out: str) -> tuple[int, str] | None:
    root = os.path.join(out, "checkpoints")
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else []:
        step = int(name.split("-")[-1])
        if os.path.isfile(os.path.join(root, name, "stream_state", "manifest.json")) and (not best or step > best[0]):
            best = (step, os.path.join(root, name))
    return best


def hf_contrast(config_path: str, consumed: int = 1000, compare: int = 500) -> float:
    """Share of the next samples a resumed HF shuffled stream has in common with the uninterrupted one."""
    import datasets

    from resumable_stream import StreamConfig

    datasets.logging.set_verbosity_error()

    cfg = StreamConfig.from_yaml(config_path)
    make = lambda: datasets.load_dataset(cfg.dataset_name_or_path, data_files=cfg.data_files, split="train",  # noqa: E731
                                         streaming=True).shuffle(seed=cfg.shuffle_seed, buffer_size=cfg.buffer_size)
    ds = make()
    it = iter(ds)
    for _ in range(consumed):
        next(it)
    state = ds.state_dict()
    reference = [next(it)["id"] for _ in range(compare)]
    resumed = make()
    resumed.load_state_dict(state)
    got = [row["id"] for row in itertools.islice(resumed, compare)]
    return len(set(got) & set(reference)) / compare


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--save-every", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.005)
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed afterwards)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume-from", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_child(args)
        return 0

    work = args.out or tempfile.mkdtemp(prefix="resumable-stream-demo-")
    ref_dir, run_dir = os.path.join(work, "uninterrupted"), os.path.join(work, "killed-and-resumed")
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    W, B = args.world_size, args.batch_size
    print(f"resumable-stream demo: {args.config}")
    print(f"  {W} ranks x {B} samples per step, {args.steps} steps, checkpoint every {args.save_every} steps")

    subprocess.run(_child_cmd(args, ref_dir), check=True, stdout=subprocess.DEVNULL)
    print(f"  uninterrupted run: done ({args.steps} steps)")

    kill_at = random.Random().randint(args.save_every * 2 + 1, args.steps - args.save_every // 2)
    proc = subprocess.Popen(_child_cmd(args, run_dir), stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == f"step {kill_at}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    ckpt = _latest_complete_checkpoint(run_dir)
    print(f"  run 1: killed with SIGKILL after step {kill_at} (exit {proc.returncode}); "
          f"last complete checkpoint: step {ckpt[0]}")

    t0 = time.perf_counter()
    subprocess.run(_child_cmd(args, run_dir, resume_from=ckpt[1]), check=True, stdout=subprocess.DEVNULL)
    print(f"  run 2: resumed from {os.path.relpath(ckpt[1], work)} and ran steps {ckpt[0] + 1}..{args.steps} "
          f"({time.perf_counter() - t0:.1f} s including start-up)")

    exact = True
    for r in range(W):
        ref = _read_log(os.path.join(ref_dir, f"consumed-rank-{r:05d}.first.jsonl"))
        first_run = _read_log(os.path.join(run_dir, f"consumed-rank-{r:05d}.first.jsonl"))
        second_run = _read_log(os.path.join(run_dir, f"consumed-rank-{r:05d}.resumed.jsonl"))
        # what training kept: run 1 up to the checkpoint, then run 2 (steps run 1 did after it are redone)
        resumed = {s: v for s, v in first_run.items() if s <= ckpt[0]} | second_run
        same = resumed == ref
        after = sum(len(v) for s, v in second_run.items())
        exact &= same
        mark = "identical to" if same else "DIFFERENT from"
        print(f"  rank {r}: {after} samples consumed after the checkpoint, {mark} the uninterrupted run")

    share = hf_contrast(args.config)
    print(f"  for contrast, HF datasets' shuffled stream resumed from its state_dict shares {share:.0%} of its "
          f"next 500 samples with the uninterrupted one")
    print("RESULT: exact resume" if exact else "RESULT: MISMATCH")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
