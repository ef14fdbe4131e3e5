#!/usr/bin/env python
"""Throughput of a 2-source weighted mixture against a single stream over the same rows, and HF's mixture.

Two locally generated parquet datasets, A (60% of the rows, 10 files) and B (40%, 6 files), row groups
of 16384, shuffled with buffer 16384, each reader in a fresh process, best of ``--repeat`` runs:

* ours, single stream over A and B together (one source, ``data_files`` = both globs);
* ours, mixture of A and B with weights 0.6 / 0.4 (``stopping: all_exhausted``);
* HF ``interleave_datasets`` of A and B, each ``.shuffle(buffer_size=16384)``, probabilities 0.6 / 0.4,
  ``stopping_strategy="all_exhausted"``;

each reading as many samples as A and B have rows together (HF's, which takes minutes, once). Prints
rows/s and the ratios mixture / single (the mixture's overhead) and ours / HF.

    .venv/bin/python benchmarks/mixture.py [--quick] [--repeat N] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

BUFFER = 16384
WEIGHTS = (0.6, 0.4)
KINDS = ("ours_single", "ours_mixture", "hf_mixture")
LABELS = {
    "ours_single": "ours, one stream over A + B",
    "ours_mixture": "ours, mixture 0.6 A + 0.4 B",
    "hf_mixture": "HF interleave_datasets 0.6 A + 0.4 B",
}


def _open(kind: str, a: str, b: str):
    if kind == "ours_single":
        from resumable_stream import ResumableStream, StreamConfig

        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[_common.parquet_glob(a), _common.parquet_glob(b)],
                           shuffle=True, buffer_size=BUFFER)
        return iter(ResumableStream(cfg, rank=0, world_size=1))
    if kind == "ours_mixture":
        from resumable_stream import MixtureStream, StreamConfig

        cfg = StreamConfig.from_dict({"shuffle": True, "buffer_size": BUFFER, "stopping": "all_exhausted", "sources": [
            {"label": "a", "dataset_name_or_path": "parquet", "data_files": _common.parquet_glob(a), "weight": WEIGHTS[0]},
            {"label": "b", "dataset_name_or_path": "parquet", "data_files": _common.parquet_glob(b), "weight": WEIGHTS[1]},
        ]})
        return iter(MixtureStream(cfg, rank=0, world_size=1))
    if kind == "hf_mixture":
        import datasets

        _common.quiet_logs()
        parts = [datasets.load_dataset("parquet", data_files=_common.parquet_glob(p), split="train", streaming=True)
                 .shuffle(seed=42, buffer_size=BUFFER) for p in (a, b)]
        return iter(datasets.interleave_datasets(parts, probabilities=list(WEIGHTS), seed=42,
                                                 stopping_strategy="all_exhausted"))
    raise ValueError(kind)


def child(kind: str, a: str, b: str, rows: int) -> dict:
    import datasets  # noqa: F401  (imports are not timed)

    import resumable_stream.stream.mixture  # noqa: F401

    t0 = time.perf_counter()
    it = _open(kind, a, b)
    t1 = time.perf_counter()
    n = 0
    for row in itertools.islice(it, rows):
        row["id"]
        n += 1
    t2 = time.perf_counter()
    return {"kind": kind, "rows": n, "setup_s": t1 - t0, "iter_s": t2 - t1, "rows_per_s": n / (t2 - t1)}


def run_child(kind: str, a: str, b: str, rows: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, a, b, str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child {kind} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k rows in all instead of 1M")
    ap.add_argument("--repeat", type=int, default=3, help="runs per reader, best kept (default 3)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        kind, a, b, rows = args._child
        print(json.dumps(child(kind, a, b, int(rows))))
        return 0

    total = 100_000 if args.quick else 1_000_000
    rows_a, rows_b = int(total * WEIGHTS[0]), total - int(total * WEIGHTS[0])
    print(f"resumable-stream mixture benchmark  (python {platform.python_version()}, {os.cpu_count()} cpus"
          f"{', QUICK' if args.quick else ''})\ndata:")
    a = _common.dataset_dir(args.data_dir, rows_a, 10)
    b = _common.dataset_dir(args.data_dir, rows_b, 6)
    print(f"\n{total:,} samples per reader (A {rows_a:,} rows + B {rows_b:,} rows), shuffled, buffer {BUFFER}, "
          f"best of {args.repeat} fresh processes (HF: one):")
    best: dict[str, dict] = {}
    for rep in range(args.repeat):
        for kind in KINDS:
            if kind == "hf_mixture" and rep:
                continue
            r = run_child(kind, a, b, total)
            assert r["rows"] == total, r
            if kind not in best or r["rows_per_s"] > best[kind]["rows_per_s"]:
                best[kind] = r
    for kind in KINDS:
        r = best[kind]
        print(f"  {LABELS[kind]:<38} {r['rows_per_s']:>11,.0f} rows/s  ({r['iter_s']:.2f} s, setup {r['setup_s']:.2f} s)")

    def ratio(x: str, y: str) -> float:
        return best[x]["rows_per_s"] / best[y]["rows_per_s"]

    print("\nratios:")
    print(f"  mixture / single stream (ours)     {ratio('ours_mixture', 'ours_single'):6.2f}x")
    print(f"  ours mixture / HF mixture          {ratio('ours_mixture', 'hf_mixture'):6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
