#!/usr/bin/env python
"""Samples/s of the vision-language data path: ours vs HF streaming + ``.map``, and where the time goes.

On the same generated parquet (rows with ``messages`` holding ``<image>`` placeholders and an HF
``List(Image())`` column of JPEG bytes, 192..384 px), with the same processor (the bundled tiny tokenizer with
a Qwen3-VL-style image processor: 16-px patches, merge 2, at most 384x384 px) and the same per-sample work
(chat template, assistant-only labels, ``processor(text, images)``), batches of 8 collated by ``collate_vl``:

* ``ours``: ``ResumableStream`` -> ``VLProcessor`` (decodes the image bytes itself) -> ``collate_vl``;
* ``hf``: ``load_dataset(..., streaming=True)`` (its ``Image`` feature decodes) -> ``.map(fn)`` where ``fn``
  runs the same ``VLProcessor`` on the decoded images -> ``collate_vl``;

each plain and shuffled (buffer 1024), each in a fresh process, best of ``--repeat``. Then a breakdown of ours (read rows,
decode images, processor = chat template + labels + HF processor call, collate), and what happens on
data with broken images: HF stops at the first one; ours skips them (``bad_sample: skip``) and counts them.

    .venv/bin/python benchmarks/vl.py [--rows N] [--repeat K] [--data-dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

BUFFER = 1024
BATCH = 8
FILES = 4
ROW_GROUP_SIZE = 250
TINY_VL = os.path.join(_common.REPO_ROOT, "examples", "tiny", "vl")
WORDS = "a red blue circle soft gradient with three spots on the left and right background".split()
KINDS = ("ours_plain", "ours_shuffled", "hf_plain", "hf_shuffled")
LABELS = {"ours_plain": "ours, shuffle=False", "ours_shuffled": f"ours, shuffle=True (buffer {BUFFER})",
          "hf_plain": "HF streaming + .map", "hf_shuffled": f"HF streaming .shuffle({BUFFER}) + .map"}


# ---------------------------------------------------------------------------- data and processor
def _jpeg(rng: random.Random) -> bytes:
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = rng.randrange(192, 385), rng.randrange(192, 385)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * rng.random() + y * rng.random()) % 256 for _ in range(3)], -1)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 12, (h, w, 3))
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype("uint8"))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rng.randrange(w - 40), rng.randrange(h - 40)
        draw.ellipse([x0, y0, x0 + rng.randrange(20, 40), y0 + rng.randrange(20, 40)],
                     fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def dataset(data_dir: str, rows: int, broken: int) -> str:
    """Parquet files with an HF ``List(Image())`` column; ``broken`` rows get truncated JPEG bytes."""
    name = f"vl-{rows}r-{broken}bad"
    path = os.path.join(data_dir, name)
    if os.path.exists(os.path.join(path, "COMPLETE")):
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Features, Image, List, Value

    print(f"  generating {rows:,} rows ({broken} with a broken image) -> {path}", flush=True)
    rng = random.Random(rows)
    bad = set(random.Random(7).sample(range(rows), broken))
    schema = Features({"id": Value("int64"), "messages": List({"role": Value("string"), "content": Value("string")}),
                       "images": List(Image())}).arrow_schema
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=_mkdir(data_dir))
    per_file = rows // FILES
    for f in range(FILES):
        batch = []
        for i in range(f * per_file, (f + 1) * per_file if f < FILES - 1 else rows):
            n_img = 2 if rng.random() < 0.2 else 1
            images = [{"bytes": _jpeg(rng), "path": None} for _ in range(n_img)]
            if i in bad:
                images[0]["bytes"] = images[0]["bytes"][: len(images[0]["bytes"]) // 2]
            q = "<image>" * n_img + rng.choice(["Describe the picture in detail.", "What do you see?",
                                                "List the colours in the picture."])
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 40)))
            batch.append({"id": i, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                          "images": images})
        pq.write_table(pa.Table.from_pylist(batch, schema=schema), os.path.join(tmp, f"part-{f:05d}.parquet"),
                       row_group_size=ROW_GROUP_SIZE)
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _mkdir(d: str) -> str:
    os.makedirs(d, exist_ok=True)
    return d


def processor_dir(data_dir: str) -> str:
    """The bundled tiny processor with a Qwen3-VL-like image processor (16-px patches, <= 384x384 px)."""
    path = os.path.join(_mkdir(data_dir), "vl-processor")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(TINY_VL, path)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        with open(os.path.join(path, name), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg.update(patch_size=16, size={"shortest_edge": 64 * 64, "longest_edge": 384 * 384})
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
    return path


# ---------------------------------------------------------------------------- child side
def _vl_processor(proc_dir: str, bad_sample: str = "error"):
    from resumable_stream.transforms import TransformConfig, VLProcessor, load_processor

    cfg = TransformConfig(format="vl", max_seq_len=4096, bad_sample=bad_sample)
    return VLProcessor(load_processor(proc_dir), cfg)


def _batches(examples, pad_id: int):
    from resumable_stream.transforms import collate_vl

    while True:
        chunk = list(itertools.islice(examples, BATCH))
        if not chunk:
            return
        yield collate_vl(chunk, pad_id)


def _ours(path: str, proc_dir: str, shuffle: bool, bad_sample: str = "error"):
    from resumable_stream import ResumableStream, StreamConfig

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=shuffle,
                       buffer_size=BUFFER)
    proc = _vl_processor(proc_dir, bad_sample)

    def examples():
        for i, row in enumerate(ResumableStream(cfg, rank=0, world_size=1)):
            proc.feed(row, i)
            while proc.ready():
                yield proc.take()
    return proc, examples()


def _hf(path: str, proc_dir: str, shuffle: bool):
    import datasets

    _common.quiet_logs()
    ds = datasets.load_dataset("parquet", data_files=_common.parquet_glob(path), split="train", streaming=True)
    if shuffle:
        ds = ds.shuffle(seed=42, buffer_size=BUFFER)
    proc = _vl_processor(proc_dir)

    def fn(sample):   # the same per-sample work, on the images HF decoded
        proc.feed(sample, sample["id"])
        ex = proc.take()
        return {"input_ids": ex["input_ids"], "labels": ex["labels"], **ex["token"], **ex["vision"]}

    def examples():
        for r in ds.map(fn, remove_columns=["messages", "images"]):
            yield {"input_ids": r.pop("input_ids"), "labels": r.pop("labels"), "keys": [str(r.pop("id"))],
                   "token": {"mm_token_type_ids": r.pop("mm_token_type_ids")}, "vision": r}
    return proc, examples()


def child_throughput(kind: str, path: str, proc_dir: str, rows: int) -> dict:
    import resumable_stream.transforms  # noqa: F401  (imports before the clock)

    t0 = time.perf_counter()
    make = _ours if kind.startswith("ours") else _hf
    proc, examples = make(path, proc_dir, kind.endswith("shuffled"))
    t1, c1 = time.perf_counter(), time.process_time()
    n = images = 0
    for batch in _batches(itertools.islice(examples, rows), proc.tokenizer.pad_token_id):
        n += batch["input_ids"].shape[0]
        images += batch["image_grid_thw"].shape[0]
    t2, c2 = time.perf_counter(), time.process_time()
    return {"kind": kind, "samples": n, "images": images, "setup_s": t1 - t0, "iter_s": t2 - t1,
            "cpu_s": c2 - c1, "samples_per_s": n / (t2 - t1), "samples_per_cpu_s": n / (c2 - c1)}


def child_breakdown(path: str, proc_dir: str, rows: int) -> dict:
    """Ours, stage by stage over the same rows: read, decode, processor, collate (CPU seconds per stage)."""
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.transforms import collate_vl
    from resumable_stream.transforms.vl import decode_image

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=True,
                       buffer_size=BUFFER)
    proc = _vl_processor(proc_dir)
    stream = ResumableStream(cfg, rank=0, world_size=1)   # opening the source is setup, as in the throughput runs
    t0 = time.process_time()
    raw = list(itertools.islice(stream, rows))
    t1 = time.process_time()
    for row in raw:
        for i, v in enumerate(row["images"]):
            decode_image(v, i)
    t2 = time.process_time()
    examples = []
    for i, row in enumerate(raw):   # decodes again: processor = this minus the decode stage
        proc.feed(row, i)
        examples.append(proc.take())
    t3 = time.process_time()
    for k in range(0, len(examples), BATCH):
        collate_vl(examples[k:k + BATCH], proc.tokenizer.pad_token_id)
    t4 = time.process_time()
    stages = {"read": t1 - t0, "decode": t2 - t1, "processor": (t3 - t2) - (t2 - t1), "collate": t4 - t3}
    return {"samples": len(raw), "images": sum(len(r["images"]) for r in raw), "stages_s": stages}


def child_hf_read(path: str, rows: int) -> dict:
    """HF streaming without .map: read + its Image decode (the part of the HF path before fn)."""
    import datasets

    _common.quiet_logs()
    ds = datasets.load_dataset("parquet", data_files=_common.parquet_glob(path), split="train", streaming=True)
    t0 = time.process_time()
    n = sum(1 for _ in itertools.islice(ds, rows))
    return {"samples": n, "read_decode_s": time.process_time() - t0}


def child_broken(kind: str, path: str, proc_dir: str, rows: int) -> dict:
    """One pass over data with broken images: HF raises, ours skips (``rows`` minus the broken ones)."""
    make = (lambda p, d, s: _ours(p, d, s, bad_sample="skip")) if kind == "ours" else _hf
    proc, examples = make(path, proc_dir, False)
    n = 0
    try:
        for _ in itertools.islice(examples, rows - max(1, rows // 100)):
            n += 1
    except Exception as e:  # noqa: BLE001 - what HF raises is the point
        return {"kind": kind, "samples": n, "error": f"{type(e).__name__}: {e}"}
    return {"kind": kind, "samples": n, "error": None, "stats": proc.stats()}


def run_child(*args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child {args[0]} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000, help="rows of the dataset (default 2000)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best counts (default 3)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    ap.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        what, *rest = args._child
        if what == "throughput":
            out = child_throughput(rest[0], rest[1], rest[2], int(rest[3]))
        elif what == "breakdown":
            out = child_breakdown(rest[0], rest[1], int(rest[2]))
        elif what == "hf_read":
            out = child_hf_read(rest[0], int(rest[1]))
        else:
            out = child_broken(rest[0], rest[1], rest[2], int(rest[3]))
        print(json.dumps(out))
        return 0

    rows = args.rows
    print(f"resumable-stream VL data-path benchmark  (python {platform.python_version()}, {os.cpu_count()} cpus, "
          "one thread per process)")
    print("data:")
    path = dataset(args.data_dir, rows, 0)
    broken_path = dataset(args.data_dir, rows, max(1, rows // 100))
    proc_dir = processor_dir(args.data_dir)

    results: dict = {"rows": rows, "repeat": args.repeat, "throughput": {}, "runs": {k: [] for k in KINDS}}
    print(f"\nsamples/s over {rows:,} rows (1-2 JPEG images of 192..384 px each), batches of {BATCH}, "
          f"each in a fresh process, best of {args.repeat} (the kinds take turns, so load from other processes "
          "falls on all of them):")
    for _ in range(args.repeat):
        for kind in KINDS:
            r = run_child("throughput", kind, path, proc_dir, str(rows))
            results["runs"][kind].append(r["samples_per_s"])
            if kind not in results["throughput"] or r["samples_per_s"] > results["throughput"][kind]["samples_per_s"]:
                results["throughput"][kind] = r
    print(f"  {'':<40} {'samples/s':>9}  {'per CPU-s':>9}")
    for kind in KINDS:
        r = results["throughput"][kind]
        spread = ", ".join(f"{v:.1f}" for v in results["runs"][kind])
        print(f"  {LABELS[kind]:<40} {r['samples_per_s']:9.1f}  {r['samples_per_cpu_s']:9.1f}  ({r['samples']} samples, "
              f"{r['images']} images; samples/s of the runs: {spread})", flush=True)
    tp = results["throughput"]
    results["ratios"] = {}
    print("\nratios (wall samples/s; per CPU-second in brackets):")
    for a, b_ in (("ours_shuffled", "hf_shuffled"), ("ours_plain", "hf_plain"), ("ours_shuffled", "hf_plain")):
        wall = tp[a]["samples_per_s"] / tp[b_]["samples_per_s"]
        cpu = tp[a]["samples_per_cpu_s"] / tp[b_]["samples_per_cpu_s"]
        results["ratios"][f"{a}/{b_}"] = {"wall": wall, "cpu": cpu}
        print(f"  {a + '/' + b_:<28} {wall:6.2f}x  ({cpu:.2f}x)")

    b = hf = None
    for _ in range(args.repeat):   # stage by stage, the fastest of the runs
        rb, rh = run_child("breakdown", path, proc_dir, str(rows)), run_child("hf_read", path, str(rows))
        b = rb if b is None else {**b, "stages_s": {k: min(v, rb["stages_s"][k]) for k, v in b["stages_s"].items()}}
        hf = rh if hf is None or rh["read_decode_s"] < hf["read_decode_s"] else hf
    results["breakdown"], results["hf_read"] = b, hf
    total = sum(b["stages_s"].values())
    print(f"\nwhere the time goes, ours (shuffled, {b['samples']} samples, {b['images']} images; CPU time, "
          "fastest run per stage):")
    for stage, s in b["stages_s"].items():
        print(f"  {stage:<10} {s * 1000 / b['samples']:7.3f} ms/sample  {100 * s / total:5.1f}%")
    print(f"  {'total':<10} {total * 1000 / b['samples']:7.3f} ms/sample  ({b['samples'] / total:.1f} samples per CPU-s)")
    print(f"  HF streaming read + Image decode alone: {hf['read_decode_s'] * 1000 / hf['samples']:.3f} ms/sample "
          f"(ours read + decode: {(b['stages_s']['read'] + b['stages_s']['decode']) * 1000 / b['samples']:.3f})")

    print(f"\nbroken images ({max(1, rows // 100)} of {rows:,} rows with truncated JPEG bytes):")
    results["broken"] = {}
    for kind in ("hf", "ours"):
        r = run_child("broken", kind, broken_path, proc_dir, str(rows))
        results["broken"][kind] = r
        if r["error"]:
            print(f"  {kind:<5} stopped after {r['samples']} samples: {r['error']}")
        else:
            s = r["stats"]
            print(f"  {kind:<5} {s['samples']} rows read, {s['examples']} samples made, {s['skipped_image']} "
                  "skipped and counted (data.bad_sample: skip)")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
