#!/usr/bin/env python
"""Training-level resume cost and data-path throughput, ours vs the stock ``transformers.Trainer``.

On the bundled tiny setup (``examples/tiny/train_lm.yaml``: random-init 2-layer Qwen3, hidden 64, the
bundled tokenizer, packing to 64 tokens, batch 8, shuffle buffer 256):

1. **Restart to the first step after checkpoint-N** (N = 2000; ``--quick``: 100).
   *ours*: ``build_trainer`` from the yaml (patched Trainer, ``TrainingStream``) trained to checkpoint-N;
   then a fresh process builds the trainer again and calls ``trainer.train(resume_from_checkpoint=...)``.
   *stock*: in processes that never import ``resumable_stream`` (so ``transformers.Trainer`` is unpatched),
   the same model init, tokenizer and training arguments on ``datasets.load_dataset("parquet", ...,
   streaming=True).shuffle(seed=42, buffer_size=256).map(tokenize + pack to 64, batched=True)``, trained to
   checkpoint-N and resumed the same way: the Trainer replays the N consumed batches
   (``skip_first_batches``: read, tokenized, packed and collated, then dropped).
   Timed from the parent's ``Popen`` of the resuming process (interpreter start and imports included)
   and from the ``trainer.train()`` call, to the first ``on_step_end`` of the resumed run (a
   ``TrainerCallback``, which then stops training). The two runs to checkpoint-N are not timed and run side
   by side, one torch thread each.
2. **Training steps/s** over ``--steps`` steps after ``--warmup`` steps, ``save_strategy: no``:
   ours (``dataloader_num_workers`` 0, 1 and 2) vs the same kind of data already tokenized and packed in
   memory (a map-style torch ``Dataset`` of 64-token blocks, made with the same ``TextProcessor`` before
   the Trainer is built, read with ``default_data_collator``), same patched Trainer class (it leaves a
   non-stream dataset to the stock code), same model init and arguments. Each kind runs ``--repeats``
   times in fresh processes, interleaved. Reported: wall steps/s over the window (best of the repeats) and
   steps per CPU-second of the training process (median; all its threads, DataLoader worker processes not
   counted), which other load on the machine barely moves. Ratio ours/in-memory (target >= 0.95).

Timed processes use one torch intra-op thread (``--threads``; 0 = torch's default): for this tiny model a
second thread buys little, and on a shared 2-core machine OpenMP spin-waits make multi-thread timings swing
by 10x. Data: generated rows of the same kind as ``examples/tiny/data`` (same generator,
``resumable_stream.testing.write_parquet_dataset``; row groups of 1000) cached under ``.bench/``:
96,000 rows in 8 files (``--quick``: 12,000 in 4), so 2000 steps (~69k rows) are one pass and the stock
replay never reaches the end of the data (where ``datasets``' interleaved-shard iterator sleeps 5 s on
shutdown). ``--bundled-data`` uses the 4,000 bundled rows instead (~116 steps).

    .venv/bin/python benchmarks/resume.py [--quick] [--json out.json] [--data-dir DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_T_START = time.time()   # child processes: wall clock as the script starts (before heavy imports)

import _common  # noqa: E402  (sets HF_DATASETS_CACHE before datasets is imported)

TINY = os.path.join(_common.REPO_ROOT, "examples", "tiny")
YAML = os.path.join(TINY, "train_lm.yaml")
FULL_ROWS, FULL_FILES, FULL_ROW_GROUP = 96_000, 8, 1000
QUICK_ROWS, QUICK_FILES = 12_000, 4


# ---------------------------------------------------------------------------- child side: shared
def _yaml_doc() -> dict:
    import yaml

    with open(YAML, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _train_values(p: dict, **extra) -> dict:
    """The yaml's train section with the benchmark's overrides (used by every kind)."""
    values = dict(_yaml_doc()["train"])
    values.update(output_dir=p["output_dir"], max_steps=p["max_steps"], logging_steps=10, disable_tqdm=True,
                  report_to="none", save_total_limit=3, dataloader_num_workers=p.get("num_workers", 0))
    if p.get("save_steps"):
        values.update(save_strategy="steps", save_steps=p["save_steps"])
    else:
        values.update(save_strategy="no")
    values.update(extra)
    return values


def _threads(p: dict) -> None:
    import torch

    if p.get("threads"):
        torch.set_num_threads(int(p["threads"]))


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    _common.quiet_logs()


def _callback(p: dict, marks: dict):
    """Records wall/perf times at on_step_end: the first step of this run, and the throughput window."""
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if "first_step" not in marks:
                marks["first_step"] = state.global_step
                marks["first_step_wall"] = time.time()
                marks["first_step_perf"] = time.perf_counter()
                if p.get("stop_after_first"):
                    control.should_training_stop = True
            if state.global_step == p.get("warmup"):
                marks["window_start"], marks["window_start_cpu"] = time.perf_counter(), time.process_time()
                marks["step_times"], self.last = [], time.perf_counter()
            elif "window_start" in marks and "window_end" not in marks:
                now = time.perf_counter()
                marks["step_times"].append(now - self.last)
                self.last = now
            if p.get("warmup") is not None and state.global_step == p["warmup"] + p["steps"]:
                marks["window_end"], marks["window_end_cpu"] = time.perf_counter(), time.process_time()
            if p.get("stop_at") and state.global_step >= p["stop_at"]:
                control.should_training_stop = True   # the Trainer still saves this step's checkpoint first
            return control

    return Marks()


def _model(tokenizer, model_config: dict, seed: int):
    """Same random init as resumable_stream.app.train._load_model (re-stated so the stock child
    never imports resumable_stream)."""
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    fields = dict(model_config)
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", len(tokenizer))
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            fields.setdefault(name, getattr(tokenizer, name))
    set_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))


def _tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# ---------------------------------------------------------------------------- child side: ours
def _ours_trainer(p: dict, marks: dict):
    from resumable_stream.app.train import build_trainer
    from resumable_stream.config.trainer import TrainerConfig

    doc = _yaml_doc()
    doc["data"].update(data_files=p["data_glob"], consumed_log=None)
    doc["train"] = _train_values(p)
    doc["train"].pop("disable_tqdm")            # not a key our yaml validation rejects, but keep it an override
    cfg = TrainerConfig.from_dict(doc, base_dir=TINY)
    trainer = build_trainer(cfg, disable_tqdm=True)
    trainer.add_callback(_callback(p, marks))
    return trainer


# ---------------------------------------------------------------------------- child side: stock
def _stock_trainer(p: dict, marks: dict):
    import datasets
    from transformers import Trainer, TrainingArguments, default_data_collator

    assert "resumable_stream" not in sys.modules, "the stock child must not import resumable_stream"
    assert not getattr(Trainer, "_resumable_stream_patched", False)
    doc = _yaml_doc()
    data, L = doc["data"], doc["data"]["max_seq_len"]
    tok = _tokenizer()
    eos = tok.eos_token_id
    args = TrainingArguments(**_train_values(p, remove_unused_columns=False))
    model = _model(tok, doc["model"]["config"], args.seed)

    def tokenize_and_pack(batch):
        ids = tok(batch[data["text_column"]], add_special_tokens=False)["input_ids"]
        flat = [t for seq in ids for t in (*seq, eos)]
        n = len(flat) // L * L
        blocks = [flat[i:i + L] for i in range(0, n, L)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks], "attention_mask": [[1] * L] * len(blocks)}

    ds = datasets.load_dataset("parquet", data_files=p["data_glob"], split="train", streaming=True)
    ds = ds.shuffle(seed=data["shuffle_seed"], buffer_size=data["buffer_size"])
    ds = ds.map(tokenize_and_pack, batched=True, batch_size=1000, remove_columns=["id", "text", "label"])
    trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                      data_collator=default_data_collator)
    trainer.add_callback(_callback(p, marks))
    return trainer


# ---------------------------------------------------------------------------- child side: in memory
def _mem_trainer(p: dict, marks: dict):
    import pyarrow.parquet as pq
    import torch
    from transformers import Trainer, default_data_collator

    from resumable_stream.config.trainer import TrainerConfig
    from resumable_stream.integrations.transformers.patch import patch_trainer
    from resumable_stream.transforms.text import TextProcessor

    doc = _yaml_doc()
    doc["data"].update(data_files=p["data_glob"], consumed_log=None)
    doc["train"] = _train_values(p)
    doc["train"].pop("disable_tqdm")
    cfg = TrainerConfig.from_dict(doc, base_dir=TINY)
    tok = _tokenizer()
    need = (p["max_steps"] + 1) * cfg.train["per_device_train_batch_size"]
    proc = TextProcessor(tok, cfg.transform)
    blocks: list[dict] = []
    files = sorted(f for f in os.listdir(p["data_dir"]) if f.endswith(".parquet"))
    while len(blocks) < need:                   # loops over the files if they hold fewer blocks
        for f in files:
            for i, text in enumerate(pq.read_table(os.path.join(p["data_dir"], f), columns=["text"])
                                     .column("text").to_pylist()):
                proc.feed({"text": text}, f"{f}:{i}")
                while proc.ready():
                    ex = proc.take()
                    ids = torch.tensor(ex["input_ids"], dtype=torch.int64)
                    blocks.append({"input_ids": ids, "labels": torch.tensor(ex["labels"], dtype=torch.int64),
                                   "attention_mask": torch.ones_like(ids)})
            if len(blocks) >= need:
                break

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(blocks)

        def __getitem__(self, i):
            return blocks[i]

    args = cfg.training_arguments(disable_tqdm=True)
    model = _model(tok, doc["model"]["config"], args.seed)
    patch_trainer(Trainer)   # the same (patched) class as ours; a plain Dataset goes through the stock code
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), processing_class=tok,
                      data_collator=default_data_collator)
    trainer.add_callback(_callback(p, marks))
    return trainer


BUILDERS = {"ours": _ours_trainer, "stock": _stock_trainer, "mem": _mem_trainer}


def _count_long_sleeps(marks: dict) -> None:
    """Account time.sleep calls of >= 1 s (``datasets``' interleaved-shard iterator sleeps 5 s when it shuts
    down), so a stall is reported as such rather than hidden in a total."""
    real = time.sleep

    def sleep(seconds):
        if seconds >= 1:
            marks["long_sleeps_s"] = marks.get("long_sleeps_s", 0.0) + seconds
            if "first_step" not in marks:
                marks["long_sleeps_before_first_step_s"] = marks.get("long_sleeps_before_first_step_s", 0.0) + seconds
        real(seconds)

    time.sleep = sleep


def child(kind: str, p: dict) -> dict:
    marks: dict = {"t_script_wall": _T_START}
    _count_long_sleeps(marks)
    _threads(p)
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    if kind != "stock":
        import resumable_stream.app.train  # noqa: F401
    _quiet()
    marks["imports_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer = BUILDERS[kind](p, marks)
    marks["build_s"] = time.perf_counter() - t1
    marks["train_call_wall"] = time.time()
    t2 = time.perf_counter()
    trainer.train(resume_from_checkpoint=p.get("resume"))
    marks["train_s"] = time.perf_counter() - t2
    marks["final_step"] = trainer.state.global_step
    if "first_step_perf" in marks:
        marks["train_call_to_first_step_s"] = marks["first_step_perf"] - t2
    if "window_end" in marks and "window_start" in marks:
        marks["steps_per_s"] = p["steps"] / (marks["window_end"] - marks["window_start"])
        # CPU seconds of this whole process (all its threads; not DataLoader worker processes) per step
        marks["cpu_steps_per_s"] = p["steps"] / (marks["window_end_cpu"] - marks["window_start_cpu"])
        marks["median_step_ms"] = statistics.median(marks.pop("step_times")) * 1e3
    marks["peak_rss_mib"] = _common.peak_rss_mib()
    return marks


# ---------------------------------------------------------------------------- parent side
def _spawn(kind: str, p: dict, threads: int | None = None) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ)
    if threads:
        p = {**p, "threads": threads}
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, json.dumps(p)]
    t = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=p["output_dir"])
    return proc, t


def _collect(kind: str, proc: subprocess.Popen, t_spawn: float) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.stderr.write(out[-4000:] + err[-8000:])
        raise SystemExit(f"child {kind} failed with exit code {proc.returncode}")
    r = json.loads(out.strip().splitlines()[-1])
    r["spawn_wall"] = t_spawn
    if "first_step_wall" in r:
        r["restart_to_first_step_s"] = r["first_step_wall"] - t_spawn
    r["interpreter_start_s"] = r["t_script_wall"] - t_spawn
    return r


def run_child(kind: str, p: dict, threads: int | None = None) -> dict:
    proc, t = _spawn(kind, p, threads)
    return _collect(kind, proc, t)


def resume_benchmark(work: str, data_dir: str, ckpt_step: int, threads: int | None) -> dict:
    glob = _common.parquet_glob(data_dir)
    base = {"data_glob": glob, "data_dir": data_dir, "max_steps": ckpt_step + 10, "save_steps": ckpt_step}
    dirs = {k: os.path.join(work, f"{k}_resume") for k in ("ours", "stock")}
    for d in dirs.values():
        os.makedirs(d)
    print(f"\n[1] restart to the first step after checkpoint-{ckpt_step} (batch 8 x 64 tokens)")
    t0 = time.perf_counter()
    procs = {k: _spawn(k, {**base, "output_dir": d, "stop_at": ckpt_step}, threads=1) for k, d in dirs.items()}
    pre = {k: _collect(k, *procs[k]) for k in procs}
    print(f"  trained both to checkpoint-{ckpt_step} side by side in {time.perf_counter() - t0:.1f} s "
          f"(ours {pre['ours']['train_s']:.1f} s, stock {pre['stock']['train_s']:.1f} s of train(); untimed)",
          flush=True)
    res = {}
    for k in ("ours", "stock"):
        ckpt = os.path.join(dirs[k], f"checkpoint-{ckpt_step}")
        if not os.path.isdir(ckpt):
            raise SystemExit(f"{k}: {ckpt} was not written")
        r = run_child(k, {**base, "output_dir": dirs[k], "resume": ckpt, "stop_after_first": True}, threads)
        if r.get("first_step") != ckpt_step + 1:
            raise SystemExit(f"{k}: the resumed run's first step is {r.get('first_step')}, not {ckpt_step + 1}")
        res[k] = r
    for k, label in (("ours", "ours  (restores the stream from its sidecar)"),
                     ("stock", f"stock (replays {ckpt_step} batches)")):
        r = res[k]
        slept = r.get("long_sleeps_before_first_step_s", 0.0)
        sleeps = f"; train() includes {slept:.0f} s of datasets' shutdown sleep" if slept else ""
        print(f"  {label:<45} restart->step {ckpt_step + 1}: {r['restart_to_first_step_s']:6.2f} s   "
              f"train()->step: {r['train_call_to_first_step_s']:6.2f} s   (imports {r['imports_s']:.1f} s, "
              f"build {r['build_s']:.1f} s{sleeps})", flush=True)
    ratio_total = res["stock"]["restart_to_first_step_s"] / res["ours"]["restart_to_first_step_s"]
    ratio_train = res["stock"]["train_call_to_first_step_s"] / res["ours"]["train_call_to_first_step_s"]
    print(f"  ratio stock/ours: {ratio_total:.2f}x from process start, {ratio_train:.2f}x from train()")
    return {"checkpoint_step": ckpt_step, "pretrain": pre, "ours": res["ours"], "stock": res["stock"],
            "ratio_stock_over_ours_from_process_start": ratio_total,
            "ratio_stock_over_ours_from_train_call": ratio_train}


def throughput_benchmark(work: str, data_dir: str, warmup: int, steps: int, repeats: int,
                         threads: int | None) -> dict:
    glob = _common.parquet_glob(data_dir)
    kinds = (("ours", 0), ("mem", 0), ("ours", 1), ("ours", 2))
    labels = {("ours", 0): "ours, num_workers 0", ("mem", 0): "in-memory pre-tokenized",
              ("ours", 1): "ours, num_workers 1", ("ours", 2): "ours, num_workers 2"}
    print(f"\n[2] training steps/s, steps {warmup + 1}..{warmup + steps} (after {warmup} warm-up), batch 8 x 64 tokens, "
          f"{repeats} run(s) each, fresh processes, interleaved")
    runs: dict[str, list[dict]] = {f"{k}_nw{w}": [] for k, w in kinds}
    for rep in range(repeats):
        for k, w in kinds:
            out = os.path.join(work, f"tput_{k}_nw{w}_{rep}")
            os.makedirs(out)
            r = run_child(k, {"data_glob": glob, "data_dir": data_dir, "output_dir": out, "num_workers": w,
                              "max_steps": warmup + steps, "warmup": warmup, "steps": steps}, threads)
            runs[f"{k}_nw{w}"].append(r)
            print(f"  {labels[(k, w)]:<26} run {rep + 1}: {r['steps_per_s']:7.2f} steps/s wall   "
                  f"{r['cpu_steps_per_s']:7.2f} steps per CPU-s   (median step {r['median_step_ms']:.1f} ms)",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    best = {name: max(r["steps_per_s"] for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r["cpu_steps_per_s"] for r in rs) for name, rs in runs.items()}
    print(f"  summary (wall: best of {repeats}; CPU: median of {repeats}, the main process's CPU time, all threads):")
    for (k, w) in kinds:
        name = f"{k}_nw{w}"
        note = "  (workers' CPU not counted)" if w else ""
        print(f"    {labels[(k, w)]:<26} {best[name]:7.2f} steps/s wall ({best[name] * 8:,.0f} samples/s)   "
              f"{cpu[name]:7.2f} steps per CPU-s{note}")
    ratio0, ratio1 = best["ours_nw0"] / best["mem_nw0"], best["ours_nw1"] / best["mem_nw0"]
    ratio2 = best["ours_nw2"] / best["mem_nw0"]
    cpu_ratio0 = cpu["ours_nw0"] / cpu["mem_nw0"]

    def verdict(v: float) -> str:
        return "PASS" if v >= 0.95 else "MISS"

    print(f"  ratio ours/in-memory, wall steps/s: {ratio0:.3f} with num_workers 0 (target >= 0.95: {verdict(ratio0)}), "
          f"{ratio1:.3f} with num_workers 1 ({verdict(ratio1)}), {ratio2:.3f} with num_workers 2 ({verdict(ratio2)})")
    print(f"  ratio ours/in-memory, steps per CPU-second, num_workers 0: {cpu_ratio0:.3f} ({verdict(cpu_ratio0)}; "
          f"the data path costs {(1 / cpu_ratio0 - 1) * 100:.1f} % on top of a training step's CPU time)")
    return {"warmup": warmup, "steps": steps, "repeats": repeats, "threads": threads, "runs": runs,
            "best_wall_steps_per_s": best, "median_cpu_steps_per_s": cpu,
            "ratio_ours_nw0_over_mem_wall": ratio0, "ratio_ours_nw1_over_mem_wall": ratio1,
            "ratio_ours_nw2_over_mem_wall": ratio2,
            "ratio_ours_nw0_over_mem_cpu": cpu_ratio0, "target_min": 0.95,
            "pass": ratio0 >= 0.95, "pass_nw1": ratio1 >= 0.95, "pass_nw2": ratio2 >= 0.95}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="checkpoint-100 on 12k generated rows, 40 timed steps (< 90 s)")
    ap.add_argument("--checkpoint-step", type=int, default=None, help="step to resume from (default 2000; quick 100)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before the window (default 50; quick 10)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 300; quick 40)")
    ap.add_argument("--repeats", type=int, default=None, help="throughput runs per kind (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in the timed processes (default 1; 0: torch's default)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--bundled-data", action="store_true", help="use examples/tiny/data even without --quick")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the run directories (checkpoints) under this directory")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        kind, params = args._child
        print(json.dumps(child(kind, json.loads(params))))
        return 0

    q = args.quick
    ckpt_step = args.checkpoint_step or (100 if q else 2000)
    warmup = args.warmup if args.warmup is not None else (10 if q else 50)
    steps = args.steps or (40 if q else 300)
    repeats = args.repeats or (1 if q else 3)
    t_start = time.perf_counter()
    print(f"resumable-stream training resume benchmark  (python {platform.python_version()}, "
          f"{os.cpu_count()} cpus{', QUICK' if q else ''})")
    if args.bundled_data:
        data_dir, data_desc = os.path.join(TINY, "data"), "bundled examples/tiny/data (4,000 rows, 4 files)"
    else:
        rows, files = (QUICK_ROWS, QUICK_FILES) if q else (FULL_ROWS, FULL_FILES)
        data_dir = _common.dataset_dir(args.data_dir, rows, files, FULL_ROW_GROUP)
        data_desc = (f"generated {rows:,} rows like examples/tiny/data ({files} files, row groups of "
                     f"{FULL_ROW_GROUP}): {data_dir}")
    print(f"data: {data_desc}")
    print("model: examples/tiny/train_lm.yaml (random-init qwen3, 2 layers, hidden 64), packing to 64 tokens, "
          "batch 8, buffer 256")

    work = args.keep or tempfile.mkdtemp(prefix="rs-bench-resume-")
    os.makedirs(work, exist_ok=True)
    out: dict = {"benchmark": "resume_training", "quick": q, "python": platform.python_version(),
                 "cpus": os.cpu_count(), "data": data_desc}
    try:
        if not args.skip_resume:
            out["resume"] = resume_benchmark(work, data_dir, ckpt_step, args.threads or None)
        if not args.skip_throughput:
            out["throughput"] = throughput_benchmark(work, data_dir, warmup, steps, repeats, args.threads or None)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    misses = [] if out.get("throughput", {}).get("pass", True) else ["throughput_ratio"]
    out["misses"] = misses
    out["elapsed_s"] = time.perf_counter() - t_start
    print(f"\ntotal {out['elapsed_s']:.1f} s; targets {'all met' if not misses else 'missed: ' + ', '.join(misses)}")
    if args.json_path:
        try:
            import datasets
            import torch
            import transformers

            out["versions"] = {"datasets": datasets.__version__, "torch": torch.__version__,
                               "transformers": transformers.__version__}
        except Exception:
            pass
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results written to {args.json_path}")
    return 1 if (args.strict and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
