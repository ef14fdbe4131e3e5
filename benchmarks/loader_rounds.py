#!/usr/bin/env python
"""What ``data.elastic_determinism`` costs the loader: batches per CPU-second with the rule on and off.

On locally generated parquet data (400k rows, 16 files, row groups of 16384), shuffled (buffer 16384),
``data.num_partitions`` 12, one rank: a ``StreamLoader`` (batches of 32 rows, no transform) reads ``--rows`` rows
with the rule on (a round takes one micro-batch of each partition) and off (the same rounds without the step
rule: what a run without ``num_partitions`` does), each in a fresh process, alternating, ``--repeats`` times.
Printed: rows per CPU-second of each (median) and the ratio on / off (issue 47: within 5 %). With ``--workers``
the DataLoader's workers read the partitions, and wall-clock rows/s is printed too (noisy on a shared machine).

    .venv/bin/python benchmarks/loader_rounds.py [--rows N] [--repeats N] [--workers K] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

BATCH = 32


def _child(data: str, rows: int, determinism: bool, workers: int) -> dict:
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.loader import StreamLoader

    cfg = StreamConfig.from_dict({"dataset_name_or_path": "parquet", "data_files": _common.parquet_glob(data),
                                  "shuffle": True, "shuffle_seed": 3, "buffer_size": 16384, "num_partitions": 12,
                                  "elastic_determinism": determinism})
    loader = StreamLoader(ResumableStream(cfg, rank=0, world_size=1, num_workers=workers), batch_size=BATCH,
                          num_workers=workers, collate_fn=lambda rows: [r["id"] for r in rows])
    it = iter(loader)
    next(it)                                # the first windows, the workers' start: not the steady rate
    cpu, wall, seen = time.process_time(), time.perf_counter(), 0
    while seen < rows:
        seen += len(next(it))
    return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "rows": seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = _common.dataset_dir(args.data_dir, 400_000, 16)
    if args.child:
        print(json.dumps(_child(data, int(args.child[0]), args.child[1] == "on", int(args.child[2]))))
        return
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--data-dir", args.data_dir,
                                  "--child", str(args.rows), mode, str(args.workers)],
                                 check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    print(f"StreamLoader, {args.rows:,} rows in batches of {BATCH}, 12 partitions, 1 rank, {args.workers} workers, "
          f"median of {args.repeats}; load {os.getloadavg()[0]:.1f}")
    rate = {m: statistics.median(r["rows"] / r["cpu_s"] for r in runs[m]) for m in runs}
    wall = {m: statistics.median(r["rows"] / r["wall_s"] for r in runs[m]) for m in runs}
    for m in ("on", "off"):
        print(f"  elastic_determinism {m:3}: {rate[m]:>10,.0f} rows per CPU-s of the main process, "
              f"{wall[m]:>10,.0f} rows/s wall")
    print(f"  on / off: {rate['on'] / rate['off']:.3f} per CPU-s, {wall['on'] / wall['off']:.3f} wall")


if __name__ == "__main__":
    main()
