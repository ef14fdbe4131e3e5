#!/usr/bin/env python
"""Throughput and memory of ResumableStream against HF ``datasets`` streaming and raw pyarrow.

On the same locally generated parquet data (1M rows, 16 files, row groups of 16384), in one run:

* rows/s over the full dataset of: ours shuffled, ours unshuffled, HF streaming plain,
  HF streaming ``.shuffle(seed=42, buffer_size=16384)``, raw pyarrow ``iter_batches`` + ``to_pylist``;
  every reader yields Python dicts and the loop touches ``row["id"]`` (summed to check the rows);
* the ratios ours_shuffled / hf_shuffled (target >= 4) and ours_shuffled / hf_plain (target >= 1);
* peak RSS of ours (shuffled) reading 1M rows of a 1M-row dataset vs 4M rows of a 4M-row dataset
  (64 files), growth in % (target < 25 %).

Every measurement runs in a fresh subprocess (same interpreter), so one reader's heap does not
affect the next and each gets its own peak RSS. Data is generated once under ``.bench/``.

    .venv/bin/python benchmarks/throughput.py [--quick] [--json out.json] [--data-dir DIR] [--profile]
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
KINDS = ("ours_shuffled", "ours_plain", "hf_plain", "hf_shuffled", "pyarrow")
LABELS = {
    "ours_shuffled": "ours, shuffle=True (buffer 16384)",
    "ours_plain": "ours, shuffle=False",
    "hf_plain": "HF streaming, plain",
    "hf_shuffled": "HF streaming, .shuffle(buffer 16384)",
    "pyarrow": "raw pyarrow iter_batches+to_pylist",
}


# ---------------------------------------------------------------------------- child side
def _open(kind: str, path: str):
    """Build the reader (timed as setup) and return an iterator of dicts."""
    if kind.startswith("ours"):
        from resumable_stream import ResumableStream, StreamConfig

        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path),
                           shuffle=(kind == "ours_shuffled"), buffer_size=BUFFER)
        return iter(ResumableStream(cfg, rank=0, world_size=1))
    if kind.startswith("hf"):
        import datasets

        _common.quiet_logs()
        ds = datasets.load_dataset("parquet", data_files=_common.parquet_glob(path), split="train",
                                   streaming=True)
        if kind == "hf_shuffled":
            ds = ds.shuffle(seed=42, buffer_size=BUFFER)
        return iter(ds)
    if kind == "pyarrow":
        import pyarrow.parquet as pq

        files = _common.parquet_files(path)

        def rows():
            for f in files:
                for batch in pq.ParquetFile(f).iter_batches():
                    yield from batch.to_pylist()

        return rows()
    raise ValueError(kind)


def _import(kind: str) -> None:
    """Import what the reader needs first, so the baseline RSS covers the libraries."""
    if kind.startswith("ours"):
        import datasets  # noqa: F401  (open_source imports it lazily)

        import resumable_stream.stream.single  # noqa: F401  (torch, pyarrow)
    elif kind.startswith("hf"):
        import datasets  # noqa: F401
    import pyarrow.parquet  # noqa: F401


def _checks_off() -> None:
    """The byte checks of the read path off (the decoded row group is not compared with its footer, the answer
    not with the index's identity): to measure what they cost. The generated files store no page CRCs."""
    from resumable_stream.sources import parquet_checks as row_group_check
    from resumable_stream.sources import parquet_rows as parquet_files

    row_group_check.problem = lambda *a, **k: None
    read_range = parquet_files.read_range
    parquet_files.read_range = lambda path, start, end, options, identity=None: read_range(path, start, end, options)


def child(kind: str, path: str, rows: int) -> dict:
    if kind.endswith("_unchecked"):
        _checks_off()
        kind_open = kind[: -len("_unchecked")]
    else:
        kind_open = kind
    _import(kind)
    base_rss = _common.current_rss_mib()
    t0 = time.perf_counter()
    it = _open(kind_open, path)
    t1 = time.perf_counter()
    n = total = 0
    for row in itertools.islice(it, rows):
        total += row["id"]
        n += 1
    t2 = time.perf_counter()
    return {"kind": kind, "rows": n, "id_sum": total, "setup_s": t1 - t0, "iter_s": t2 - t1,
            "rows_per_s": n / (t2 - t1), "rss_after_imports_mib": base_rss, "peak_rss_mib": _common.peak_rss_mib()}


def run_child(kind: str, path: str, rows: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, path, str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child {kind} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- profile
def profile(path: str, rows: int, shuffle: bool) -> None:
    import cProfile
    import pstats

    from resumable_stream import ResumableStream, StreamConfig

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=shuffle,
                       buffer_size=BUFFER)
    it = iter(ResumableStream(cfg, rank=0, world_size=1))
    prof = cProfile.Profile()
    prof.enable()
    for row in itertools.islice(it, rows):
        row["id"]
    prof.disable()
    print(f"\n== cProfile: ours shuffle={shuffle}, {rows:,} rows (top 18 by own time) ==")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def check_cost(path: str, rows: int, expect_sum: int) -> int:
    """ours (plain and shuffled) with and without the byte checks, alternating, best of 3 rounds each."""
    best: dict[str, float] = {}
    for _ in range(3):
        for kind in ("ours_plain", "ours_plain_unchecked", "ours_shuffled", "ours_shuffled_unchecked"):
            r = run_child(kind, path, rows)
            assert r["rows"] == rows and r["id_sum"] == expect_sum, r
            best[kind] = max(best.get(kind, 0.0), r["rows_per_s"])
    print("\ncost of the byte checks (identity of every read, rows / nulls / min / max of every row group), "
          "best of 3:")
    worst = 0.0
    for kind in ("ours_plain", "ours_shuffled"):
        on, off = best[kind], best[kind + "_unchecked"]
        slower = (1 - on / off) * 100
        worst = max(worst, slower)
        print(f"  {LABELS[kind]:<38} checked {on:>11,.0f} rows/s, unchecked {off:>11,.0f} rows/s: "
              f"{slower:+.1f}% slower")
    print(f"  target: at most 5% slower: {'PASS' if worst <= 5 else 'MISS'}")
    return 0


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k / 400k rows instead of 1M / 4M (< 60 s)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the throughput dataset (default 1M)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    ap.add_argument("--skip-rss", action="store_true", help="skip the 1M vs 4M peak-RSS comparison")
    ap.add_argument("--profile", action="store_true", help="also cProfile ours (shuffled and plain)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--checks", action="store_true", help="only the cost of the byte checks: ours with and without "
                                                          "them, best of 3 rounds (target: at most 5%% slower)")
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        kind, path, rows = args._child
        print(json.dumps(child(kind, path, int(rows))))
        return 0

    rows = args.rows or (100_000 if args.quick else 1_000_000)
    files = 16
    big_rows, big_files = rows * 4, files * 4
    t_start = time.perf_counter()
    print(f"resumable-stream throughput benchmark  (python {platform.python_version()}, "
          f"{os.cpu_count()} cpus{', QUICK' if args.quick else ''})")
    print("data:")
    path = _common.dataset_dir(args.data_dir, rows, files)
    big_path = None if args.skip_rss else _common.dataset_dir(args.data_dir, big_rows, big_files)

    expect_sum = rows * (rows - 1) // 2
    if args.checks:
        return check_cost(path, rows, expect_sum)
    results: dict[str, dict] = {}
    print(f"\nthroughput over {rows:,} rows ({files} files, row groups of {_common.ROW_GROUP_SIZE}), "
          "each in a fresh process:")
    for kind in ("pyarrow", *[k for k in KINDS if k != "pyarrow"]):   # pyarrow first warms the page cache
        r = run_child(kind, path, rows)
        r["rows_ok"] = r["rows"] == rows and r["id_sum"] == expect_sum
        results[kind] = r
        print(f"  {LABELS[kind]:<38} {r['rows_per_s']:>11,.0f} rows/s  ({r['iter_s']:.2f} s, setup "
              f"{r['setup_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB{'' if r['rows_ok'] else ', ROWS WRONG'})",
              flush=True)

    def ratio(a: str, b: str) -> float:
        return results[a]["rows_per_s"] / results[b]["rows_per_s"]

    ratios = {
        "ours_shuffled/hf_shuffled": (ratio("ours_shuffled", "hf_shuffled"), 4.0),
        "ours_shuffled/hf_plain": (ratio("ours_shuffled", "hf_plain"), 1.0),
        "ours_plain/hf_plain": (ratio("ours_plain", "hf_plain"), None),
        "ours_shuffled/pyarrow": (ratio("ours_shuffled", "pyarrow"), None),
    }
    print("\n  kind                                         rows/s   vs hf_plain")
    for kind in KINDS:
        print(f"  {LABELS[kind]:<38} {results[kind]['rows_per_s']:>12,.0f}   {ratio(kind, 'hf_plain'):>7.2f}x")
    print("\nratios:")
    misses = []
    for name, (value, target) in ratios.items():
        verdict = "" if target is None else f"  (target >= {target:g}: {'PASS' if value >= target else 'MISS'})"
        if target is not None and value < target:
            misses.append(name)
        print(f"  {name:<28} {value:6.2f}x{verdict}")

    rss = None
    if big_path:
        print("\npeak RSS, ours shuffled, full pass, each in a fresh process:")
        small = run_child("ours_shuffled", path, rows)
        big = run_child("ours_shuffled", big_path, big_rows)
        growth = (big["peak_rss_mib"] / small["peak_rss_mib"] - 1) * 100
        above_small = small["peak_rss_mib"] - small["rss_after_imports_mib"]
        above_big = big["peak_rss_mib"] - big["rss_after_imports_mib"]
        for label, r in ((f"{rows:,} rows of {rows:,} ({files} files)", small),
                         (f"{big_rows:,} rows of {big_rows:,} ({big_files} files)", big)):
            print(f"  {label:<36} peak {r['peak_rss_mib']:7.1f} MiB  (after imports {r['rss_after_imports_mib']:6.1f} MiB, "
                  f"{r['rows_per_s']:,.0f} rows/s)")
        verdict = "PASS" if growth < 25 else "MISS"
        if growth >= 25:
            misses.append("rss_growth")
        print(f"  growth {growth:+.1f} %  (target < 25 %: {verdict}); above-imports growth "
              f"{above_small:.1f} -> {above_big:.1f} MiB")
        rss = {"small": small, "big": big, "growth_pct": growth, "target_pct": 25.0,
               "small_dataset": {"rows": rows, "files": files}, "big_dataset": {"rows": big_rows, "files": big_files}}

    if args.profile:
        prof_rows = min(rows, 300_000)
        profile(path, prof_rows, True)
        profile(path, prof_rows, False)

    elapsed = time.perf_counter() - t_start
    print(f"\ntotal {elapsed:.1f} s; targets {'all met' if not misses else 'missed: ' + ', '.join(misses)}")
    if args.json_path:
        out = {
            "benchmark": "throughput", "quick": args.quick, "python": platform.python_version(),
            "cpus": os.cpu_count(), "dataset": {"rows": rows, "files": files, "row_group_size": _common.ROW_GROUP_SIZE,
                                                "path": path},
            "buffer_size": BUFFER, "results": results,
            "ratios": {k: {"value": v, "target_min": t} for k, (v, t) in ratios.items()},
            "rss": rss, "misses": misses, "elapsed_s": elapsed,
        }
        try:
            import datasets
            import pyarrow

            out["versions"] = {"datasets": datasets.__version__, "pyarrow": pyarrow.__version__}
        except Exception:
            pass
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results written to {args.json_path}")
    return 1 if (args.strict and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
