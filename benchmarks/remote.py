#!/usr/bin/env python
"""Remote parquet over a slow server: ours (dataset index, plan-driven prefetch) vs HF streaming.

The loopback test server (``tests/http_server.FileServer``) serves generated parquet (row groups of 16384
rows) with a fixed latency per request and a bandwidth limit per response: 100 ms + 100 MB/s and
30 ms + 20 MB/s. Each reader runs in its own process (clean peak RSS, no shared fsspec / HF caches) and
reads the same number of rows:

* ``ours``: ``ResumableStream`` shuffled (buffer 16384), cache off, default ``prefetch_blocks``;
* ``hf_plain``: ``load_dataset("parquet", data_files=URLs, streaming=True)``;
* ``hf_shuffled``: the same with ``.shuffle(buffer_size=16384)``;
* ``ours_cold_cache``: ours with an empty block cache (prefetch on from the first miss, the cache filling
  from the same fetches);
* ``ours_warm``: ours from a block cache filled by a previous process (its requests: opening only).

For each: rows/s (after the first sample), time to first sample (from process start of the reader,
opening included), requests, peak RSS. Then the startup requests of ours for 1, 4 and 8 ranks
(torchrun, gloo: rank 0 resolves, the index is broadcast), from nothing to every rank's stream open.

    .venv/bin/python benchmarks/remote.py [--quick] [--rows N] [--json out.json] [--data-dir DIR]
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

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests"))

BUFFER = 16384
CONDITIONS = ((0.1, 100e6), (0.03, 20e6))      # (latency s, bandwidth bytes/s)
READERS = ("ours", "hf_plain", "hf_shuffled", "ours_cold_cache", "ours_warm")


# ------------------------------------------------------------------------------ one reader (child process)
def _child(args: argparse.Namespace) -> None:
    import datasets  # noqa: F401  (imports before the clock: first sample = open + read)

    import resumable_stream  # noqa: F401

    t0 = time.perf_counter()
    urls = json.loads(args.urls)
    if args.reader.startswith("ours"):
        from resumable_stream import ResumableStream, StreamConfig

        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=urls, shuffle=True, buffer_size=BUFFER,
                           cache_dir=args.cache_dir, prefetch_blocks=args.prefetch)
        it = iter(ResumableStream(cfg))
    else:
        import datasets

        ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True)
        if args.reader == "hf_shuffled":
            ds = ds.shuffle(seed=42, buffer_size=BUFFER)
        it = iter(ds)
    first = next(it)
    t_first = time.perf_counter() - t0
    n, ids = 1, first["id"]
    t1 = time.perf_counter()
    for row in it:
        ids ^= row["id"]              # touch every sample
        n += 1
        if n >= args.rows:
            break
    secs = time.perf_counter() - t1
    print(json.dumps({"rows": n, "first_s": t_first, "rows_s": (n - 1) / secs if secs > 0 else float("inf"),
                      "peak_rss_mib": _common.peak_rss_mib()}))
    sys.stdout.flush()
    os._exit(0)      # skip teardown (HF's streaming threads): the figures are out


def _run_reader(reader: str, urls: list[str], rows: int, cache_dir: str | None, prefetch: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", reader, "--urls", json.dumps(urls),
           "--rows", str(rows), "--prefetch", str(prefetch)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_common.REPO_ROOT, os.environ.get("PYTHONPATH"))
                                                        if p)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{reader} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fill_cache(urls: list[str], rows: int, cache_dir: str, prefetch: int) -> None:
    code = ("import itertools, json, sys; from resumable_stream import ResumableStream, StreamConfig; "
            "urls, rows, cache, depth = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]); "
            "s = ResumableStream(StreamConfig(dataset_name_or_path='parquet', data_files=urls, shuffle=True, "
            f"buffer_size={BUFFER}, cache_dir=cache, prefetch_blocks=depth)); "
            "[None for _ in itertools.islice(s, rows + 2 * " + str(BUFFER) + ")]; s.source.flush()")
    env = {**os.environ, "PYTHONPATH": _common.REPO_ROOT}
    subprocess.run([sys.executable, "-c", code, json.dumps(urls), str(rows), cache_dir, str(prefetch)], env=env,
                   check=True, timeout=1800)


_RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
from resumable_stream import ResumableStream, StreamConfig
dist.init_process_group("gloo")
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=json.loads(open(sys.argv[1]).read()))
ResumableStream(cfg, rank=dist.get_rank(), world_size=dist.get_world_size())
dist.barrier()
dist.destroy_process_group()
"""


def _startup_requests(srv, urls: list[str], ranks: int, work: str) -> int:
    from training_helpers import free_port

    script, listing = os.path.join(work, "rank.py"), os.path.join(work, "urls.json")
    with open(script, "w") as f:
        f.write(_RANK_SCRIPT)
    with open(listing, "w") as f:
        json.dump(urls, f)
    env = {**os.environ, "PYTHONPATH": _common.REPO_ROOT, "OMP_NUM_THREADS": "1"}
    srv.reset_stats()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), script, listing], env=env, check=True,
                   capture_output=True, timeout=900)
    return srv.stats()["requests"]


# ------------------------------------------------------------------------------ the run
def bench(path: str, rows: int, prefetch: int, ranks: tuple[int, ...], readers: tuple[str, ...] = READERS) -> dict:
    from http_server import FileServer

    files = _common.parquet_files(path)
    out: dict = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "conditions": []}
    work = tempfile.mkdtemp(prefix="rs-bench-remote-")
    try:
        with FileServer(path) as srv:
            urls = [srv.url(os.path.basename(f)) for f in files]
            for latency, bandwidth in CONDITIONS:
                srv.latency_s, srv.bandwidth_bps = latency, bandwidth
                cond = {"latency_s": latency, "bandwidth_mb_s": bandwidth / 1e6, "readers": {}}
                print(f"  {latency * 1000:.0f} ms + {bandwidth / 1e6:.0f} MB/s, {rows:,} rows per reader", flush=True)
                cache = os.path.join(work, f"cache-{latency}")
                for reader in readers:
                    if reader == "ours_warm":
                        _fill_cache(urls, rows, cache, prefetch)
                    srv.reset_stats()
                    cache_dir = {"ours_warm": cache, "ours_cold_cache": os.path.join(work, f"cold-{latency}")}.get(reader)
                    res = _run_reader(reader, urls, rows, cache_dir, prefetch)
                    res["requests"] = srv.stats()["requests"]
                    cond["readers"][reader] = res
                    print(f"    {reader:12s} {res['rows_s']:12,.0f} rows/s  first sample {res['first_s']:6.2f} s  "
                          f"{res['requests']:5d} requests  peak RSS {res['peak_rss_mib']:7.0f} MiB", flush=True)
                r = cond["readers"]
                if {"ours", "hf_plain", "hf_shuffled"} <= set(r):
                    cond["ours_over_hf_plain"] = r["ours"]["rows_s"] / r["hf_plain"]["rows_s"]
                    cond["ours_over_hf_shuffled"] = r["ours"]["rows_s"] / r["hf_shuffled"]["rows_s"]
                    print(f"    ours / HF plain {cond['ours_over_hf_plain']:.2f}x, ours / HF shuffled "
                          f"{cond['ours_over_hf_shuffled']:.2f}x", flush=True)
                out["conditions"].append(cond)
            srv.latency_s, srv.bandwidth_bps = CONDITIONS[0]
            out["startup_requests"] = {}
            for w in ranks:
                out["startup_requests"][w] = _startup_requests(srv, urls, w, work)
                print(f"  startup, {w} rank(s) (torchrun, gloo): {out['startup_requests'][w]} requests for "
                      f"{len(files)} files", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200k rows in 16 files, 60k rows per reader")
    p.add_argument("--rows", type=int, default=None, help="rows per reader (default 300000, quick 60000)")
    p.add_argument("--prefetch", type=int, default=8, help="data.prefetch_blocks for ours (default 8)")
    p.add_argument("--ranks", default="1,4,8", help="rank counts for the startup requests (default 1,4,8; "
                                                    "empty: none)")
    p.add_argument("--readers", default=",".join(READERS), help=f"readers to run (default {','.join(READERS)})")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--urls", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.reader = args.child
        args.rows = args.rows or 1
        _child(args)
        return
    total = 200_000 if args.quick else 1_000_000
    rows = args.rows or (60_000 if args.quick else 300_000)
    path = _common.dataset_dir(args.data_dir, total, 16, row_group_size=4096 if args.quick else 16384)
    print(f"remote parquet benchmark: {total:,} rows in 16 files ({platform.machine()}, {os.cpu_count()} CPUs)")
    result = {"rows_total": total, "rows_per_reader": rows, "prefetch_blocks": args.prefetch,
              **bench(path, rows, args.prefetch, tuple(int(x) for x in args.ranks.split(",") if x.strip()),
                      tuple(r for r in args.readers.split(",") if r in READERS))}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
