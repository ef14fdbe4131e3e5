#!/usr/bin/env python
"""How steady ours is over a slow server, run after run (issue 48, item 5): the remote parquet layout of
benchmarks/remote.py (1M rows in 16 files, row groups of 5,000, loopback server at 100 ms + 100 MB/s), ours
shuffled reading a whole epoch in a fresh process ``--runs`` times, and HF streaming plain ``--hf-runs`` times
(``--hf-rows`` rows each). Every run is printed (first sample, rows/s after it, rows/s counting it, requests), then
each run's ratio to HF plain's median rate. ``--trees A,B``: other checkouts of this repository to run ours from,
alternating with this one (a base commit, ``git archive``'d), each run's figures beside this tree's.

    .venv/bin/python benchmarks/remote_steady.py [--runs 10] [--hf-runs 3] [--hf-rows 200000] [--trees DIR,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))


def _child(tree: str, reader: str, urls: list[str], rows: int) -> dict:
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "remote.py"), "--child", reader, "--urls",
           json.dumps(urls), "--rows", str(rows)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{reader} ({tree}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--hf-runs", type=int, default=3)
    p.add_argument("--hf-rows", type=int, default=200_000)
    p.add_argument("--trees", default="", help="other checkouts to run ours from, alternating with this one")
    p.add_argument("--json", default=None)
    p.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    args = p.parse_args()
    from http_server import FileServer

    total = 1_000_000
    path = _common.dataset_dir(args.data_dir, total, 16, row_group_size=5000)
    files = sorted(f for f in os.listdir(path) if f.endswith(".parquet"))
    trees = {"this": _common.REPO_ROOT, **{os.path.basename(t.rstrip("/")): t for t in args.trees.split(",") if t}}
    runs: dict[str, list[dict]] = {name: [] for name in [*trees, "hf_plain"]}
    print(f"load average at start: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    with FileServer(path) as srv:
        srv.latency_s, srv.bandwidth_bps = 0.1, 100e6
        urls = [srv.url(f) for f in files]
        for i in range(args.runs):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                srv.reset_stats()
                r = _child(trees[name], "ours", urls, total)
                r["with_first_rows_s"] = r["rows"] / (r["first_s"] + (r["rows"] - 1) / r["rows_s"])
                r["requests"] = srv.stats()["requests"]
                runs[name].append(r)
                print(f"  {name:10s} run {i}: first sample {r['first_s']:.3f} s, {r['rows_s']:,.0f} rows/s after it, "
                      f"{r['with_first_rows_s']:,.0f} counting it, {r['requests']} requests "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
            if i < args.hf_runs:
                r = _child(_common.REPO_ROOT, "hf_plain", urls, args.hf_rows)
                runs["hf_plain"].append(r)
                print(f"  hf_plain   run {i}: first sample {r['first_s']:.3f} s, {r['rows_s']:,.0f} rows/s", flush=True)
    hf = statistics.median(r["rows_s"] for r in runs["hf_plain"])
    print(f"HF plain: {hf:,.0f} rows/s (median of {len(runs['hf_plain'])})")
    for name in trees:
        rs = runs[name]
        firsts = ", ".join(f"{r['first_s']:.2f}" for r in rs)
        ratios = ", ".join(f"{r['with_first_rows_s'] / hf:.1f}x" for r in rs)
        print(f"{name}: first sample median {statistics.median(r['first_s'] for r in rs):.3f} s (runs {firsts}); "
              f"/ HF plain, each run: {ratios} (first sample counted)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
