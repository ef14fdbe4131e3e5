#!/usr/bin/env python
"""The local block cache: cold vs warm epochs over a slow HTTP host, warmup, and its cost on local files.

Over the loopback test server (``tests/http_server.FileServer``) throttled to ~20 MB/s per response
and 30 ms per request (a remote object store seen from a training node), on generated parquet
(row groups of 16384 rows, shuffled stream, buffer 16384):

* epoch 0 with the cache off, epoch 0 with a cold cache (it fills), epoch 1 with the warm cache
  (another shard order, every block a hit): rows/s and the ratio warm / cold (target >= 5);
* ``warmup`` of the next N samples (8 parallel fetches) and then reading them, vs reading the same
  N samples from a cold cache;
* on plain local parquet files: cache off vs cold vs warm (best of 5), overhead in % (target <= 10).

    .venv/bin/python benchmarks/cache.py [--quick] [--json out.json] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))

BUFFER = 16384
ROW_GROUP = 16384
WORDS = 48            # ~330 bytes of text per row


def _data(data_dir: str, rows: int, files: int) -> str:
    """Generated parquet with wider rows than the other benchmarks (a cache moves bytes, not rows)."""
    name = f"cache-{rows}r-{files}f-{ROW_GROUP}rg-{WORDS}w"
    path = os.path.join(data_dir, name)
    if os.path.exists(os.path.join(path, "COMPLETE")):
        return path
    from resumable_stream.testing import write_parquet_dataset

    print(f"  generating {rows:,} rows in {files} files -> {path}", flush=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=data_dir)
    write_parquet_dataset(tmp, rows=rows, files=files, row_group_size=ROW_GROUP, words=WORDS)
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _read(stream, n: int | None = None) -> tuple[int, float]:
    """Rows read and seconds; touches one field of every sample."""
    t0 = time.perf_counter()
    it = iter(stream) if n is None else itertools.islice(stream, n)
    count = 0
    for row in it:
        count += row["id"] >= 0
    return count, time.perf_counter() - t0


def _epoch(cfg, source, epoch: int) -> tuple[int, float, dict]:
    from resumable_stream import ResumableStream

    stream = ResumableStream(cfg, rank=0, world_size=1, source=source)
    stream.set_epoch(epoch)
    rows, secs = _read(stream)
    stats = stream.source.stats() if hasattr(stream.source, "stats") else {}
    return rows, secs, stats


def bench_http(path: str, bandwidth: float, latency: float, jobs: int, warm_samples: int) -> dict:
    from http_server import FileServer

    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.app.warmup import run_warmup
    from resumable_stream.cache import CachedSource
    from resumable_stream.sources import open_source

    files = _common.parquet_files(path)
    size = sum(os.path.getsize(f) for f in files)
    out: dict = {"bytes": size}
    work = tempfile.mkdtemp(prefix="rs-bench-cache-")
    try:
        with FileServer(path) as srv:
            srv.bandwidth_bps, srv.latency_s = bandwidth, latency
            cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url(f) for f in files],
                               shuffle=True, buffer_size=BUFFER)
            t0 = time.perf_counter()
            src = open_source(cfg.source_spec)
            out["open_s"] = time.perf_counter() - t0
            total = sum(s.num_rows for s in src.shards)

            def cached(name):
                return CachedSource(src, cfg.replace(cache_dir=os.path.join(work, name)).cache_spec)

            srv.reset_stats()
            rows, secs, _ = _epoch(cfg, src, 0)
            out["off"] = {"rows": rows, "s": secs, "rows_s": rows / secs, "requests": srv.stats()["requests"]}
            print(f"  cache off, epoch 0:  {rows / secs:12,.0f} rows/s ({secs:.2f} s, {out['off']['requests']} "
                  "requests)", flush=True)
            c = cached("epochs")
            srv.reset_stats()
            rows, secs, st = _epoch(cfg, c, 0)
            out["cold"] = {"rows": rows, "s": secs, "rows_s": rows / secs, "requests": srv.stats()["requests"],
                           "cache_bytes": st.get("cache_bytes")}
            print(f"  cold cache, epoch 0: {rows / secs:12,.0f} rows/s ({secs:.2f} s, {out['cold']['requests']} "
                  f"requests, cache {st.get('cache_bytes', 0) / 1e6:.0f} MB)", flush=True)
            srv.reset_stats()
            rows, secs, st = _epoch(cfg, cached("epochs"), 1)
            out["warm"] = {"rows": rows, "s": secs, "rows_s": rows / secs, "requests": srv.stats()["requests"],
                           "hit_rate": st.get("hit_rate")}
            print(f"  warm cache, epoch 1: {rows / secs:12,.0f} rows/s ({secs:.2f} s, {out['warm']['requests']} "
                  f"requests, hit rate {st.get('hit_rate')})", flush=True)
            out["warm_over_cold"] = out["warm"]["rows_s"] / out["cold"]["rows_s"]

            n = min(warm_samples, total)
            srv.reset_stats()
            _, cold_s = _read(ResumableStream(cfg, source=cached("cold-n")), n)
            t0 = time.perf_counter()
            res = run_warmup(cfg.replace(cache_dir=os.path.join(work, "warm-n")), n, source=src, jobs=jobs,
                             progress=False)
            warm_s = time.perf_counter() - t0
            srv.reset_stats()
            _, read_s = _read(ResumableStream(cfg, source=cached("warm-n")), n)
            requests_after = srv.stats()["requests"]
            out["warmup"] = {"samples": n, "cold_read_s": cold_s, "warmup_s": warm_s, "read_after_warmup_s": read_s,
                             "blocks": res.fetched_blocks, "bytes": res.fetched_bytes, "jobs": jobs,
                             "requests_while_reading": requests_after,
                             "cold_over_warmup_plus_read": cold_s / (warm_s + read_s),
                             "cold_over_read_after_warmup": cold_s / read_s}
            print(f"  {n:,} samples: cold read {cold_s:.2f} s | warmup ({jobs} jobs) {warm_s:.2f} s "
                  f"({res.fetched_blocks} blocks, {res.fetched_bytes / 1e6:.0f} MB) + read {read_s:.2f} s "
                  f"({requests_after} requests)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def bench_local(path: str, repeats: int) -> dict:
    from resumable_stream import StreamConfig
    from resumable_stream.cache import CachedSource
    from resumable_stream.sources import open_source

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=True,
                       buffer_size=BUFFER)
    src = open_source(cfg.source_spec)
    work = tempfile.mkdtemp(prefix="rs-bench-cache-local-")
    best = {"off": 0.0, "cold": 0.0, "warm": 0.0}
    try:
        for r in range(repeats):
            rows, secs, _ = _epoch(cfg, src, 0)
            best["off"] = max(best["off"], rows / secs)
            d = os.path.join(work, f"c{r}")
            rows, secs, _ = _epoch(cfg, CachedSource(src, cfg.replace(cache_dir=d).cache_spec), 0)
            best["cold"] = max(best["cold"], rows / secs)
            rows, secs, _ = _epoch(cfg, CachedSource(src, cfg.replace(cache_dir=d).cache_spec), 1)
            best["warm"] = max(best["warm"], rows / secs)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"rows_s": best,
           "cold_overhead_pct": 100 * (1 - best["cold"] / best["off"]),
           "warm_overhead_pct": 100 * (1 - best["warm"] / best["off"])}
    print(f"  local files: off {best['off']:,.0f} rows/s | cold cache {best['cold']:,.0f} "
          f"({out['cold_overhead_pct']:+.1f}% overhead) | warm cache {best['warm']:,.0f} "
          f"({out['warm_overhead_pct']:+.1f}%)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small data, one local repeat (a smoke run)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--bandwidth-mbs", type=float, default=20.0, help="MB/s per response (default 20)")
    ap.add_argument("--latency-ms", type=float, default=30.0, help="per request (default 30)")
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args()
    _common.quiet_logs()
    rows, files = (131_072, 4) if args.quick else (524_288, 8)
    local_rows, local_files = (262_144, 4) if args.quick else (1_000_000, 16)
    remote = _data(args.data_dir, rows, files)
    local = _common.dataset_dir(args.data_dir, local_rows, local_files)
    print(f"block cache benchmark: {rows:,} rows over HTTP at {args.bandwidth_mbs:g} MB/s + {args.latency_ms:g} ms "
          f"per request; {local_rows:,} local rows; {platform.python_version()}, {os.cpu_count()} cores", flush=True)
    http = bench_http(remote, args.bandwidth_mbs * 1e6, args.latency_ms / 1e3, args.jobs, warm_samples=rows // 2)
    loc = bench_local(local, 1 if args.quick else 5)
    w = http["warmup"]
    print("ratios:")
    print(f"  warm epoch / cold epoch:                {http['warm_over_cold']:6.1f}x   (target >= 5)")
    print(f"  cold read / (warmup + read):            {w['cold_over_warmup_plus_read']:6.1f}x")
    print(f"  cold read / read after warmup:          {w['cold_over_read_after_warmup']:6.1f}x   "
          f"({w['requests_while_reading']} requests while reading)")
    print(f"  local files, cache overhead cold / warm: {loc['cold_overhead_pct']:+5.1f}% / "
          f"{loc['warm_overhead_pct']:+5.1f}%   (target <= 10%)")
    result = {"http": http, "local": loc, "quick": args.quick, "python": platform.python_version(),
              "cores": os.cpu_count()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
