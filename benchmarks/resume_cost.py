#!/usr/bin/env python
"""What resuming costs: time to the first sample, and rows read from the source, early vs late saves.

On locally generated parquet data (1M rows, 16 files, row groups of 16384), ours shuffled
(buffer 16384):

* sidecars saved after 1k and after 600k consumed rows;
* wall time from constructing the stream with ``resume_state_path`` (opening the source, loading
  the sidecar) to yielding the first sample, each repeat in a fresh process; median of the
  repeats, ratio late / early (target <= 2x), with a fresh, non-resumed start for reference;
* rows the resumed stream pulls from the source before its first sample, counted by a proxy
  around ``stream.source``, against buffer_size + one row group (16384 + 16384);
* that the resumed stream continues with exactly the samples the uninterrupted one yields next.

    .venv/bin/python benchmarks/resume_cost.py [--quick] [--json out.json] [--repeats N] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

from resumable_stream.sources.base import Source  # no datasets import: after _common all the same

BUFFER = 16384
CHECK_NEXT = 5   # samples compared between the resumed and the uninterrupted stream


def make_config(path: str, resume: str | None = None):
    from resumable_stream import StreamConfig

    return StreamConfig(dataset_name_or_path="parquet", data_files=_common.parquet_glob(path), shuffle=True,
                        buffer_size=BUFFER, resume_state_path=resume)


# ---------------------------------------------------------------------------- counting proxy
class CountingSource(Source):
    """Forwards to a Source and counts what ``read`` is asked for and what it yields."""

    def __init__(self, inner):
        self.inner = inner
        self.shards = inner.shards
        self.fingerprint = inner.fingerprint
        self.column_names = inner.column_names
        self.calls: list[tuple[int, int]] = []   # (shard, start_row) of each read()
        self.tables = 0
        self.rows = 0

    def read(self, shard: int, start_row: int = 0):
        self.calls.append((shard, start_row))
        for table in self.inner.read(shard, start_row):
            self.tables += 1
            self.rows += table.num_rows
            yield table

    def reset(self) -> None:
        self.calls, self.tables, self.rows = [], 0, 0


# ---------------------------------------------------------------------------- child: one timed resume
def child(path: str, sidecar: str) -> dict:
    t_imp = time.perf_counter()
    import datasets  # noqa: F401  (open_source imports it lazily: process start-up, not resume cost)

    from resumable_stream import ResumableStream
    from resumable_stream.sources import open_source

    import_s = time.perf_counter() - t_imp
    _common.quiet_logs()
    resume = sidecar or None
    cfg = make_config(path, resume)
    t0 = time.perf_counter()
    source = open_source(cfg.source_spec)              # what ResumableStream(cfg) does when no source is given
    t1 = time.perf_counter()
    stream = ResumableStream(cfg, rank=0, world_size=1, source=source)   # loads the sidecar
    t2 = time.perf_counter()
    first = next(iter(stream))
    t3 = time.perf_counter()
    return {"open_source_s": t1 - t0, "construct_load_s": t2 - t1, "first_sample_s": t3 - t2,
            "total_s": t3 - t0, "first_id": first["id"], "import_s": import_s}


def run_child(path: str, sidecar: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", path, sidecar or ""]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k rows, saves after 1k / 60k, 3 repeats (< 60 s)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the dataset (default 1M)")
    ap.add_argument("--early", type=int, default=1000, help="rows consumed before the early save")
    ap.add_argument("--late", type=int, default=None, help="rows consumed before the late save (default 600k)")
    ap.add_argument("--repeats", type=int, default=None, help="timed resumes per sidecar (default 5)")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        print(json.dumps(child(*args._child)))
        return 0

    rows = args.rows or (100_000 if args.quick else 1_000_000)
    late = args.late or (60_000 if args.quick else 600_000)
    repeats = args.repeats or (3 if args.quick else 5)
    files = 16
    t_start = time.perf_counter()
    print(f"resumable-stream resume-cost benchmark  (python {platform.python_version()}, {os.cpu_count()} cpus"
          f"{', QUICK' if args.quick else ''})")
    print("data:")
    path = _common.dataset_dir(args.data_dir, rows, files)

    from resumable_stream import ResumableStream
    from resumable_stream.sources import open_source

    _common.quiet_logs()
    work = tempfile.mkdtemp(prefix="rs-bench-resume-")
    try:
        cfg = make_config(path)
        source = CountingSource(open_source(cfg.source_spec))
        budget = BUFFER + _common.ROW_GROUP_SIZE
        points = {"early": args.early, "late": late}
        sidecars, counts, checks = {}, {}, {}

        # save after N rows, remember what the uninterrupted stream yields next
        print(f"\nsaving sidecars (shuffle=True, buffer {BUFFER}, {rows:,} rows in {files} files):")
        for name, n in points.items():
            stream = ResumableStream(cfg, rank=0, world_size=1, source=source)
            it = iter(stream)
            for _ in itertools.islice(it, n):
                pass
            d = os.path.join(work, f"after-{n}")
            t0 = time.perf_counter()
            stream.save_sidecar(d)
            save_s = time.perf_counter() - t0
            expected = [s["id"] for s in itertools.islice(it, CHECK_NEXT)]
            sidecars[name] = d
            checks[name] = {"expected_next_ids": expected, "save_s": save_s,
                            "sidecar_bytes": sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))}
            print(f"  after {n:>9,} rows -> {d}  (save {save_s * 1000:.1f} ms, "
                  f"{checks[name]['sidecar_bytes']:,} bytes)")

        # rows pulled from the source before the first sample (in-process, deterministic)
        print(f"\nrows read from the source before the first sample (budget: buffer_size + one row group "
              f"= {BUFFER:,} + {_common.ROW_GROUP_SIZE:,} = {budget:,}):")
        for name in ("fresh", *points):
            source.reset()
            c = cfg if name == "fresh" else cfg.replace(resume_state_path=sidecars[name])
            stream = ResumableStream(c, rank=0, world_size=1, source=source)
            it = iter(stream)
            first = next(it)
            pulled, tables, calls = source.rows, source.tables, list(source.calls)
            prefix = sum(start for _, start in calls)
            got = [first["id"]] + [s["id"] for s in itertools.islice(it, CHECK_NEXT - 1)]
            ok = None if name == "fresh" else got == checks[name]["expected_next_ids"]
            counts[name] = {"rows_yielded_by_source": pulled, "tables": tables, "read_calls": calls,
                            "prefix_rows_reread_inside_read": prefix, "within_budget": pulled <= budget,
                            "continues_exactly": ok}
            label = "fresh start" if name == "fresh" else f"resume after {points[name]:,}"
            tail = "" if ok is None else f"; next {CHECK_NEXT} samples {'identical' if ok else 'DIFFER'}"
            print(f"  {label:<22} {pulled:>7,} rows in {tables} tables from {len(calls)} read() calls "
                  f"({'<=' if pulled <= budget else '>'} {budget:,}); + {prefix:,} rows re-read and skipped "
                  f"inside read() to reach the start rows{tail}")

        # wall time, each resume in a fresh process
        print(f"\ntime from construction to the first sample, {repeats} fresh processes each, median "
              "(open_source + construct/load sidecar + first sample; library imports timed apart):")
        timings: dict[str, list[dict]] = {"fresh": [], "early": [], "late": []}
        for _ in range(repeats):          # interleaved, so drift affects all alike
            for name in timings:
                timings[name].append(run_child(path, sidecars.get(name)))
        med = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("open_source_s", "construct_load_s", "first_sample_s", "total_s", "import_s")}
               for name, rs in timings.items()}
        for name, m in med.items():
            label = "fresh start (no resume)" if name == "fresh" else f"resume after {points[name]:,} rows"
            spread = [r["total_s"] for r in timings[name]]
            print(f"  {label:<26} total {m['total_s'] * 1000:7.1f} ms = open {m['open_source_s'] * 1000:6.1f} + "
                  f"construct/load {m['construct_load_s'] * 1000:6.1f} + first sample "
                  f"{m['first_sample_s'] * 1000:6.1f}  (min {min(spread) * 1000:.1f}, max {max(spread) * 1000:.1f}; "
                  f"imports {m['import_s'] * 1000:.0f})")
        for name in points:
            ids = {r["first_id"] for r in timings[name]}
            if ids != {checks[name]["expected_next_ids"][0]}:
                print(f"  WARNING: {name} resumes yielded first ids {sorted(ids)}, expected "
                      f"{checks[name]['expected_next_ids'][0]}")
        ratio_total = med["late"]["total_s"] / med["early"]["total_s"]
        ratio_first = med["late"]["first_sample_s"] / med["early"]["first_sample_s"]
        misses = []
        if ratio_total > 2:
            misses.append("time_ratio")
        if not all(counts[n]["within_budget"] for n in points):
            misses.append("rows_budget")
        if not all(counts[n]["continues_exactly"] for n in points):
            misses.append("exact_continuation")
        print(f"\nratio late/early: total {ratio_total:.2f}x (target <= 2: {'PASS' if ratio_total <= 2 else 'MISS'}), "
              f"first-sample phase only {ratio_first:.2f}x")
        elapsed = time.perf_counter() - t_start
        print(f"total {elapsed:.1f} s; targets {'all met' if not misses else 'missed: ' + ', '.join(misses)}")
        if args.json_path:
            out = {"benchmark": "resume_cost", "quick": args.quick, "python": platform.python_version(),
                   "cpus": os.cpu_count(), "dataset": {"rows": rows, "files": files,
                                                       "row_group_size": _common.ROW_GROUP_SIZE, "path": path},
                   "buffer_size": BUFFER, "save_points": points, "saves": checks, "rows_read": counts,
                   "rows_budget": budget, "timings": timings, "median": med,
                   "ratio_late_early_total": ratio_total, "ratio_late_early_first_sample": ratio_first,
                   "target_ratio_max": 2.0, "misses": misses, "elapsed_s": elapsed}
            with open(args.json_path, "w") as f:
                json.dump(out, f, indent=2)
            print(f"results written to {args.json_path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if (args.strict and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
