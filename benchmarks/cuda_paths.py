"""The CUDA paths, run once on a machine with an NVIDIA GPU (issue 40 item 5; CI has no GPU).

    python benchmarks/cuda_paths.py [--steps 40] [--save-step 15] [--kill-step 22] [--workers 2]

What it runs, each under ``torchrun --nproc-per-node 1`` with the ``nccl`` backend (``gloo`` without a GPU, so the
script itself can be tried anywhere):

1. our collectives on CUDA tensors (``broadcast_bytes``, ``max_over_ranks``, ``max_each_over_ranks``: under
   ``nccl`` they move their tensors to the current CUDA device);
2. a ``StreamLoader`` with DataLoader workers and ``pin_memory=True`` feeding a tiny random-init Qwen3 model on
   the GPU (batches checked to arrive pinned, copied with ``non_blocking=True``), three times: uninterrupted;
   saved at ``--save-step`` and SIGKILLed at ``--kill-step``; resumed from the save. The resumed run must consume
   the same samples and give bit-identical losses (``torch.use_deterministic_algorithms``).

It prints one line per check and ``RESULT: ...``; the exit code is 0 only if every check passed. The figures it
printed on an H200 are in docs/limitations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "examples", "tiny")
SEQ = 64


def _collate(tokenizer):
    def collate(rows):
        enc = tokenizer([r["text"] for r in rows], max_length=SEQ, truncation=True, padding="max_length",
                        return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return collate


def _model(tokenizer, device):
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
        fields = dict(yaml.safe_load(f)["model"]["config"])
    kind = fields.pop("model_type")
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device)


def worker(args) -> int:
    """One training process (under torchrun): mode reference | killed | resumed."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_model, save_model
    from transformers import AutoTokenizer

    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.loader import StreamLoader
    from resumable_stream.runtime import collectives

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.use_deterministic_algorithms(True)
    report = {"backend": dist.get_backend(), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if cuda else None}
    # 1. collectives (world 1: what they move still goes through the backend and the device)
    payload = json.dumps({"index": list(range(1000))}).encode()
    report["collectives_ok"] = (collectives.broadcast_bytes(payload) == payload
                                and collectives.max_over_ranks(7) == 7
                                and collectives.max_each_over_ranks([3, 1, 4]) == [3, 1, 4])

    # 2. StreamLoader -> pinned batches -> model step on the device
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    stream = ResumableStream(StreamConfig.from_yaml(os.path.join(TINY, "stream.yaml")), rank=0, world_size=1,
                             num_workers=args.workers)
    loader = StreamLoader(stream, batch_size=8, collate_fn=_collate(tokenizer), num_workers=args.workers,
                          pin_memory=cuda, keep_keys=True)
    model = _model(tokenizer, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)       # no optimizer state: the model file is the checkpoint
    ckpt = os.path.join(args.out, "checkpoint")
    first = 1
    if args.mode == "resumed":
        load_model(model, os.path.join(ckpt, "model.safetensors"))
        loader.load_sidecar(os.path.join(ckpt, "stream_state"))
        first = args.save_step + 1
    log = open(os.path.join(args.out, f"{args.mode}.jsonl"), "a", encoding="utf-8")
    pinned, started = True, time.perf_counter()
    for step, batch in enumerate(loader, start=first):
        pinned = pinned and (not cuda or batch["input_ids"].is_pinned())
        ids = batch["input_ids"].to(device, non_blocking=True)
        mask = batch["attention_mask"].to(device, non_blocking=True)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        keys = loader.pop_consumed_keys()
        log.write(json.dumps({"step": step, "loss": loss.item(), "keys": keys}) + "\n")
        log.flush()
        if args.mode == "killed" and step == args.save_step:
            os.makedirs(ckpt, exist_ok=True)
            save_model(model, os.path.join(ckpt, "model.safetensors"))
            loader.save_sidecar(os.path.join(ckpt, "stream_state"))
        if args.mode == "killed" and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.steps:
            break
    report.update(pinned=pinned, seconds=round(time.perf_counter() - started, 2),
                  peak_gpu_mib=round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if cuda else None)
    with open(os.path.join(args.out, f"{args.mode}-report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    return 0


def read_log(path: str) -> dict[int, dict]:
    with open(path, encoding="utf-8") as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-step", type=int, default=15)
    p.add_argument("--kill-step", type=int, default=22)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--mode", choices=("reference", "killed", "resumed"))
    args = p.parse_args()
    if args.mode:
        return worker(args)
    out = args.out or tempfile.mkdtemp(prefix="cuda-paths-")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", OMP_NUM_THREADS="1")
    codes = {}
    for mode in ("reference", "killed", "resumed"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29531",
               os.path.abspath(__file__), "--mode", mode, "--out", out, "--steps", str(args.steps),
               "--save-step", str(args.save_step), "--kill-step", str(args.kill_step), "--workers", str(args.workers)]
        codes[mode] = subprocess.run(cmd, env=env).returncode
    ok = codes["reference"] == 0 and codes["killed"] != 0 and codes["resumed"] == 0
    ref = read_log(os.path.join(out, "reference.jsonl"))
    killed = read_log(os.path.join(out, "killed.jsonl"))
    resumed = read_log(os.path.join(out, "resumed.jsonl"))
    run = {s: killed[s] for s in killed if s <= args.save_step} | resumed
    same_keys = all(run.get(s, {}).get("keys") == ref[s]["keys"] for s in ref) and len(ref) == args.steps
    worst = max(abs(run[s]["loss"] - ref[s]["loss"]) if s in run else float("inf") for s in ref)
    with open(os.path.join(out, "reference-report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    print(f"device {rep['device']} ({rep['gpu']}), backend {rep['backend']}, DataLoader workers {args.workers}")
    print(f"  exit codes: reference {codes['reference']}, killed {codes['killed']} (SIGKILL at step "
          f"{args.kill_step}, saved at {args.save_step}), resumed {codes['resumed']}")
    print(f"  collectives on the backend's device: {'ok' if rep['collectives_ok'] else 'WRONG'}")
    print(f"  batches pinned: {rep['pinned']}; {args.steps} steps in {rep['seconds']} s; peak GPU memory "
          f"{rep['peak_gpu_mib']} MiB")
    print(f"  samples of the {args.steps} steps, killed + resumed vs uninterrupted: "
          f"{'identical' if same_keys else 'DIFFERENT'}; largest loss difference {worst:.3g}")
    ok = ok and rep["collectives_ok"] and rep["pinned"] and same_keys and worst == 0.0
    print("RESULT: " + (f"every check passed on {rep['device']}" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
