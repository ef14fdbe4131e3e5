#!/usr/bin/env python
"""Remote parquet over a slow server: ours (dataset index, plan-driven prefetch) vs HF streaming.

The loopback test server (``tests/http_server.FileServer``) serves generated parquet (1M rows in 16 files,
row groups of 5,000 and of 16,384 rows: one data set each) with a fixed latency per request and a bandwidth
limit per response: 100 ms + 100 MB/s and 30 ms + 20 MB/s. Each reader runs in its own process (clean peak
RSS, no shared fsspec / HF caches) and reads the same number of rows:

* ``ours``: ``ResumableStream`` shuffled (buffer 16384), cache off, adaptive prefetch depth (default
  ``prefetch_memory_mb``; ``--prefetch N`` sets ``prefetch_blocks``, the cap);
* ``hf_plain``: ``load_dataset("parquet", data_files=URLs, streaming=True)``;
* ``hf_shuffled``: the same with ``.shuffle(buffer_size=16384)``;
* ``ours_cold_cache``: ours with an empty block cache (prefetch on from the first miss, the cache filling
  from the same fetches);
* ``ours_warm``: ours from a block cache filled by a previous process (its requests: opening only).

For each: rows/s (after the first sample), time to first sample (from process start of the reader,
opening included), requests, peak RSS; for ours also the prefetch depth it settled on (the depth of its
last hints), the most fetches in flight at once, its bytes held at most, and the bound the concurrency
allows, ``depth x rows per row group / latency``, beside the measured rate. ``--repeat N``: each reader N
times, the best rate (and its figures) kept. Then the startup requests of ours for 1, 4 and 8 ranks
(torchrun, gloo: rank 0 resolves, the index is broadcast), from nothing to every rank's stream open.

    .venv/bin/python benchmarks/remote.py [--quick] [--rows N] [--row-groups 5000,16384] [--repeat 3]
        [--readers ours,hf_plain,...] [--s3 | --s3-only] [--json out.json] [--data-dir DIR]

``--s3``: time to first sample over moto's S3 server on loopback (authentication on), ours and HF
streaming, each in a fresh process, imports excluded, with the requests by kind and ours's phases
(resolving the files with ``datasets``, building the index, the rest: the first window).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))

BUFFER = 16384
CONDITIONS = ((0.1, 100e6), (0.03, 20e6))      # (latency s, bandwidth bytes/s)
READERS = ("ours", "hf_plain", "hf_shuffled", "ours_cold_cache", "ours_warm")


# ------------------------------------------------------------------------------ one reader (child process)
def _child(args: argparse.Namespace) -> None:
    import datasets  # noqa: F401  (imports before the clock: first sample = open + read)

    # the stream's modules themselves: the package's public names load on first use (its __init__)
    import resumable_stream.stream.mixture  # noqa: F401

    # The first full garbage collection after importing datasets and torch (~240k objects) stops every thread
    # for 130-180 ms; left to chance it lands in a reader's first second. Done before the clock, for every
    # reader (it does not come back within the epoch: too few objects survive to trigger another).
    gc.collect()
    t0 = time.perf_counter()
    urls = json.loads(args.urls)
    if args.reader.startswith("ours"):
        from resumable_stream import ResumableStream, StreamConfig

        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=urls, shuffle=True, buffer_size=BUFFER,
                           cache_dir=args.cache_dir, prefetch_blocks=args.prefetch)
        stream = ResumableStream(cfg)
        it = iter(stream)
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
    out = {"rows": n, "first_s": t_first, "rows_s": (n - 1) / secs if secs > 0 else float("inf"),
           "peak_rss_mib": _common.peak_rss_mib()}
    if args.reader.startswith("ours"):
        src = getattr(stream.source, "inner", stream.source)
        stats = src.prefetch_stats() if hasattr(src, "prefetch_stats") else (
            {"depth": {0: src.prefetch_depth}} if getattr(src, "prefetch_depth", 0) else {})
        if stats:
            out["prefetch"] = {k: v for k, v in stats.items() if k in (
                "depth", "depth_median", "fetch_s", "busy_s", "peak_bytes", "peak_in_flight", "started", "taken", "wasted",
                "over_budget", "budget", "cap", "waited", "wait_s")}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)      # skip teardown (HF's streaming threads): the figures are out


def _run_reader(reader: str, urls: list[str], rows: int, cache_dir: str | None, prefetch: int | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", reader, "--urls", json.dumps(urls),
           "--rows", str(rows)] + (["--prefetch", str(prefetch)] if prefetch is not None else [])
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_common.REPO_ROOT, os.environ.get("PYTHONPATH"))
                                                        if p)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{reader} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fill_cache(urls: list[str], rows: int, cache_dir: str, prefetch: int | None) -> None:
    code = ("import itertools, json, sys; from resumable_stream import ResumableStream, StreamConfig; "
            "urls, rows, cache, depth = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "
            "json.loads(sys.argv[4]); "
            "s = ResumableStream(StreamConfig(dataset_name_or_path='parquet', data_files=urls, shuffle=True, "
            f"buffer_size={BUFFER}, cache_dir=cache, prefetch_blocks=depth)); "
            "[None for _ in itertools.islice(s, rows + 2 * " + str(BUFFER) + ")]; s.source.flush()")
    env = {**os.environ, "PYTHONPATH": _common.REPO_ROOT}
    subprocess.run([sys.executable, "-c", code, json.dumps(urls), str(rows), cache_dir, json.dumps(prefetch)], env=env,
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


# ------------------------------------------------------------------------------ S3 (moto on loopback)
_S3_CHILD = """
import json, os, sys, time
import datasets, s3fs  # noqa: F401  (imports before the clock)
import resumable_stream.stream.mixture  # noqa: F401  (the public names load on first use)
import gc; gc.collect()  # the first full collection after the imports, before the clock (see _child)
t0 = time.perf_counter()
reader, endpoint = sys.argv[1], sys.argv[2]
phases = {}
if reader == "ours":
    from resumable_stream import ResumableStream, StreamConfig
    import resumable_stream.sources.open as O
    import resumable_stream.sources.resolve as R
    for module, name, phase in ((R, "resolve_files", "resolve_files"), (O, "build_index", "build_parquet_index")):
        def timed(*a, _f=getattr(module, name), _n=phase, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                phases[_n] = (time.perf_counter() - t) * 1000
        setattr(module, name, timed)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files="s3://data/ds/*.parquet", shuffle=True,
                       buffer_size=16384, storage_options={"endpoint_url": endpoint})
    stream = ResumableStream(cfg)
    phases["open"] = (time.perf_counter() - t0) * 1000
    it = iter(stream)
else:
    ds = datasets.load_dataset("parquet", data_files="s3://data/ds/*.parquet", split="train", streaming=True,
                               storage_options={"endpoint_url": endpoint})
    it = iter(ds)
next(it)
print(json.dumps({"first_ms": (time.perf_counter() - t0) * 1000, "phases_ms": phases}))
sys.stdout.flush()
os._exit(0)
"""


def s3_first_sample(path: str, repeat: int, readers: tuple[str, ...] = ("ours", "hf_plain")) -> dict:
    """Time to first sample over moto's S3 server (tests/_support/s3_server.py, authentication on) on 127.0.0.1, each
    reader in a fresh process (imports excluded), best of ``repeat``; the requests of the best run by kind."""
    from collections import Counter

    from s3_server import S3Server

    out: dict = {}
    with S3Server(readable=("data",)) as srv:
        s3 = srv.admin()
        s3.create_bucket(Bucket="data")
        for f in _common.parquet_files(path):
            s3.upload_file(f, "data", "ds/" + os.path.basename(f))
        env = {**os.environ, **srv.env(), "PYTHONPATH": _common.REPO_ROOT}
        for reader in readers:
            runs = []
            for _ in range(repeat):
                before = len(srv.requests)
                res = subprocess.run([sys.executable, "-c", _S3_CHILD, reader, srv.endpoint], env=env,
                                     capture_output=True, text=True, timeout=600)
                if res.returncode != 0:
                    raise RuntimeError(f"S3 {reader} failed:\n{res.stderr[-3000:]}")
                run = json.loads(res.stdout.strip().splitlines()[-1])
                with srv.lock:
                    reqs = list(srv.requests[before:])
                run["requests"] = dict(Counter(m for m, _ in reqs))
                runs.append(run)
            best = min(runs, key=lambda r: r["first_ms"])
            out[reader] = {**best, "runs_first_ms": [r["first_ms"] for r in runs]}
            phases = ", ".join(f"{k} {v:.0f} ms" for k, v in best.get("phases_ms", {}).items())
            print(f"  S3 {reader:9s} first sample {best['first_ms']:6.0f} ms (runs: "
                  f"{', '.join(f'{r:.0f}' for r in out[reader]['runs_first_ms'])}), requests {best['requests']}"
                  + (f"; {phases}" if phases else ""), flush=True)
    return out


# ------------------------------------------------------------------------------ the run
def _depth(res: dict) -> int | None:
    """The prefetch depth ours kept: the median of its depth at every hand-over (the fixed depth before)."""
    pf = res.get("prefetch") or {}
    if pf.get("depth_median"):
        return pf["depth_median"]
    depth = pf.get("depth") or {}
    return max(depth.values()) if depth else None


def _best(runs: list[dict], rg_rows: int, latency: float) -> dict:
    """The fastest run, with every run's rate, first sample and (for ours) share of the bound beside it."""
    best = max(runs, key=lambda r: r["rows_s"])
    shares = [r["rows_s"] / (_depth(r) * rg_rows / latency) if _depth(r) else None for r in runs]
    return {**best, "runs_rows_s": [r["rows_s"] for r in runs], "runs_first_s": [r["first_s"] for r in runs],
            "runs_of_bound": shares}


def bench(path: str, rows: int, prefetch: int | None, ranks: tuple[int, ...], readers: tuple[str, ...] = READERS,
          repeat: int = 1, conditions: tuple = CONDITIONS) -> dict:
    from http_server import FileServer

    files = _common.parquet_files(path)
    import pyarrow.parquet as pq

    rg_rows = pq.ParquetFile(files[0]).metadata.row_group(0).num_rows
    out: dict = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "row_group_rows": rg_rows,
                 "conditions": []}
    work = tempfile.mkdtemp(prefix="rs-bench-remote-")
    try:
        with FileServer(path) as srv:
            urls = [srv.url(os.path.basename(f)) for f in files]
            for latency, bandwidth in conditions:
                srv.latency_s, srv.bandwidth_bps = latency, bandwidth
                cond = {"latency_s": latency, "bandwidth_mb_s": bandwidth / 1e6, "readers": {}}
                print(f"  {latency * 1000:.0f} ms + {bandwidth / 1e6:.0f} MB/s, row groups of {rg_rows:,} rows, "
                      f"{rows:,} rows per reader, best of {repeat}", flush=True)
                cache = os.path.join(work, f"cache-{latency}")
                for reader in readers:
                    runs = []
                    for k in range(repeat):
                        if reader == "ours_warm" and k == 0:
                            _fill_cache(urls, rows, cache, prefetch)
                        cold = os.path.join(work, f"cold-{latency}-{k}")
                        srv.reset_stats()
                        cache_dir = {"ours_warm": cache, "ours_cold_cache": cold}.get(reader)
                        res = _run_reader(reader, urls, rows, cache_dir, prefetch)
                        st = srv.stats()
                        res["requests"], res["max_in_flight"] = st["requests"], st["max_in_flight"]
                        runs.append(res)
                    res = cond["readers"][reader] = _best(runs, rg_rows, latency)
                    line = (f"    {reader:15s} {res['rows_s']:10,.0f} rows/s  first sample {res['first_s']:6.2f} s  "
                            f"{res['requests']:5d} requests  peak RSS {res['peak_rss_mib']:5.0f} MiB")
                    depth = _depth(res)
                    if depth:
                        bound = depth * rg_rows / latency
                        res["depth"], res["bound_rows_s"], res["of_bound"] = depth, bound, res["rows_s"] / bound
                        pf = res.get("prefetch") or {}
                        line += (f"  depth {depth} -> bound {bound:,.0f} rows/s ({res['of_bound']:.2f}x of it; runs "
                                 + "/".join(f"{x:.2f}" for x in res["runs_of_bound"] if x is not None) + ")")
                        if pf.get("peak_bytes") is not None:
                            busy = max((pf.get("busy_s") or {0: None}).values(), key=lambda v: v or 0)
                            line += (f", {pf['peak_in_flight']} fetches at once, "
                                     f"peak {pf['peak_bytes'] / 2**20:.1f} MiB held; fetch "
                                     f"{(pf.get('fetch_s') or 0) * 1000:.0f} ms, consumer "
                                     f"{(busy or 0) * 1000:.1f} ms per row group; waited {pf.get('waited')} "
                                     f"times, {pf.get('wait_s', 0):.2f} s")
                    print(line, flush=True)
                r = cond["readers"]
                for peer in ("hf_plain", "hf_shuffled"):
                    if "ours" in r and peer in r:
                        cond[f"ours_over_{peer}"] = r["ours"]["rows_s"] / r[peer]["rows_s"]
                if "ours_over_hf_plain" in cond or "ours_over_hf_shuffled" in cond:
                    print("    ours / HF plain " + (f"{cond['ours_over_hf_plain']:.2f}x" if "ours_over_hf_plain" in cond
                                                   else "-") + ", ours / HF shuffled "
                          + (f"{cond['ours_over_hf_shuffled']:.2f}x" if "ours_over_hf_shuffled" in cond else "-"),
                          flush=True)
                out["conditions"].append(cond)
            srv.latency_s, srv.bandwidth_bps = conditions[0]
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
    p.add_argument("--rows", type=int, default=None, help="rows per reader (default: all, a whole epoch; quick "
                                                          "60000)")
    p.add_argument("--row-groups", default=None, help="row-group sizes, one data set each (default 5000,16384; "
                                                      "quick 4096)")
    p.add_argument("--prefetch", type=int, default=None, help="data.prefetch_blocks for ours (default: null, "
                                                              "adaptive)")
    p.add_argument("--repeat", type=int, default=1, help="runs per reader, the best kept (default 1)")
    p.add_argument("--conditions", default=None, help="latency_ms:MB_s pairs (default 100:100,30:20)")
    p.add_argument("--ranks", default="1,4,8", help="rank counts for the startup requests (default 1,4,8; "
                                                    "empty: none)")
    p.add_argument("--readers", default=",".join(READERS), help=f"readers to run (default {','.join(READERS)})")
    p.add_argument("--s3", action="store_true", help="also: time to first sample over moto's S3 (16384-row "
                                                     "row groups; needs moto and s3fs)")
    p.add_argument("--s3-only", action="store_true", help="only the S3 first sample")
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
    rows = args.rows or (60_000 if args.quick else total)     # a whole epoch: the pipeline's filling is not most of it
    sizes = [int(x) for x in (args.row_groups or ("4096" if args.quick else "5000,16384")).split(",")]
    conditions = CONDITIONS if not args.conditions else tuple(
        (float(a) / 1000, float(b) * 1e6) for a, b in (c.split(":") for c in args.conditions.split(",")))
    print(f"remote parquet benchmark: {total:,} rows in 16 files ({platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f})")
    result = {"rows_total": total, "rows_per_reader": rows, "prefetch_blocks": args.prefetch, "repeat": args.repeat,
              "load_average_before": os.getloadavg(), "row_groups": []}
    ranks = tuple(int(x) for x in args.ranks.split(",") if x.strip())
    if args.s3 or args.s3_only:
        s3_path = _common.dataset_dir(args.data_dir, total, 16, row_group_size=4096 if args.quick else 16384)
        result["s3_first_sample"] = s3_first_sample(s3_path, max(1, args.repeat),
                                                    tuple(r for r in args.readers.split(",")
                                                          if r in ("ours", "hf_plain")) or ("ours",))
    for i, size in enumerate([] if args.s3_only else sizes):
        path = _common.dataset_dir(args.data_dir, total, 16, row_group_size=size)
        result["row_groups"].append(bench(path, rows, args.prefetch, ranks if i == 0 else (),
                                          tuple(r for r in args.readers.split(",") if r in READERS), args.repeat,
                                          conditions))
    result["load_average_after"] = os.getloadavg()
    print(f"load average after: {result['load_average_after'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
