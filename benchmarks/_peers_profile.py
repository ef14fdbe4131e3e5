"""Where ours spends its time to first sample, its resume and its memory (``benchmarks/peers.py --profile``).

Every figure comes from a fresh process with the libraries imported before the clock (as in peers.py), on
the same 1M-row dataset, shuffled, buffer 16384:

* **timed phases**: named functions of the open / resume path wrapped with a timer (inclusive wall time on the
  main thread, calls), at no profiler overhead: ``datasets.load_dataset_builder`` (builder discovery and data
  file resolution), ``build_index`` / ``ParquetReader.index_file`` (one stat + footer read per file), the source
  from the index, the layout and readers, the first window (``PartitionReader._build``) and inside it the row
  group reads (``ParquetFiles.row_group``, ``_decoded``, ``table_cast``), the permutation, ``concat_tables``;
  on resume ``checkpoint.read`` (manifest, rank file), the saved index and its check (``growth.recheck``:
  ``file_identity`` + ``parquet_footer`` + ``footer_digest`` per file), ``load_state_dict`` and the digest of
  the first sample.
* **cProfile**: the same paths under cProfile, the functions with the most cumulative and own time (C
  functions such as ``to_pylist`` and ``take`` show up here).
* **memory**: RSS and Arrow's allocated bytes sampled every 2 ms over one epoch (their peaks above the RSS
  after imports), at the first sample, and the size of one window's pieces: its Arrow table, its rows as
  Python objects (``to_pylist`` + tuples), the prefetched row groups, the open shards' row groups, Arrow's
  pool. Then peak RSS above imports, rows/s and first sample for ``prefetch_blocks`` 0 / 2 / 8 (default),
  ``buffer_size`` 1024 / 16384 (default), and the default with ``MALLOC_ARENA_MAX=1`` (one glibc arena
  for every thread) or ``ARROW_DEFAULT_MEMORY_POOL=system`` (malloc instead of Arrow's pool), best of 2.
"""

from __future__ import annotations

import cProfile
import functools
import io
import json
import os
import pstats
import subprocess
import sys
import threading
import time

import _common
import _peers_mem

BUFFER = 16384


# ----------------------------------------------------------------------------------- child side
def _cfg(p: dict, **over):
    from resumable_stream import StreamConfig

    if p.get("s3"):       # the moto server of run_s3
        over = {"storage_options": {"endpoint_url": p["s3"]}, **over}
        files = "s3://bench/parquet/*.parquet"
    else:
        files = os.path.join(p["parquet"], "*.parquet")
    return StreamConfig(dataset_name_or_path="parquet", data_files=files, shuffle=True, buffer_size=BUFFER,
                        shuffle_seed=42, **over)


def _imports() -> None:
    import datasets  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import s3fs  # noqa: F401

    import resumable_stream.stream.single  # noqa: F401
    from resumable_stream.state import sidecar  # noqa: F401
    _common.quiet_logs()


class Timers:
    """Inclusive wall time and calls of wrapped functions: on the main thread, and summed over the others
    (prefetch and index threads, which overlap each other and the main thread)."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.lock = threading.Lock()
        self.main = threading.get_ident()

    def wrap(self, owner, attr: str, name: str | None = None) -> None:
        fn = getattr(owner, attr)
        name = name or f"{getattr(owner, '__name__', owner)}.{attr}"
        timers = self

        @functools.wraps(fn)
        def timed(*a, **k):
            key = name if threading.get_ident() == timers.main else name + " [other threads, summed]"
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with timers.lock:
                    timers.t[key] = timers.t.get(key, 0.0) + time.perf_counter() - t0
                    timers.n[key] = timers.n.get(key, 0) + 1

        setattr(owner, attr, timed)

    def report(self) -> dict:
        return {k: {"ms": self.t[k] * 1e3, "calls": self.n[k]} for k in sorted(self.t, key=lambda k: -self.t[k])}


def _install(timers: Timers) -> None:
    import datasets
    import datasets.table
    import pyarrow as pa
    import pyarrow.parquet as pq

    from resumable_stream import plan
    from resumable_stream.dataset import growth, job_source
    from resumable_stream.sources import index, resolve
    from resumable_stream.sources import open as sources_open
    from resumable_stream.sources import parquet as sources_parquet
    from resumable_stream.sources import parquet_checks as row_group_check
    from resumable_stream.sources import parquet_rows as parquet_files
    from resumable_stream.state import checkpoint, sidecar
    from resumable_stream.stream import base as stream_base
    from resumable_stream.stream import partition
    from resumable_stream.stream import single as stream

    w = timers.wrap
    w(stream, "open_job_source", "open_job_source (the whole source)")
    w(datasets, "load_dataset_builder", "datasets.load_dataset_builder")
    w(resolve, "resolve_files", "sources.resolve.resolve_files (builder + data files)")
    w(sources_open, "build_index", "sources.resolve.build_index")
    w(sources_parquet.ParquetReader, "index_file", "ParquetReader.index_file (stat + footer, per file)")
    w(resolve, "file_identity", "sources.resolve.file_identity")
    w(sources_parquet, "parquet_footer", "sources.parquet.parquet_footer")
    w(growth, "recheck", "growth.recheck (saved index checked)")
    w(resolve, "known_identities", "sources.resolve.known_identities")
    w(job_source, "saved_index_file", "job_source.saved_index_file")
    w(sources_parquet, "source_from_index", "sources.parquet.source_from_index")
    w(parquet_files.ParquetFiles, "__init__", "ParquetFiles.__init__ (Features.from_dict)")
    w(parquet_files.ParquetFiles, "_read_footer", "ParquetFiles._read_footer (footer again, per file)")
    w(parquet_files.ParquetFiles, "row_group", "ParquetFiles.row_group (read+decode+cast)")
    w(parquet_files.ParquetFiles, "_decoded", "ParquetFiles._decoded (read + decode + check)")
    w(parquet_files, "read_range", "parquet_files.read_range (bytes)")
    w(datasets.table, "table_cast", "datasets.table.table_cast")
    w(pq.ParquetFile, "read_row_group", "pyarrow ParquetFile.read_row_group (decode)")
    w(row_group_check, "problem", "row_group_check.problem (decoded rows vs footer)")
    w(index, "parse_footer", "index.parse_footer")
    w(stream, "with_block_cache", "with_block_cache")
    w(stream_base.StreamBase, "_start", "StreamBase._start (partitions, readers)")
    w(stream.ResumableStream, "_build_readers", "ResumableStream._build_readers (Layout)")
    w(partition.PartitionReader, "_build", "PartitionReader._build (a window)")
    w(partition._OpenShard, "__init__", "_OpenShard.__init__ (source.read)")
    w(partition._OpenShard, "_fill", "_OpenShard._fill (next row group)")
    w(partition, "window_permutation", "plan.window_permutation")
    w(partition, "_chain", "partition._chain (digest of window keys)")
    w(pa, "concat_tables", "pyarrow.concat_tables")
    w(checkpoint, "read", "checkpoint.read (manifest + rank file)")
    w(checkpoint, "read_manifest", "sidecar.read_manifest")
    w(checkpoint, "read_rank_state", "sidecar.read_rank_state")
    w(checkpoint, "read_state_fingerprint", "sidecar.read_state_fingerprint (fingerprint.json)")
    w(stream_base.StreamBase, "load_state_dict", "StreamBase.load_state_dict")
    w(stream_base.StreamBase, "check_saved_identity", "StreamBase.check_saved_identity (fingerprint)")
    w(stream.ResumableStream, "_verify_first", "ResumableStream._verify_first (first sample's digest)")
    w(stream.ResumableStream, "partition_state", "ResumableStream.partition_state")
    del plan, sidecar


def _first_sample(p: dict, resume: str | None):
    from resumable_stream import ResumableStream

    marks = {}
    t0 = time.perf_counter()
    s = ResumableStream(_cfg(p), index_from=resume)
    marks["open_ms"] = (time.perf_counter() - t0) * 1e3
    if resume:
        t1 = time.perf_counter()
        s.load_sidecar(resume)
        marks["load_sidecar_ms"] = (time.perf_counter() - t1) * 1e3
    t2 = time.perf_counter()
    next(iter(s))
    marks["first_sample_ms"] = (time.perf_counter() - t2) * 1e3
    marks["total_ms"] = (time.perf_counter() - t0) * 1e3
    return s, marks


def child_timed(p: dict) -> dict:
    _imports()
    timers = Timers()
    _install(timers)
    _, marks = _first_sample(p, p.get("resume"))
    return {"marks": marks, "timers": timers.report()}


def child_cprofile(p: dict) -> dict:
    _imports()
    prof = cProfile.Profile()
    prof.enable()
    _, marks = _first_sample(p, p.get("resume"))
    prof.disable()
    out = {"marks": marks}
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(p.get("top", 30))
        out[key] = buf.getvalue()
    return out


def _deep_size(rows: list) -> int:
    """Bytes of a window's rows as Python objects: the list, each tuple, each value (shared objects once)."""
    seen, total = set(), sys.getsizeof(rows)
    for row in rows:
        total += sys.getsizeof(row)
        for v in row:
            if id(v) not in seen:
                seen.add(id(v))
                total += sys.getsizeof(v)
    return total


def child_memory(p: dict) -> dict:
    import pyarrow as pa

    from resumable_stream import ResumableStream

    _imports()
    base, base_arrow = _peers_mem.baseline_mib(), pa.total_allocated_bytes() / 2**20
    peak = {"rss": base, "arrow": base_arrow}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _common.current_rss_mib())
            peak["arrow"] = max(peak["arrow"], pa.total_allocated_bytes() / 2**20)
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    s = ResumableStream(_cfg(p))
    opened = {"rss": _common.current_rss_mib() - base, "arrow": pa.total_allocated_bytes() / 2**20 - base_arrow}
    it = iter(s)
    next(it)
    pool = pa.default_memory_pool()
    first = {"rss": _common.current_rss_mib() - base, "arrow": pa.total_allocated_bytes() / 2**20 - base_arrow,
             "peak_rss": _peers_mem.peak_rss_mib() - base, "arrow_pool": pool.backend_name,
             "arrow_pool_max_mib": pool.max_memory() / 2**20, "threads": threading.active_count()}
    reader = s._readers[s.partitions[0]]
    win = reader._window
    window = {"rows": len(win.rows), "python_rows_mib": _deep_size(win.rows) / 2**20,
              "key_arrays_mib": (win.shard_ids.nbytes + win.row_ids.nbytes) / 2**20}
    pre = getattr(s.source, "_prefetch", None)
    done = [f.result() for _, f in (pre._pending.values() if pre is not None else ())
            if f.done() and not f.cancelled() and f.exception() is None]
    window["prefetched_row_groups"] = len(done)
    window["prefetched_mib"] = sum(t.get_total_buffer_size() for t in done) / 2**20
    bufs = [sh._buf for sh in reader._open.values() if sh._buf is not None]
    window["open_shards"] = len(reader._open)
    window["open_shard_buffers_mib"] = sum(b.get_total_buffer_size() for b in bufs) / 2**20
    n, timeline, step = 1, [], max(1, p["rows"] // 10)
    for _ in it:
        n += 1
        if n % step == 0:
            timeline.append((n, round(_common.current_rss_mib() - base, 1),
                             round(pa.total_allocated_bytes() / 2**20 - base_arrow, 1)))
        if n >= p["rows"]:
            break
    stop.set()
    th.join()
    return {"rows": n, "base_rss_mib": base, "arrow_pool_max_mib": pool.max_memory() / 2**20,
            "timeline_rows_rss_arrow_mib": timeline, "after_open": opened, "at_first_sample": first, "window": window,
            "peak_rss_above_imports_mib": _peers_mem.peak_rss_mib() - base,
            "peak_rss_sampled_above_imports_mib": peak["rss"] - base,
            "peak_arrow_allocated_mib": peak["arrow"] - base_arrow}


def child_save(p: dict) -> dict:
    import itertools

    from resumable_stream import ResumableStream

    _imports()
    s = ResumableStream(_cfg(p))
    for _ in itertools.islice(iter(s), p["resume_at"]):
        pass
    s.save_sidecar(p["state"])
    return {"saved": p["state"]}


CHILDREN = {"timed": child_timed, "cprofile": child_cprofile, "memory": child_memory, "save": child_save}


# ----------------------------------------------------------------------------------- parent side
def _run(kind: str, p: dict, env: dict | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, json.dumps(p)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-3000:])
        return {"error": f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def _best_timed(p: dict, repeats: int, env: dict | None = None) -> dict:
    runs = [_run("timed", p, env) for _ in range(repeats)]
    runs = [r for r in runs if "error" not in r]
    best = min(runs, key=lambda r: r["marks"]["total_ms"])
    best["totals_ms"] = sorted(r["marks"]["total_ms"] for r in runs)
    return best


def _print_timed(title: str, res: dict, limit: int = 24) -> None:
    m = res["marks"]
    print(f"  {title}: " + ", ".join(f"{k} {v:,.1f}" for k, v in m.items()) + "  (totals of the runs: "
          + ", ".join(f"{t:,.0f}" for t in res["totals_ms"]) + " ms)")
    for name, v in list(res["timers"].items())[:limit]:
        print(f"      {v['ms']:9.1f} ms  {v['calls']:6d}x  {name}")


def run(main_p: dict, work: str, peers_script: str, repeats: int = 3) -> dict:
    p = {"parquet": main_p["parquet"], "rows": main_p["rows"], "resume_at": 400_000 if main_p["rows"] >= 10**6
         else 38_400, "state": os.path.join(work, "profile-state")}
    out: dict = {}
    out["start_timed"] = _best_timed(p, repeats)
    _print_timed("time to first sample (ms)", out["start_timed"])
    saved = _run("save", p)
    if "error" not in saved:
        out["resume_timed"] = _best_timed({**p, "resume": p["state"]}, repeats)
        _print_timed(f"resume after {p['resume_at']:,} (ms)", out["resume_timed"])
    out["start_cprofile"] = _run("cprofile", {**p, "top": 30})
    if "error" not in saved:
        out["resume_cprofile"] = _run("cprofile", {**p, "resume": p["state"], "top": 30})
    for key in ("start_cprofile", "resume_cprofile"):
        if key in out and "cumulative" in out[key]:
            print(f"\n  cProfile, {key} (marks {out[key]['marks']}), by cumulative time:")
            print("\n".join("    " + ln for ln in out[key]["cumulative"].splitlines()[:48] if ln.strip()))
    mems = [_run("memory", p) for _ in range(2)]
    mems = [m for m in mems if "error" not in m]
    if mems:
        mem = min(mems, key=lambda m: m["peak_rss_above_imports_mib"])
        out["memory"] = mem
        print(f"\n  memory (MiB above the RSS after imports, {mem['base_rss_mib']:.0f} MiB): after open "
              f"RSS {mem['after_open']['rss']:.1f} / arrow {mem['after_open']['arrow']:.1f}; at the first sample RSS "
              f"{mem['at_first_sample']['rss']:.1f} / arrow {mem['at_first_sample']['arrow']:.1f} (peak so far "
              f"{mem['at_first_sample']['peak_rss']:.1f}); one epoch: peak RSS {mem['peak_rss_above_imports_mib']:.1f}"
              f", peak Arrow allocated {mem['peak_arrow_allocated_mib']:.1f}; one window "
              f"({mem['window']['rows']:,} rows) as Python rows {mem['window']['python_rows_mib']:.1f}, keys "
              f"{mem['window']['key_arrays_mib']:.2f}; prefetched {mem['window']['prefetched_row_groups']} row groups "
              f"{mem['window']['prefetched_mib']:.1f}; {mem['window']['open_shards']} open shards holding "
              f"{mem['window']['open_shard_buffers_mib']:.1f} of row groups")
        print("  RSS / Arrow above imports while reading (rows: MiB / MiB): " + ", ".join(
            f"{n:,}: {r:.0f} / {a:.0f}" for n, r, a in mem["timeline_rows_rss_arrow_mib"]))
    # peak RSS for other prefetch depths / windows, through peers.py's read child (same measurement)
    variants = {"default (prefetch_blocks 8, buffer 16384)": ({}, {}),
                "prefetch_blocks 0": ({"prefetch_blocks": 0}, {}),
                "prefetch_blocks 2": ({"prefetch_blocks": 2}, {}),
                "buffer_size 1024": ({"buffer_size": 1024}, {}),
                "prefetch_blocks 0, buffer_size 1024": ({"prefetch_blocks": 0, "buffer_size": 1024}, {}),
                "default, MALLOC_ARENA_MAX=1": ({}, {"MALLOC_ARENA_MAX": "1"}),
                "default, ARROW_DEFAULT_MEMORY_POOL=system": ({}, {"ARROW_DEFAULT_MEMORY_POOL": "system"})}
    out["memory_variants"] = {}
    for name, (over, env) in variants.items():
        runs = []
        for _ in range(2):
            proc = subprocess.run([sys.executable, peers_script, "--_child", "read", "ours",
                                   json.dumps({**main_p, "ours_overrides": over})], capture_output=True, text=True,
                                  timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if lines:
                runs.append(json.loads(lines[-1]))
            else:
                sys.stderr.write(f"  ! variant {name} failed:\n{proc.stderr[-2000:]}\n")
        if runs:
            best = {"peak_above_imports_mib": min(r["peak_above_imports_mib"] for r in runs),
                    "rows_s": max(r["rows_s"] for r in runs), "first_s": min(r["first_s"] for r in runs)}
            out["memory_variants"][name] = best
            print(f"  {name:42s} peak RSS +{best['peak_above_imports_mib']:6.1f} MiB  {best['rows_s']:11,.0f} rows/s"
                  f"  first {best['first_s'] * 1e3:6.1f} ms")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_child":
        res = CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
        print(json.dumps(res), flush=True)
        os._exit(0)
    raise SystemExit("run through benchmarks/peers.py --profile")


def run_s3(main_p: dict, repeats: int = 3) -> dict:
    """Ours' first sample over moto's S3 (tests/_support/s3_server.py), with the requests the server saw."""
    sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))
    from s3_server import S3Server

    out: dict = {}
    with S3Server(readable=("bench",)) as srv:
        admin = srv.admin()
        admin.create_bucket(Bucket="bench")
        for f in sorted(os.listdir(main_p["parquet"])):
            if f.endswith(".parquet"):
                admin.upload_file(os.path.join(main_p["parquet"], f), "bench", f"parquet/{f}")
        env = {**srv.env(), "AWS_ENDPOINT_URL": srv.endpoint}
        p = {"parquet": main_p["parquet"], "s3": srv.endpoint}
        runs = []
        for _ in range(repeats):
            before = len(srv.requests)
            res = _run("timed", p, env)
            if "error" in res:
                continue
            reqs = srv.requests[before:]
            kinds: dict[str, int] = {}
            for method, path in reqs:
                what = ("list" if path.rstrip("/").endswith("/bench") or path in ("/bench", "/bench/") else
                        f"{method} object")
                kinds[what] = kinds.get(what, 0) + 1
            res["requests"] = {"total": len(reqs), **kinds}
            runs.append(res)
        if runs:
            best = min(runs, key=lambda r: r["marks"]["total_ms"])
            best["totals_ms"] = sorted(r["marks"]["total_ms"] for r in runs)
            out = best
            _print_timed(f"S3 (moto) first sample, requests {best['requests']} (ms)", best)
    return out
