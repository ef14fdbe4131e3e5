#!/usr/bin/env python
"""Ours against litdata 0.2.76, MosaicML Streaming 0.13.0 and HF ``datasets`` streaming, side by side.

Runs in the benchmark venv (``benchmarks/make_bench_venv.sh`` or ``make bench-peers``: the project plus the
``bench`` extra). The same generated rows (``benchmarks/_peers_data.py``: 1M rows of ~300 bytes, ``id`` /
``text`` / ``label``) are written as 16 parquet files with row groups of 16384 (read by ours and by HF), as
litdata chunks (``litdata.optimize``, chunk_bytes 64MB, its default; reader ``litdata``), as litdata chunks of ~1
parquet file each (chunk_bytes 20 MB: 16 chunks; reader ``litdata_file``, in the local read and resume only) and
as MDS shards (``MDSWriter``, its default size_limit of 64 MiB). Every reader is shuffled: ours ``ResumableStream(StreamConfig(shuffle=True,
buffer_size=16384))``, HF ``load_dataset("parquet", streaming=True).shuffle(seed=42, buffer_size=16384)``,
litdata ``StreamingDataset(shuffle=True)``, MosaicML ``StreamingDataset(shuffle=True, batch_size=128)``, each
with its defaults otherwise, iterated sample by sample in the process (no DataLoader, no workers).

Each measurement runs in a fresh process; the libraries are imported before the clock starts. Best of
``--repeats`` (3) with the readers taking turns; the spread (worst) is reported too. Measures:

* **read**: rows/s over one epoch (1M rows) after the first sample, rows per CPU-second of the process (all
  its threads), time (and CPU time) to first sample (open + first sample), peak RSS above the RSS after
  imports (``VmHWM`` reset after the imports, ``benchmarks/_peers_mem.py``: not ``ru_maxrss``, which a child
  inherits from its parent) and its anonymous / file-backed parts sampled every 5 ms (litdata maps its
  chunks); raw pyarrow ``iter_batches`` + ``to_pylist`` (unshuffled) as the reference for rows per
  CPU-second. The ids of the epoch are counted: each row exactly once?
* **resume**: a process reads 400,000 samples, saves the reader's state (ours: ``save_sidecar``; litdata:
  ``StreamingDataset.state_dict(400000, 0, 1)``; MosaicML: ``state_dict(400000, from_beginning=True)``;
  HF: ``IterableDataset.state_dict()``) and records the next 1,000 ids. Fresh processes then open the
  reader (ours: ``ResumableStream(cfg, index_from=the state dir)``, the trainer's way, reusing the saved
  index), load the state (ours: ``load_sidecar``, verification on) and read 1,000 samples: *load -> first
  sample* (from the load call) and *open + load -> first sample*; exact = the 1,000 ids equal the
  uninterrupted run's, position by position.
* **4 ranks** on data that does not divide evenly (100,003 rows in 7 parquet files; litdata / MDS with
  4 MiB chunks / shards): 4 processes with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``
  and a gloo process group, each reading one epoch (ours: ``set_epoch(0)``; HF:
  ``split_dataset_by_node``; litdata and MosaicML: their own rank detection). Reported: rows per rank,
  rows seen once / more than once / never.
* **S3**: the same three datasets uploaded to moto's S3 server on 127.0.0.1 (``tests/_support/s3_server.py``);
  time to first sample from a cold local cache (ours: no block cache; litdata / MosaicML: an empty cache
  directory, which they need).

``--profile`` adds where ours spends its time to first sample and resume and its memory, and its first
sample over S3 (``benchmarks/_peers_profile.py``; ``--profile s3``: only that). ``--report out.json`` prints
the table of an earlier run. With ``--readers ours`` it runs without the peers installed (the test suite's
``tests/test_bench_peers.py`` does).

    .venv-bench/bin/python benchmarks/peers.py [--quick] [--repeats N] [--only read,resume,ranks,s3]
        [--readers ours,litdata,litdata_file,mosaic,hf] [--profile [s3]] [--json out.json] [--report out.json]
        [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import _common  # noqa: E402,I001  (sets HF_DATASETS_CACHE before datasets is imported)
import _peers_data as data
import _peers_mem

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))

BUFFER = 16384
SEED = 42
READERS = ("ours", "litdata", "litdata_file", "mosaic", "hf")
LITDATA = ("litdata", "litdata_file")     # litdata with chunks of its default size / of ~1 parquet file each
LABELS = {"ours": "ours", "litdata": "litdata 0.2.76", "litdata_file": "litdata, ~1 file per chunk",
          "mosaic": "MosaicML Streaming 0.13.0",
          "hf": "HF datasets", "pyarrow": "raw pyarrow"}
MEASURES = ("read", "resume", "ranks", "s3")
BUCKET = "bench"
# MosaicML requires batch_size (the per-device batch of the DataLoader it would be read with) and downloads
# predownload = 8 x batch_size samples ahead, polling every 7 ms: with batch_size=1 it reads ~1k rows/s here.
# 128 is a common per-device batch (and 400,000 samples are 3,125 of its batches, so the resume point is a
# batch boundary).
MOSAIC_BATCH = 128


# ====================================================================================== child side
def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    for name in ("datasets", "litdata", "streaming", "resumable_stream", "botocore", "s3fs", "fsspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _common.quiet_logs()


def _imports(reader: str) -> None:
    """What the reader needs, imported before any clock starts (so the RSS baseline covers it)."""
    import pyarrow.parquet  # noqa: F401

    if reader == "ours":
        import datasets  # noqa: F401  (the source resolves through it)

        import resumable_stream.stream.single  # noqa: F401
    elif reader == "hf":
        import datasets  # noqa: F401
    elif reader in LITDATA:
        import litdata  # noqa: F401
    elif reader == "mosaic":
        import _peers_compat

        _peers_compat.stub_torchvision()
        import streaming  # noqa: F401
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()      # what an earlier (killed) process may have left
    if reader in (*LITDATA, "mosaic"):
        import torch  # noqa: F401
    _quiet()


class Reader:
    """One reader: ``open`` (the clock is running), ``rows`` (an iterator of dicts), ``state`` / ``load``."""

    def __init__(self, name: str, p: dict):
        self.name, self.p = name, p
        self.s3 = p.get("s3")

    # ---------------------------------------------------------------- open
    def open(self, rank: int | None = None, world_size: int | None = None, index_from: str | None = None):
        p, name = self.p, self.name
        if name == "ours":
            from resumable_stream import ResumableStream, StreamConfig

            files = (f"s3://{BUCKET}/parquet/*.parquet" if self.s3 else os.path.join(p["parquet"], "*.parquet"))
            extra = {"storage_options": {"endpoint_url": self.s3}} if self.s3 else {}
            opts = {"shuffle": True, "buffer_size": BUFFER, "shuffle_seed": SEED, **extra,
                    **p.get("ours_overrides", {})}
            cfg = StreamConfig(dataset_name_or_path="parquet", data_files=files, **opts)
            self.ds = ResumableStream(cfg, rank=rank, world_size=world_size, index_from=index_from)
            if p.get("one_epoch"):
                self.ds.set_epoch(0)
        elif name == "hf":
            import datasets

            files = (f"s3://{BUCKET}/parquet/*.parquet" if self.s3 else os.path.join(p["parquet"], "*.parquet"))
            extra = {"storage_options": {"endpoint_url": self.s3}} if self.s3 else {}
            ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True, **extra)
            ds = ds.shuffle(seed=SEED, buffer_size=BUFFER)
            if world_size is not None:
                from datasets.distributed import split_dataset_by_node

                ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
            self.ds = ds
        elif name in LITDATA:
            from litdata import StreamingDataset

            if self.s3:
                import _peers_compat

                _peers_compat.litdata_allow_http()
                self.ds = StreamingDataset(f"s3://{BUCKET}/litdata", cache_dir=p["cache_dir"], shuffle=True,
                                           seed=SEED, storage_options={"endpoint_url": self.s3})
            else:
                self.ds = StreamingDataset(p[name], shuffle=True, seed=SEED, drop_last=p.get("drop_last"))
        elif name == "mosaic":
            from streaming import StreamingDataset

            if self.s3:
                self.ds = StreamingDataset(remote=f"s3://{BUCKET}/mds", local=p["cache_dir"], shuffle=True,
                                           shuffle_seed=SEED, batch_size=MOSAIC_BATCH)
            else:
                self.ds = StreamingDataset(local=p["mds"], shuffle=True, shuffle_seed=SEED, batch_size=MOSAIC_BATCH)
        elif name == "pyarrow":
            self.ds = data.parquet_files(p["parquet"])
        else:
            raise ValueError(name)
        return self

    def rows(self):
        if self.name == "pyarrow":
            import pyarrow.parquet as pq

            def gen():
                for f in self.ds:
                    for batch in pq.ParquetFile(f).iter_batches():
                        yield from batch.to_pylist()

            return gen()
        return iter(self.ds)

    # ---------------------------------------------------------------- state
    def state(self, consumed: int, path: str):
        """Save the state after ``consumed`` samples to ``path`` (a directory for ours, else a pickle)."""
        if self.name == "ours":
            self.ds.save_sidecar(path)
            return
        if self.name == "hf":
            st = self.ds.state_dict()
        elif self.name in LITDATA:
            st = self.ds.state_dict(consumed, 0, 1)     # (samples yielded, num_workers, batch_size)
        else:
            st = self.ds.state_dict(consumed, True)     # (samples in this epoch, from the beginning)
        import pickle  # the peers' states hold what JSON may not (HF's); a file of this benchmark only

        with open(path, "wb") as f:
            pickle.dump(st, f)

    def load(self, path: str) -> None:
        if self.name == "ours":
            self.ds.load_sidecar(path)
            return
        import pickle

        with open(path, "rb") as f:
            st = pickle.load(f)
        self.ds.load_state_dict(st)


def _base_rss() -> float:
    return _peers_mem.baseline_mib()


def child_read(reader: str, p: dict) -> dict:
    _imports(reader)
    counts = bytearray(p["total_rows"])
    base = _base_rss()
    sampler = _peers_mem.Sampler()
    t0, c0 = time.perf_counter(), time.process_time()
    r = Reader(reader, p).open()
    # one `for` over the iterator: litdata's StreamingDataset is its own iterator and restarts the epoch when
    # iter() is called on it again (after a next(), a `for` would yield the first sample twice)
    n, limit = 0, p["rows"]
    t1 = c1 = None
    for row in r.rows():
        counts[row["id"]] += 1
        n += 1
        if n == 1:
            t1, c1 = time.perf_counter(), time.process_time()
        if n >= limit:
            break
    t2, c2 = time.perf_counter(), time.process_time()
    parts = sampler.stop()
    once = counts.count(1)
    return {**parts, "rows": n, "first_s": t1 - t0, "first_cpu_s": c1 - c0, "rows_s": (n - 1) / (t2 - t1),
            "rows_cpu_s": (n - 1) / max(c2 - c1, 1e-9), "read_s": t2 - t1, "rss_after_imports_mib": base,
            "peak_rss_mib": _peers_mem.peak_rss_mib(), "peak_above_imports_mib": _peers_mem.peak_rss_mib() - base,
            "rows_once": once, "rows_never": counts.count(0), "rows_more": p["total_rows"] - once - counts.count(0)}


def child_save(reader: str, p: dict) -> dict:
    _imports(reader)
    r = Reader(reader, p).open()
    it = r.rows()
    k = p["resume_at"]
    t0 = time.perf_counter()
    for _ in range(k):
        next(it)
    t1 = time.perf_counter()
    r.state(k, p["state_path"])
    t2 = time.perf_counter()
    ref = [int(next(it)["id"]) for _ in range(p["check"])]
    return {"ids": ref, "read_s": t1 - t0, "save_s": t2 - t1}


def child_resume(reader: str, p: dict) -> dict:
    _imports(reader)
    base = _base_rss()
    t0 = time.perf_counter()
    r = Reader(reader, p).open(index_from=p["state_path"] if reader == "ours" else None)
    t1 = time.perf_counter()
    r.load(p["state_path"])
    t2 = time.perf_counter()
    it = r.rows()
    first = next(it)
    t3 = time.perf_counter()
    ids = [int(first["id"])] + [int(next(it)["id"]) for _ in range(p["check"] - 1)]
    ref = p["ref"]
    return {"open_s": t1 - t0, "load_s": t2 - t1, "load_to_first_s": t3 - t1, "restart_s": t3 - t0,
            "exact": sum(a == b for a, b in zip(ids, ref)), "same_ids": len(set(ids) & set(ref)),
            "check": len(ref), "peak_above_imports_mib": _peers_mem.peak_rss_mib() - base}


def child_rank(reader: str, p: dict) -> dict:
    import torch.distributed as dist

    _imports(reader)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    r = Reader(reader, {**p, "one_epoch": True}).open(rank=rank, world_size=world)
    ids = [int(row["id"]) for row in r.rows()]
    secs = time.perf_counter() - t0
    with open(os.path.join(p["out_dir"], f"{reader}-{rank}.json"), "w") as f:
        json.dump(ids, f)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "rows": len(ids), "secs": secs}


def child_s3(reader: str, p: dict) -> dict:
    _imports(reader)
    if reader == "ours":
        import s3fs  # noqa: F401  (fsspec's s3 implementation: a library import, before the clock)
    elif reader == "hf":
        import s3fs  # noqa: F401
    base = _base_rss()
    t0 = time.perf_counter()
    r = Reader(reader, p).open()
    n, t1 = 0, None
    for _ in r.rows():      # one `for` (see child_read)
        n += 1
        if n == 1:
            t1 = time.perf_counter()
        if n >= p["rows"]:
            break
    t2 = time.perf_counter()
    return {"first_s": t1 - t0, "rows_s": (n - 1) / (t2 - t1) if n > 1 else None, "rows": n,
            "peak_above_imports_mib": _peers_mem.peak_rss_mib() - base}


CHILDREN = {"read": child_read, "save": child_save, "resume": child_resume, "rank": child_rank, "s3": child_s3}


# ====================================================================================== parent side
def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore",
           "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra or {})
    return env


def _spawn(mode: str, reader: str, p: dict, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode, reader, json.dumps(p)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env))


def _collect(proc: subprocess.Popen, what: str, timeout: float = 1800) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "stderr": err[-2000:]}
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"  ! {what} failed (exit {proc.returncode}):\n{err[-3000:]}\n")
        return {"error": f"exit {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}"[:500]}
    return json.loads(lines[-1])


def _run(mode: str, reader: str, p: dict, env: dict | None = None, timeout: float = 1800) -> dict:
    return _collect(_spawn(mode, reader, p, env), f"{mode} {reader}", timeout)


def _best(runs: list[dict], key: str, lower: bool) -> tuple[float | None, float | None]:
    """(best, worst) of ``key`` over the runs that have it."""
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    if not vals:
        return None, None
    return (min(vals), max(vals)) if lower else (max(vals), min(vals))


def _summary(runs: list[dict], keys: dict[str, bool]) -> dict:
    out: dict = {"runs": runs}
    for key, lower in keys.items():
        out[key], out[key + "_worst"] = _best(runs, key, lower)
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        out["errors"] = errors
    return out


READ_KEYS = {"rows_s": False, "rows_cpu_s": False, "first_s": True, "first_cpu_s": True,
             "peak_above_imports_mib": True, "peak_anon_above_imports_mib": True,
             "peak_file_above_imports_mib": True}


def bench_read(readers: tuple[str, ...], p: dict, repeats: int) -> dict:
    runs: dict[str, list] = {r: [] for r in (*readers, "pyarrow")}
    for i in range(repeats):
        for reader in runs:
            res = _run("read", reader, p)
            runs[reader].append(res)
            if "error" not in res:
                print(f"    [{i + 1}/{repeats}] {reader:8s} {res['rows_s']:11,.0f} rows/s  {res['rows_cpu_s']:11,.0f} "
                      f"rows/CPU-s  first {res['first_s'] * 1e3:7.0f} ms  peak +{res['peak_above_imports_mib']:5.0f} MiB"
                      f"  once {res['rows_once']:,} / more {res['rows_more']:,} / never {res['rows_never']:,}",
                      flush=True)
    return {r: _summary(v, READ_KEYS) for r, v in runs.items()}


def bench_resume(readers: tuple[str, ...], p: dict, repeats: int, work: str) -> dict:
    out: dict = {}
    refs: dict[str, dict] = {}
    for reader in readers:
        state = os.path.join(work, f"state-{reader}" + ("" if reader == "ours" else ".pkl"))
        saved = _run("save", reader, {**p, "state_path": state})
        if "error" in saved:
            out[reader] = {"errors": [saved["error"]]}
            continue
        refs[reader] = {"state_path": state, "ref": saved.pop("ids")}
        print(f"    {reader:8s} saved after {p['resume_at']:,} samples (read {saved['read_s']:.1f} s, "
              f"save {saved['save_s'] * 1e3:.1f} ms)", flush=True)
        out[reader] = {"save": saved}
    runs: dict[str, list] = {r: [] for r in refs}
    for i in range(repeats):
        for reader in refs:
            res = _run("resume", reader, {**p, **refs[reader]})
            runs[reader].append(res)
            if "error" not in res:
                print(f"    [{i + 1}/{repeats}] {reader:8s} load -> first {res['load_to_first_s'] * 1e3:7.1f} ms  "
                      f"open+load -> first {res['restart_s'] * 1e3:7.1f} ms  exact {res['exact']}/{res['check']}  "
                      f"(same ids {res['same_ids']})", flush=True)
    keys = {"load_to_first_s": True, "restart_s": True, "open_s": True, "load_s": True,
            "peak_above_imports_mib": True}
    for reader, v in runs.items():
        out[reader].update(_summary(v, keys))
        ok = [r for r in v if "exact" in r]
        out[reader]["exact"] = min((r["exact"] for r in ok), default=None)
        out[reader]["same_ids"] = min((r["same_ids"] for r in ok), default=None)
        out[reader]["check"] = p["check"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_ranks(readers: tuple[str, ...], p: dict, world: int, work: str) -> dict:
    out: dict = {}
    total = p["total_rows"]
    for reader in readers:
        out_dir = tempfile.mkdtemp(prefix=f"ranks-{reader}-", dir=work)
        port = _free_port()
        procs = []
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "NODE_RANK": "0", "GROUP_RANK": "0"}
            procs.append(_spawn("rank", reader, {**p, "out_dir": out_dir}, env))
        results = [_collect(proc, f"rank {r} {reader}", 900) for r, proc in enumerate(procs)]
        if any("error" in r for r in results):
            out[reader] = {"errors": [r["error"] for r in results if "error" in r]}
            continue
        counts = bytearray(total)
        extra = 0
        per_rank = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{reader}-{rank}.json")) as f:
                ids = json.load(f)
            per_rank.append(len(ids))
            for i in ids:
                if counts[i] < 255:
                    counts[i] += 1
                else:
                    extra += 1
        once, never = counts.count(1), counts.count(0)
        more = total - once - never
        seen = sum(per_rank)
        out[reader] = {"per_rank": per_rank, "rows_seen": seen, "once": once, "more_than_once": more,
                       "never": never, "extra_reads": seen - once - more, "exactly_once": once == total,
                       "secs": max(r["secs"] for r in results)}
        print(f"    {reader:8s} rows per rank {per_rank} (sum {seen:,} of {total:,}): once {once:,}, more than once "
              f"{more:,}, never {never:,} -> {'each row exactly once' if once == total else 'NOT each row once'}",
              flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    return out


def _upload(client, local_dir: str, prefix: str) -> int:
    n = 0
    for f in sorted(os.listdir(local_dir)):
        if f == "COMPLETE" or f.endswith(".lock"):
            continue
        client.upload_file(os.path.join(local_dir, f), BUCKET, f"{prefix}/{f}")
        n += os.path.getsize(os.path.join(local_dir, f))
    return n


def bench_s3(readers: tuple[str, ...], p: dict, repeats: int, work: str) -> dict:
    from s3_server import S3Server

    out: dict = {}
    with S3Server(readable=(BUCKET,)) as srv:
        admin = srv.admin()
        admin.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        sizes = {"parquet": _upload(admin, p["parquet"], "parquet")}
        if "litdata" in readers:
            sizes["litdata"] = _upload(admin, p["litdata"], "litdata")
        if "mosaic" in readers:
            sizes["mds"] = _upload(admin, p["mds"], "mds")
        print(f"    uploaded to moto ({srv.endpoint}): " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in
                                                                       sizes.items())
              + f" in {time.perf_counter() - t0:.1f} s", flush=True)
        env = {**srv.env(), "S3_ENDPOINT_URL": srv.endpoint, "AWS_ENDPOINT_URL": srv.endpoint,
               "AWS_ENDPOINT": srv.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1"}
        runs: dict[str, list] = {r: [] for r in readers}
        for i in range(repeats):
            for reader in readers:
                cache = tempfile.mkdtemp(prefix=f"s3cache-{reader}-", dir=work)
                before = srv.count()
                res = _run("s3", reader, {**p, "s3": srv.endpoint, "cache_dir": cache}, env, timeout=900)
                res["requests"] = srv.count() - before
                runs[reader].append(res)
                shutil.rmtree(cache, ignore_errors=True)
                if "error" not in res:
                    print(f"    [{i + 1}/{repeats}] {reader:8s} first sample {res['first_s'] * 1e3:7.0f} ms "
                          f"({res['requests']} requests for {res['rows']:,} rows)", flush=True)
        out = {r: _summary(v, {"first_s": True}) for r, v in runs.items()}
        out["bytes"] = sizes
    return out


# ====================================================================================== report
def _fmt(v, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "ms":
        return f"{v * 1e3:,.0f} ms" if v >= 0.1 else f"{v * 1e3:,.1f} ms"
    if unit == "MiB":
        return f"{v:,.0f} MiB"
    return f"{v:,.0f}"


def _cell(res: dict, key: str, unit: str, ours: float | None, higher_better: bool, show_ratio: bool) -> str:
    v, worst = res.get(key), res.get(key + "_worst")
    if v is None:
        return "failed" if res.get("errors") else "—"
    s = _fmt(v, unit)
    if worst is not None and worst != v:
        s += f" ({_fmt(worst, unit).split()[0]})"
    if show_ratio and ours:
        s += f" [{v / ours:.2f}x]"
    return s


def report(out: dict, readers: tuple[str, ...]) -> list[str]:
    lines = []
    cols = list(readers)
    head = "| measure | " + " | ".join(LABELS[r] for r in cols) + " |"
    lines += [head, "|---" * (len(cols) + 1) + "|"]

    def row(title: str, section: str, key: str, unit: str, higher_better: bool, extra=None):
        sec = out.get(section)
        if not sec:
            return
        ours = (sec.get("ours") or {}).get(key)
        cells = []
        for r in cols:
            res = sec.get(r) or {}
            c = _cell(res, key, unit, ours, higher_better, r != "ours")
            if extra:
                c += extra(res)
            cells.append(c)
        lines.append(f"| {title} | " + " | ".join(cells) + " |")

    row("shuffled rows/s (local)", "read", "rows_s", "n", True)
    row("rows per CPU-second", "read", "rows_cpu_s", "n", True)
    row("time to first sample (local)", "read", "first_s", "ms", False)
    row("CPU time to first sample (all threads)", "read", "first_cpu_s", "ms", False)
    row("peak RSS above imports (one epoch)", "read", "peak_above_imports_mib", "MiB", False)
    row("  of it anonymous (sampled every 5 ms)", "read", "peak_anon_above_imports_mib", "MiB", False)
    row("  of it file-backed (mapped files)", "read", "peak_file_above_imports_mib", "MiB", False)
    row("resume: load -> first sample", "resume", "load_to_first_s", "ms", False,
        lambda res: (f", exact {res['exact']}/{res['check']}" if res.get("exact") is not None else ""))
    row("resume: open + load -> first sample", "resume", "restart_s", "ms", False)
    if out.get("ranks"):
        cells = []
        for r in cols:
            res = out["ranks"].get(r) or {}
            if "once" not in res:
                cells.append("failed" if res.get("errors") else "—")
                continue
            verdict = "each row once" if res["exactly_once"] else (
                f"{res['never']:,} never, {res['more_than_once']:,} repeated")
            cells.append(f"{verdict}; per rank {'/'.join(f'{n:,}' for n in res['per_rank'])}")
        lines.append("| 4 ranks, uneven data | " + " | ".join(cells) + " |")
    row("S3 (moto, loopback): first sample", "s3", "first_s", "ms", False)
    rd = out.get("read") or {}
    if rd.get("ours", {}).get("rows_cpu_s") and rd.get("pyarrow", {}).get("rows_cpu_s"):
        lines.append(f"\nraw pyarrow iter_batches + to_pylist (unshuffled): {rd['pyarrow']['rows_s']:,.0f} rows/s, "
                     f"{rd['pyarrow']['rows_cpu_s']:,.0f} rows per CPU-s; ours per CPU-s / pyarrow = "
                     f"{rd['ours']['rows_cpu_s'] / rd['pyarrow']['rows_cpu_s']:.2f}x")
    lines.append("\nbest of the runs, (worst) in parentheses, [ratio to ours]; for rows/s higher is better, "
                 "for ms and MiB lower")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k rows in 4 files, 1 repeat (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="fresh processes per reader and measure (default 3)")
    ap.add_argument("--only", default=",".join(MEASURES), help=f"measures to run (default {','.join(MEASURES)})")
    ap.add_argument("--readers", default=",".join(READERS), help=f"readers (default {','.join(READERS)})")
    ap.add_argument("--profile", nargs="?", const="all", default=None, choices=("all", "s3"),
                    help="also profile ours (benchmarks/_peers_profile.py); --profile s3: only over S3")
    ap.add_argument("--resume-at", type=int, default=None,
                    help="samples read before the resume's save (default 400,000; --quick 38,400): a multiple of "
                         f"{MOSAIC_BATCH}, MosaicML's batch; 1,024 and 600,064 show whether the resume is flat in progress")
    ap.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR, help="where generated data is cached")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the table of an earlier --json run")
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            old = json.load(f)
        if "read" in old:     # summaries again from the runs (a key added since is then filled in)
            old["read"] = {r: _summary(v["runs"], READ_KEYS) for r, v in old["read"].items()}
        have = tuple(r for r in READERS if any(r in (old.get(m) or {}) for m in MEASURES))
        print(f"{old.get('data', '')}\n" + "\n".join(report(old, have)))
        return 0
    if args._child:
        mode, reader, params = args._child
        res = CHILDREN[mode](reader, json.loads(params))
        print(json.dumps(res), flush=True)
        sys.stderr.flush()
        os._exit(0)     # skip teardown (HF's and MosaicML's threads): the figures are out

    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    only = tuple(m for m in args.only.split(",") if m in MEASURES)
    readers = tuple(r for r in args.readers.split(",") if r in READERS)
    if "ours" not in readers:
        readers = ("ours", *readers)
    rows, files = (100_000, 4) if q else (1_000_000, 16)
    u_rows, u_files = (10_003, 7) if q else (100_003, 7)
    t_start = time.perf_counter()
    print(f"peers benchmark (python {platform.python_version()}, {os.cpu_count()} cpus{', QUICK' if q else ''}): "
          f"{', '.join(LABELS[r] for r in readers)}")
    main_pq = data.parquet_dir(args.data_dir, rows, files, _common.ROW_GROUP_SIZE)
    main_p = {"parquet": main_pq, "total_rows": rows, "rows": rows}
    if "litdata" in readers:
        main_p["litdata"] = data.litdata_dir(args.data_dir, main_pq)
    if "litdata_file" in readers:
        main_p["litdata_file"] = data.litdata_dir(args.data_dir, main_pq, data.FILE_CHUNK_BYTES)
    if "mosaic" in readers:
        main_p["mds"] = data.mds_dir(args.data_dir, main_pq)
    shards = {d: data.shard_count(main_p[d], k) for k, d in (("parquet", "parquet"), ("litdata", "litdata"),
                                                               ("litdata", "litdata_file"), ("mds", "mds"))
              if d in main_p}
    desc = (f"{rows:,} rows of ~300 bytes ({data.WORDS} words), {files} parquet files with row groups of "
            f"{_common.ROW_GROUP_SIZE}; shards: " + ", ".join(f"{k} {v}" for k, v in shards.items()))
    print(f"data: {desc}")
    out: dict = {"benchmark": "peers", "quick": q, "repeats": repeats, "python": platform.python_version(),
                 "cpus": os.cpu_count(), "data": desc, "shards": shards}
    work = tempfile.mkdtemp(prefix="rs-bench-peers-")
    try:
        if "read" in only:
            print(f"\nread: one epoch ({rows:,} rows) shuffled, best of {repeats}", flush=True)
            out["read"] = bench_read(readers, main_p, repeats)
        if "resume" in only:
            at = args.resume_at or (38_400 if q else 400_000)     # multiples of MOSAIC_BATCH
            if at % MOSAIC_BATCH or not 0 < at < rows:
                ap.error(f"--resume-at: got {at}; allowed: a multiple of {MOSAIC_BATCH} between 1 and {rows - 1}")
            print(f"\nresume after {at:,} samples, 1,000 checked, best of {repeats}", flush=True)
            out["resume"] = bench_resume(readers, {**main_p, "resume_at": at, "check": 1000}, repeats, work)
        # the litdata layout of ~1 file per chunk is compared on the local read and resume only
        readers_ranks_s3 = tuple(r for r in readers if r != "litdata_file")
        if "ranks" in only:
            u_pq = data.parquet_dir(args.data_dir, u_rows, u_files, _common.ROW_GROUP_SIZE)
            u_p = {"parquet": u_pq, "total_rows": u_rows}
            if "litdata" in readers:
                u_p["litdata"] = data.litdata_dir(args.data_dir, u_pq, 1 << 22)
            if "mosaic" in readers:
                u_p["mds"] = data.mds_dir(args.data_dir, u_pq, 1 << 22)
            u_shards = {k: data.shard_count(u_p[d], k) for k, d in (("parquet", "parquet"), ("litdata", "litdata"),
                                                                      ("mds", "mds")) if d in u_p}
            print(f"\n4 ranks, one epoch of {u_rows:,} rows (shards: "
                  + ", ".join(f"{k} {v}" for k, v in u_shards.items()) + ")", flush=True)
            out["ranks"] = bench_ranks(readers_ranks_s3, u_p, 4, work)
            out["ranks"]["shards"] = u_shards
        if "s3" in only:
            s3_rows = 1000
            print(f"\nS3 (moto on 127.0.0.1): first sample from a cold cache, best of {repeats}", flush=True)
            out["s3"] = bench_s3(readers_ranks_s3, {**main_p, "rows": s3_rows}, repeats, work)
        if args.profile:
            import _peers_profile

            print("\nprofile of ours", flush=True)
            out["profile"] = _peers_profile.run(main_p, work, os.path.abspath(__file__)) if args.profile != "s3" else {}
            out["profile"]["s3"] = _peers_profile.run_s3(main_p)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + "\n".join(report(out, readers)))
    out["elapsed_s"] = time.perf_counter() - t_start
    print(f"\ntotal {out['elapsed_s']:.0f} s")
    if args.json_path:
        try:
            import datasets
            import pyarrow
            import torch

            out["versions"] = {"datasets": datasets.__version__, "pyarrow": pyarrow.__version__,
                               "torch": torch.__version__}
            import litdata

            out["versions"]["litdata"] = litdata.__version__
            import _peers_compat

            _peers_compat.stub_torchvision()
            import streaming

            out["versions"]["mosaicml-streaming"] = streaming.__version__
        except Exception:
            pass
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results written to {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
