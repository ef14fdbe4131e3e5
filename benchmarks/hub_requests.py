#!/usr/bin/env python
"""Requests one training job makes against the Hub, for 1, 4 and 8 ranks: ours vs HF streaming.

A loopback Hub (``tests/hub_server.HubServer``, ``--latency`` per request, default 50 ms) serves a dataset
repo of ``--files`` parquet files. Each job is a real ``torch.distributed.run`` (gloo) whose every rank
opens the dataset and reads ``--samples`` shuffled samples:

* ``ours``: ``ResumableStream(StreamConfig(dataset_name_or_path=repo, data_files="data/*.parquet", ...),
  rank, world_size)``: rank 0 resolves the repo and builds the dataset index, the other ranks get it over
  ``torch.distributed``;
* ``hf``: ``datasets.load_dataset(repo, data_files=..., streaming=True)`` + ``split_dataset_by_node`` +
  ``shuffle``: every rank resolves by itself.

Printed per job: API requests (repo info, tree listings, paths-info), file requests (``resolve``: HEAD and
ranged GETs), all requests, and the job's wall time.

    .venv/bin/python benchmarks/hub_requests.py [--files 16] [--samples 200] [--ranks 1 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(REPO_ROOT, "tests", "_support") not in sys.path:
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "_support"))

REPO = "bench/data"
BUFFER = 100

_RANK_SCRIPT = textwrap.dedent("""
    import itertools, os, sys
    import torch.distributed as dist
    reader, repo, samples, buffer = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if reader == "ours":
        from resumable_stream import ResumableStream, StreamConfig
        dist.init_process_group("gloo")
        cfg = StreamConfig(dataset_name_or_path=repo, data_files="data/*.parquet", shuffle=True,
                           buffer_size=buffer)
        rows = list(itertools.islice(ResumableStream(cfg, rank=rank, world_size=world), samples))
        dist.destroy_process_group()
    else:
        import datasets
        from datasets.distributed import split_dataset_by_node
        ds = datasets.load_dataset(repo, data_files="data/*.parquet", split="train", streaming=True)
        ds = split_dataset_by_node(ds, rank=rank, world_size=world).shuffle(seed=1, buffer_size=buffer)
        rows = list(itertools.islice(ds, samples))
    assert len(rows) == samples, (rank, len(rows))
""")


def job_requests(hub, home: str, reader: str, ranks: int, samples: int, work: str) -> dict:
    """Run one job of ``ranks`` ranks with ``reader`` against ``hub``; its request counts and wall time."""
    from hub_server import hub_env
    from training_helpers import free_port

    script = os.path.join(work, "rank.py")
    with open(script, "w") as f:
        f.write(_RANK_SCRIPT)
    env = {**os.environ, **hub_env(hub, home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH")] if p)}
    hub.reset_stats()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, reader, REPO,
                           str(samples), str(BUFFER)], env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{reader} x {ranks} ranks failed:\n{proc.stderr[-4000:]}")
    recs = list(hub.requests)
    api = sum(1 for r in recs if r.path.startswith("/api/"))
    files = sum(1 for r in recs if "/resolve/" in r.path)
    return {"api": api, "files": files, "all": len(recs), "wall_s": round(wall, 1)}


def make_hub(work: str, files: int, rows_per_file: int):
    from hub_server import HubServer

    from resumable_stream.testing import write_parquet_dataset

    write_parquet_dataset(os.path.join(work, "repo", "data"), rows=files * rows_per_file, files=files,
                          row_group_size=max(1, rows_per_file // 4))
    hub = HubServer(os.path.join(work, "store")).start()
    hub.commit(REPO, directory=os.path.join(work, "repo"))
    return hub


def main() -> None:
    import _common  # noqa: F401  (a private HF cache for this run; the test suite imports this module without it)

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--rows-per-file", type=int, default=400)
    ap.add_argument("--samples", type=int, default=200, help="samples each rank reads")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--latency", type=float, default=0.05, help="seconds per request (default 0.05)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rs-bench-hub-")
    hub = make_hub(work, args.files, args.rows_per_file)
    hub.latency_s = args.latency
    results = []
    try:
        print(f"{args.files} parquet files in {REPO}, {args.samples} samples per rank, "
              f"{args.latency * 1000:.0f} ms per request")
        print(f"{'ranks':>5} | {'ours api':>8} {'files':>6} {'all':>5} {'wall s':>6} | "
              f"{'HF api':>7} {'files':>6} {'all':>5} {'wall s':>6} | all HF/ours")
        for ranks in args.ranks:
            row = {"ranks": ranks}
            for reader in ("ours", "hf"):
                row[reader] = job_requests(hub, os.path.join(work, f"home-{reader}-{ranks}"), reader, ranks,
                                           args.samples, work)
            o, h = row["ours"], row["hf"]
            print(f"{ranks:>5} | {o['api']:>8} {o['files']:>6} {o['all']:>5} {o['wall_s']:>6} | "
                  f"{h['api']:>7} {h['files']:>6} {h['all']:>5} {h['wall_s']:>6} | {h['all'] / o['all']:.1f}x",
                  flush=True)
            results.append(row)
    finally:
        hub.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": args.files, "samples": args.samples, "latency_s": args.latency,
                       "jobs": results}, f, indent=1)


if __name__ == "__main__":
    main()
