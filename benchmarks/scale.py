#!/usr/bin/env python
"""Checkpoint state at scale, and what the state costs per batch.

1. **State size and save / open times** for 8 / 64 / 512 / 1,024 ranks x 16 / 2,048 / 10,000 files
   (tiny parquet files; the ranks are simulated in one process, each a ``ResumableStream`` over one shared
   source, as a torchrun job's ranks would be): bytes of a rank file and of the whole ``stream_state/``,
   the time every rank spends writing its file (summed), ``write_manifest`` (rank 0, after every rank),
   and opening one rank's state again (``load_sidecar`` of the directory).
2. **state_dict** of one rank that reads 1,024 partitions of a dataset of 4,096 shards (row groups).
3. **Per-batch cost**: rows per CPU-second of a ``StreamLoader`` (identity transform, batches of 32, no
   workers) against the bare stream it reads, buffer 16,384 over 4,096 shards: what the per-batch snapshot
   costs (best of 3, alternating).

    .venv/bin/python benchmarks/scale.py [--quick] [--json out.json] [--data-dir DIR]

The same script runs against an older checkout (``PYTHONPATH=/path/to/old`` before the command) for
before / after figures: it only uses the public API.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

RANKS = (8, 64, 512, 1024)
FILES = (16, 2048, 10000)


def rows_per_file(files: int) -> int:
    """Few files: enough rows that 1,024 partitions striding over them each get some; many: a handful."""
    return 2048 if files < 1024 else 8
BATCH = 32
PARTS = ("scale", "state_dict", "per_batch")
PART_TITLES = {"scale": "state at scale (simulated ranks)", "state_dict": "state_dict", "per_batch": "per-batch cost"}


def tiny_files(data_dir: str, files: int) -> str:
    """``files`` small parquet files, generated once under ``data_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = rows_per_file(files)
    path = os.path.join(data_dir, f"tiny-{files}f-{rows}r")
    if os.path.exists(os.path.join(path, "COMPLETE")):
        return path
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=data_dir)
    for f in range(files):
        ids = list(range(f * rows, (f + 1) * rows))
        pq.write_table(pa.table({"id": ids, "text": [f"row {i}" for i in ids]}),
                       os.path.join(tmp, f"part-{f:05d}.parquet"))
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def state_at_scale(data_dir: str, files_list, ranks_list) -> list[dict]:
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.sources import open_source
    from resumable_stream.state.checkpoint import write_manifest

    rows = []
    for files in files_list:
        path = tiny_files(data_dir, files)
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=True,
                           buffer_size=64)
        t0 = time.perf_counter()
        source = open_source(cfg.source_spec)
        opened = time.perf_counter() - t0
        for world in ranks_list:
            out = tempfile.mkdtemp(prefix="rs-scale-")
            state_dir = os.path.join(out, "stream_state")
            write_s, again_s, rank_files = 0.0, 0.0, []
            for rank in range(world):
                stream = ResumableStream(cfg, rank=rank, world_size=world, source=source)
                next(iter(stream))
                t0 = time.perf_counter()
                rank_files.append(stream.write_sidecar(state_dir, stream.state_dict(), manifest=False))
                write_s += time.perf_counter() - t0
                t0 = time.perf_counter()      # the rank's next save (the next checkpoint): the steady state
                stream.write_sidecar(os.path.join(out, "next"), stream.state_dict(), manifest=False)
                again_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            write_manifest(state_dir, world)
            manifest_s = time.perf_counter() - t0
            sizes = [os.path.getsize(f) for f in rank_files]
            again = ResumableStream(cfg, rank=world - 1, world_size=world, source=source)
            t0 = time.perf_counter()
            again.load_sidecar(out)
            open_s = time.perf_counter() - t0
            rows.append({"files": files, "ranks": world, "rank_file_bytes": max(sizes),
                         "stream_state_bytes": dir_bytes(state_dir), "write_all_ranks_s": round(write_s, 4),
                         "write_per_rank_ms": round(1000 * write_s / world, 3),
                         "next_save_per_rank_ms": round(1000 * again_s / world, 3), "write_manifest_s": round(manifest_s, 4),
                         "open_one_rank_s": round(open_s, 4), "source_open_s": round(opened, 2)})
            print(f"  {files:>6} files x {world:>5} ranks: rank file {max(sizes) / 1e3:8.1f} KB, stream_state "
                  f"{rows[-1]['stream_state_bytes'] / 1e6:8.2f} MB, write {1000 * write_s / world:6.2f} ms/rank "
                  f"(next save {1000 * again_s / world:6.2f}), "
                  f"write_manifest {manifest_s:6.3f} s, open one rank {open_s:6.3f} s", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    return rows


def many_shards(data_dir: str) -> str:
    """1,048,576 rows in 16 files of 256 row groups (4,096 shards of 256 rows)."""
    return _common.dataset_dir(data_dir, rows=1 << 20, files=16, row_group_size=256)


def state_dict_cost(data_dir: str, partitions: int, repeats: int) -> dict:
    from resumable_stream import ResumableStream, StreamConfig

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(many_shards(data_dir)),
                       shuffle=True, buffer_size=256, num_partitions=partitions)
    stream = ResumableStream(cfg, rank=0, world_size=1)
    it = iter(stream)
    for _ in range(partitions * 3):       # every partition has read (its window is built)
        next(it)
    shards = len(stream.source.shards)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        stream.state_dict()
        times.append(time.perf_counter() - t0)
        next(it)
    best = min(times)
    print(f"  state_dict at {partitions} partitions x {shards} shards: {1000 * best:.1f} ms (best of {repeats})",
          flush=True)
    return {"partitions": partitions, "shards": shards, "state_dict_ms": round(1000 * best, 2)}


def per_batch_cost(data_dir: str, rows: int, repeats: int) -> dict:
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.loader import StreamLoader
    from resumable_stream.sources import open_source

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(many_shards(data_dir)),
                       shuffle=True, buffer_size=16384)
    source = open_source(cfg.source_spec)

    # rows per CPU-second (process time): on a shared machine wall time measures the neighbours
    def bare() -> float:
        it = iter(ResumableStream(cfg, rank=0, world_size=1, source=source))
        next(it)
        t0 = time.process_time()
        for _ in range(rows):
            next(it)
        return rows / (time.process_time() - t0)

    def loader() -> float:
        it = iter(StreamLoader(ResumableStream(cfg, rank=0, world_size=1, source=source), batch_size=BATCH))
        next(it)
        t0 = time.process_time()
        for _ in range(rows // BATCH):
            next(it)
        return (rows // BATCH) * BATCH / (time.process_time() - t0)

    b = ld = 0.0
    for _ in range(repeats):        # alternating, best of each
        b, ld = max(b, bare()), max(ld, loader())
    print(f"  bare stream {b:,.0f} rows/CPU-s, StreamLoader (batches of {BATCH}) {ld:,.0f} rows/CPU-s: "
          f"{ld / b:.2f}x (buffer 16384, {len(source.shards)} shards)", flush=True)
    return {"bare_rows_per_s": round(b), "loader_rows_per_s": round(ld), "loader_vs_bare": round(ld / b, 3),
            "batch_size": BATCH, "buffer_size": 16384, "shards": len(source.shards)}


def _part(args: argparse.Namespace) -> object:
    files, ranks = ((16, 2048), (8, 64)) if args.quick else (FILES, RANKS)
    if args.part == "scale":
        return state_at_scale(args.data_dir, files, ranks)
    if args.part == "state_dict":
        return state_dict_cost(args.data_dir, 1024, 3 if args.quick else 5)
    return per_batch_cost(args.data_dir, 50_000 if args.quick else 200_000, 2 if args.quick else 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 / 2,048 files x 8 / 64 ranks, fewer rows")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)   # one part, in this process
    args = ap.parse_args()
    _common.quiet_logs()
    if args.part:
        print("RESULT " + json.dumps(_part(args)), flush=True)
        return
    import resumable_stream

    print(f"resumable_stream from {os.path.dirname(resumable_stream.__file__)}; python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")
    results = {}
    for n, part in enumerate(PARTS, start=1):    # each in a fresh process: no heap of the others around
        print(f"{n}. {PART_TITLES[part]}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--data-dir", args.data_dir]
        out = subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, stdout=subprocess.PIPE,
                             text=True).stdout
        print("\n".join(line for line in out.splitlines() if not line.startswith("RESULT ")), flush=True)
        results[part] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "library": os.path.dirname(resumable_stream.__file__)}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
