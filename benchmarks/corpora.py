#!/usr/bin/env python
"""Pretraining corpora as they are published: JSON lines (.jsonl, .jsonl.zst, .json.gz), parquet with large row
groups, and WebDataset tars of the same rows; ours / HF streaming / the format's limit, local and remote.

Data: ``--files`` files per layout (default 2) of ``--rows`` rows in all (default 60,000), each row
``{"id", "text", "url"}`` with 1-4 KB of text (words drawn from a fixed vocabulary; seeded, generated once into
``.bench/corpora-*``). Layouts: ``jsonl`` (plain), ``jsonl.zst`` (one zstd frame per file, as the ``zstd`` tool
writes it), ``json.gz`` (``gzip -6``), ``parquet`` (one row group per file: ``--row-group`` rows, default all of a
file's rows, i.e. row groups of 30,000 rows / ~75 MB at the defaults) and ``webdataset`` (``KEY.txt`` +
``KEY.json`` members).

Every reader runs in a fresh process (imports before its clock), the readers of a layout alternate, each ``--repeat``
times (default 3), and the medians are printed:

* ``ours``: ``ResumableStream`` shuffled (buffer 10,000, the dataset index built in the process: its first sample
  includes indexing the files), reading every row;
* ``ours_indexed``: the same from a saved index (``data.index_path``; a restart, or ``resumable-stream index`` run
  before);
* ``hf_plain`` / ``hf_shuffled``: ``load_dataset(builder, data_files, streaming=True)`` (``.shuffle(seed,
  buffer_size=10000)``);
* ``limit``: the format itself, one core: JSON lines decompressed and ``orjson.loads`` per line (``json`` without
  orjson); parquet ``iter_batches`` + ``to_pylist``; a tar's members read with ``tarfile`` and the json parsed;
* resume: ours shuffled, saved after ``--resume-at`` rows (default 25,000), loaded in a fresh process: load ->
  first resumed sample, and the bytes read from the files before it (our reads; ``/proc/self/io`` rchar for both);
  against HF's unshuffled resume (``IterableDataset.state_dict`` / ``load_state_dict``, the only exact one).

Remote (``--remote``, on by default): the same files on the loopback server (tests/_support/http_server.py) with
100 ms per request: ours (index built in the process; and ``ours_indexed``) and HF plain / shuffled, rows/s after
the first sample, first sample, requests and bytes served; and ``net_limit``: the files' bytes alone over the same
client (``read_range``, 16 MiB ranges, 8 at a time: what ours keeps in flight), nothing parsed; its first sample
is the first range's arrival, its rows/s the rows the later bytes hold per second: what the server and the link
deliver on this machine, the bound of any reader of these files.

Per reader: rows/s after the first sample, CPU seconds per 1,000 rows, first sample; ratios are taken between
medians of the same run. The machine's load average is printed at start and end.

    .venv/bin/python benchmarks/corpora.py [--quick] [--layouts jsonl,jsonl.zst,json.gz,parquet,webdataset]
        [--repeat 3] [--no-remote | --no-local] [--row-group N] [--json out.json] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import _common  # (sets HF_DATASETS_CACHE before datasets is imported)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))

BUFFER = 10_000
LAYOUTS = ("jsonl", "jsonl.zst", "json.gz", "parquet", "webdataset")
BUILDERS = {"jsonl": "json", "jsonl.zst": "json", "json.gz": "json", "parquet": "parquet", "webdataset": "webdataset"}
EXT = {"jsonl": ".jsonl", "jsonl.zst": ".jsonl.zst", "json.gz": ".json.gz", "parquet": ".parquet",
       "webdataset": ".tar"}


# ------------------------------------------------------------------------------ data
def _rows(first: int, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 11)))
             for _ in range(20000)]
    out = []
    for i in range(first, first + n):
        words, size, target = [], 0, rng.randint(1000, 4000)
        while size < target:
            w = rng.choice(vocab)
            words.append(w)
            size += len(w) + 1
        out.append({"id": i, "text": " ".join(words), "url": f"https://example.com/{i}"})
    return out


def corpus(data_dir: str, rows: int, files: int, row_group: int | None) -> dict[str, list[str]]:
    """The files of every layout (generated once, reused)."""
    name = f"corpora-{rows}r-{files}f-{row_group or 'file'}rg"
    root = os.path.join(data_dir, name)
    marker = os.path.join(root, "COMPLETE")
    layout_files = {k: [os.path.join(root, k, f"part-{i:05d}{EXT[k]}") for i in range(files)] for k in LAYOUTS}
    if os.path.exists(marker):
        return layout_files
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    print(f"  generating {rows:,} rows in {files} files per layout -> {root}", flush=True)
    os.makedirs(data_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=data_dir)
    per = rows // files
    for i in range(files):
        rs = _rows(i * per, per, seed=i)
        text = "".join(json.dumps(r) + "\n" for r in rs).encode()
        for k in LAYOUTS:
            os.makedirs(os.path.join(tmp, k), exist_ok=True)
        base = os.path.join(tmp, "{}", f"part-{i:05d}")
        with open(base.format("jsonl") + ".jsonl", "wb") as f:
            f.write(text)
        with open(base.format("jsonl.zst") + ".jsonl.zst", "wb") as f:
            f.write(zstandard.ZstdCompressor(level=3).compress(text))       # one frame, as `zstd` writes it
        with open(base.format("json.gz") + ".json.gz", "wb") as f:
            f.write(gzip.compress(text, 6))
        pq.write_table(pa.Table.from_pylist(rs), base.format("parquet") + ".parquet",
                       row_group_size=row_group or per)
        with tarfile.open(base.format("webdataset") + ".tar", "w") as tar:
            for r in rs:
                for suffix, data in (("txt", r["text"].encode()), ("json", json.dumps({"id": r["id"], "url": r["url"]})
                                                                   .encode())):
                    info = tarfile.TarInfo(f"s{r['id']:08d}.{suffix}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        json.dump({"rows": rows, "files": files}, f)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return layout_files


# ------------------------------------------------------------------------------ one reader (child process)
_BYTES = {"n": 0}


def _count_reads() -> None:
    """Count the bytes our reads take from the files (local and remote)."""
    from resumable_stream.io import ranged

    real = ranged._read_range

    def counted(path, start, end, *a, **k):
        data = real(path, start, end, *a, **k)
        _BYTES["n"] += len(data)
        return data

    ranged._read_range = counted


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return 0


def _limit(layout: str, files: list[str], n: int) -> int:
    """The format's own read of ``n`` rows, one core: rows made."""
    try:
        import orjson
        loads = orjson.loads
    except ImportError:
        loads = json.loads
    count = 0
    if layout.startswith("json"):
        import zstandard
        for path in files:
            if path.endswith(".zst"):
                stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), 1 << 20)
            elif path.endswith(".gz"):
                stream = gzip.open(path, "rb")
            else:
                stream = open(path, "rb", buffering=1 << 20)
            with stream:
                for line in stream:
                    if line.strip():
                        loads(line)
                        count += 1
                        if count >= n:
                            return count
    elif layout == "parquet":
        import pyarrow.parquet as pq
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
                for _ in batch.to_pylist():
                    count += 1
                if count >= n:
                    return count
    else:
        for path in files:
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    data = tar.extractfile(m).read()
                    if m.name.endswith(".json"):
                        loads(data)
                        count += 1
                    if count >= n:
                        return count
    return count


def _net_limit(files: list[str], n: int) -> tuple[float, float]:
    """The files' bytes over our HTTP client, nothing parsed (remote only), measured as the other readers are:
    the first range's arrival (their first sample), then the rows the rest of the bytes hold (``n`` rows in all the
    bytes) per second after it."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from resumable_stream.io import ranged

    part = 16 << 20                         # a JSON-lines piece's most (jsonl_index.PIECE_MAX_BYTES)
    sizes = [ranged.filesystem("http", {}).size(url) for url in files]
    jobs = [(url, a, min(a + part, size)) for url, size in zip(files, sizes) for a in range(0, size, part)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        done = [(time.perf_counter(), len(f.result())) for f in
                as_completed([pool.submit(ranged.read_range, url, a, b, {}) for url, a, b in jobs])]
    first_t, first_bytes = done[0]
    rest = sum(size for _, size in done[1:]) / sum(size for _, size in done)
    return first_t - t0, n * rest / max(done[-1][0] - first_t, 1e-9)


def _child(args: argparse.Namespace) -> None:
    import gc

    import datasets

    import resumable_stream.stream.mixture  # noqa: F401  (the stream's modules; the public names load on use)
    from resumable_stream import ResumableStream, StreamConfig

    _count_reads()
    files = json.loads(args.paths)
    builder = BUILDERS[args.layout]
    gc.collect()
    out: dict = {}
    r0, c0, t0 = _rchar(), time.process_time(), time.perf_counter()
    if args.reader == "limit":
        n = _limit(args.layout, files, args.rows)
        secs = time.perf_counter() - t0
        out = {"rows": n, "rows_s": n / secs, "cpu_ms_per_krows": (time.process_time() - c0) * 1e6 / n,
               "first_s": None}
    elif args.reader == "net_limit":
        first, rate = _net_limit(files, args.rows)
        out = {"rows": args.rows, "rows_s": rate, "first_s": first}
    elif args.reader == "resume_save":
        cfg = StreamConfig(dataset_name_or_path=builder, data_files=files, shuffle=True, buffer_size=BUFFER,
                           index_path=args.index)
        s = ResumableStream(cfg)
        for _ in zip(range(args.rows), s):
            pass
        s.save_sidecar(args.state)
        out = {"saved_after": args.rows}
    elif args.reader in ("resume_ours", "resume_hf"):
        if args.reader == "resume_ours":
            cfg = StreamConfig(dataset_name_or_path=builder, data_files=files, shuffle=True, buffer_size=BUFFER,
                               index_path=args.index, verify_files=False)
            s = ResumableStream(cfg, index_from=args.state)
            s.load_sidecar(args.state)
            it = iter(s)
        else:
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
            ds.load_state_dict(json.loads(open(args.state).read()))
            it = iter(ds)
        next(it)
        out = {"first_s": time.perf_counter() - t0, "bytes": _BYTES["n"], "rchar": _rchar() - r0}
    elif args.reader == "resume_hf_save":
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        it = iter(ds)
        for _ in zip(range(args.rows), it):
            pass
        with open(args.state, "w") as f:
            json.dump(ds.state_dict(), f)
        out = {"saved_after": args.rows}
    else:
        stream = None
        if args.reader.startswith("ours"):
            cfg = StreamConfig(dataset_name_or_path=builder, data_files=files, shuffle=True, buffer_size=BUFFER,
                               index_path=args.index if args.reader == "ours_indexed" else None,
                               verify_files=args.reader != "ours_indexed")
            stream = ResumableStream(cfg)
            it = iter(stream)
        else:
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
            if args.reader == "hf_shuffled":
                ds = ds.shuffle(seed=42, buffer_size=BUFFER)
            it = iter(ds)
        next(it)
        first = time.perf_counter() - t0
        first_bytes = _BYTES["n"]
        n = 1
        t1, c1 = time.perf_counter(), time.process_time()
        marks = []
        for _ in it:
            n += 1
            if n % 10_000 == 0:
                marks.append(round(time.perf_counter() - t0, 3))
            if n >= args.rows:
                break
        secs = time.perf_counter() - t1
        if args.trace:
            out["t0_monotonic"] = time.monotonic() - (time.perf_counter() - t0)
            out["rows_at_s"] = marks           # when each 10,000th row came, from the start
            if stream is not None:
                out["prefetch"] = {k: v for k, v in stream.source.prefetch_stats().items() if k != "busy_s"}
        out |= {"rows": n, "first_s": first, "first_bytes": first_bytes, "bytes": _BYTES["n"],
               "rows_s": (n - 1) / secs if n > 1 else None,
               "cpu_ms_per_krows": (time.process_time() - c1) * 1e6 / (n - 1) if n > 1 else None}
    out["peak_rss_mib"] = _common.peak_rss_mib()
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


def _run(layout: str, reader: str, files: list[str], rows: int, index: str | None = None,
         state: str | None = None, trace: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", reader, "--layout", layout, "--paths",
           json.dumps(files), "--rows", str(rows)]
    if index:
        cmd += ["--index", index]
    if state:
        cmd += ["--state", state]
    if trace:
        cmd += ["--trace"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_common.REPO_ROOT, os.environ.get("PYTHONPATH"))
                                                        if p)}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{layout} {reader} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _build_index(layout: str, files: list[str], path: str) -> None:
    code = ("import json, sys; from resumable_stream import ResumableStream, StreamConfig; "
            "from resumable_stream.sources.index import save_index; "
            "s = ResumableStream(StreamConfig(dataset_name_or_path=sys.argv[1], data_files=json.loads(sys.argv[2]))); "
            "save_index(sys.argv[3], s.source.index)")
    subprocess.run([sys.executable, "-c", code, BUILDERS[layout], json.dumps(files), path], check=True, timeout=1800,
                   env={**os.environ, "PYTHONPATH": _common.REPO_ROOT})


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


# ------------------------------------------------------------------------------ the run
def bench_layout(layout: str, files: list[str], rows: int, repeat: int, resume_at: int, work: str,
                 readers: tuple[str, ...]) -> dict:
    index = os.path.join(work, f"{layout}.index.json")
    _build_index(layout, files, index)
    runs: dict[str, list[dict]] = {r: [] for r in readers}
    for _ in range(repeat):                                   # the readers alternate
        for reader in readers:
            runs[reader].append(_run(layout, reader, files, rows, index=index))
    out: dict = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files), "readers": {}}
    for reader, rs in runs.items():
        out["readers"][reader] = {k: _median(rs, k) for k in ("rows_s", "first_s", "cpu_ms_per_krows", "bytes",
                                                               "first_bytes", "peak_rss_mib")}
        out["readers"][reader]["runs_first_s"] = [r.get("first_s") for r in rs]
        out["readers"][reader]["runs_rows_s"] = [r.get("rows_s") for r in rs]
    # resume: ours shuffled vs HF unshuffled, each saved once and loaded `repeat` times
    ours_state, hf_state = os.path.join(work, f"{layout}.state"), os.path.join(work, f"{layout}.hf.json")
    _run(layout, "resume_save", files, resume_at, index=index, state=ours_state)
    _run(layout, "resume_hf_save", files, resume_at, state=hf_state)
    res = {"ours": [], "hf": []}
    for _ in range(repeat):
        res["ours"].append(_run(layout, "resume_ours", files, 0, index=index, state=ours_state))
        res["hf"].append(_run(layout, "resume_hf", files, 0, state=hf_state))
    out["resume"] = {k: {m: _median(v, m) for m in ("first_s", "bytes", "rchar")} for k, v in res.items()}
    return out


def report_layout(layout: str, r: dict) -> None:
    rd = r["readers"]
    print(f"  {layout}: {r['files']} files, {r['bytes'] / 1e6:.0f} MB", flush=True)
    for name, x in rd.items():
        print(f"    {name:13s} {_fmt(x['rows_s'], ',.0f'):>9} rows/s  {_fmt(x['cpu_ms_per_krows'], '.0f'):>5} CPU ms "
              f"/ 1k rows  first sample {_fmt(x['first_s'], '.2f')} s (runs "
              + "/".join(_fmt(v, ".2f") for v in x["runs_first_s"]) + ")"
              + (f", {x['bytes'] / 1e6:.0f} MB read" if x.get("bytes") else ""), flush=True)
    lim = rd.get("limit", {})
    for name in ("ours", "ours_indexed"):          # (the index built in the process, or read from a saved one)
        ours, parts = rd.get(name, {}), []
        if not ours.get("rows_s"):
            continue
        if lim.get("rows_s"):
            parts.append(f"{name} / limit {ours['rows_s'] / lim['rows_s']:.2f}x (per CPU-s "
                         f"{lim['cpu_ms_per_krows'] / ours['cpu_ms_per_krows']:.2f}x)")
        for peer in ("hf_shuffled", "hf_plain"):
            if rd.get(peer, {}).get("rows_s"):
                parts.append(f"{name} / {peer} {ours['rows_s'] / rd[peer]['rows_s']:.2f}x")
        print("    " + ", ".join(parts), flush=True)
    rs = r["resume"]
    print(f"    resume: ours shuffled {_fmt(rs['ours']['first_s'], '.2f')} s ({(rs['ours']['bytes'] or 0) / 1e6:.1f} MB "
          f"read by us, rchar {(rs['ours']['rchar'] or 0) / 1e6:.1f} MB) vs HF unshuffled "
          f"{_fmt(rs['hf']['first_s'], '.2f')} s (rchar {(rs['hf']['rchar'] or 0) / 1e6:.1f} MB)", flush=True)


def _print_trace(layout: str, reader: str, res: dict, requests: list) -> None:
    """``--trace``: each request of a remote run (when the server read it, from the reader's start; its range and
    bytes), when each 10,000th row came, and the prefetcher's counters."""
    t0 = res.get("t0_monotonic")
    print(f"    trace {layout} {reader}: first sample {res.get('first_s', 0):.2f} s, rows every 10,000 at "
          f"{res.get('rows_at_s')} s", flush=True)
    for r in requests:
        at = f"{r.at - t0:6.2f} s" if t0 is not None else "      "
        print(f"      {at} {r.method} {r.path.rsplit('/', 1)[-1]} {r.range or ''} {r.bytes_sent / 1e6:.1f} MB", flush=True)
    if res.get("prefetch"):
        print(f"      prefetch {res['prefetch']}", flush=True)


def bench_remote(layout: str, files: list[str], rows: int, repeat: int, work: str, latency: float,
                 readers: tuple[str, ...], trace: bool = False) -> dict:
    from http_server import FileServer

    directory = os.path.dirname(files[0])
    out: dict = {"latency_s": latency, "readers": {}}
    with FileServer(directory) as srv:
        srv.latency_s = latency
        urls = [srv.url(os.path.basename(f)) for f in files]
        index = os.path.join(work, f"{layout}.remote.index.json")
        srv.reset_stats()
        _build_index(layout, urls, index)
        out["index_bytes_served"] = srv.stats()["bytes_sent"]
        runs: dict[str, list[dict]] = {r: [] for r in readers}
        for _ in range(repeat):
            for reader in readers:
                srv.reset_stats()
                res = _run(layout, reader, urls, rows, index=index, trace=trace)
                st = srv.stats()
                res["requests"], res["served"] = st["requests"], st["bytes_sent"]
                if trace:
                    _print_trace(layout, reader, res, list(srv.requests))
                runs[reader].append(res)
        for reader, rs in runs.items():
            out["readers"][reader] = {k: _median(rs, k) for k in ("rows_s", "first_s", "requests", "served", "bytes")}
            out["readers"][reader]["runs_first_s"] = [r.get("first_s") for r in rs]
            out["readers"][reader]["runs_rows_s"] = [r.get("rows_s") for r in rs]
    return out


def report_remote(layout: str, r: dict, file_bytes: int) -> None:
    print(f"  {layout} over {r['latency_s'] * 1000:.0f} ms (files {file_bytes / 1e6:.0f} MB; building the index "
          f"served {r['index_bytes_served'] / 1e6:.0f} MB)", flush=True)
    rd = r["readers"]
    for name, x in rd.items():
        print(f"    {name:13s} {_fmt(x['rows_s'], ',.0f'):>9} rows/s  first sample {_fmt(x['first_s'], '.2f')} s "
              f"(runs " + "/".join(_fmt(v, ".2f") for v in x["runs_first_s"]) + f")  {x['requests']:.0f} requests, "
              f"{(x['served'] or 0) / 1e6:.0f} MB served", flush=True)
    for name in ("ours", "ours_indexed"):
        ours = rd.get(name, {})
        for peer in ("hf_shuffled", "hf_plain", "net_limit"):
            if ours.get("rows_s") and rd.get(peer, {}).get("rows_s"):
                print(f"    {name} / {peer} {ours['rows_s'] / rd[peer]['rows_s']:.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="12,000 rows, 1 repeat")
    p.add_argument("--rows", type=int, default=60000)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--row-group", type=int, default=None, help="parquet rows per row group (default: a file's)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--resume-at", type=int, default=25000)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--readers", default="ours,ours_indexed,hf_plain,hf_shuffled,limit")
    p.add_argument("--remote-readers", default="ours,ours_indexed,hf_plain,hf_shuffled,net_limit")
    p.add_argument("--no-remote", action="store_true")
    p.add_argument("--no-local", action="store_true")
    p.add_argument("--latency", type=float, default=0.1)
    p.add_argument("--json", default=None)
    p.add_argument("--trace", action="store_true", help="remote: print each run's requests, rows over time and "
                   "the prefetcher's counters")
    p.add_argument("--data-dir", default=_common.DEFAULT_DATA_DIR)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    p.add_argument("--index", default=None, help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.reader = args.child
        _child(args)
        return
    if args.quick:
        args.rows, args.repeat, args.resume_at = 12000, 1, 5000
    files = corpus(args.data_dir, args.rows, args.files, args.row_group)
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    out: dict = {"rows": args.rows, "buffer": BUFFER, "repeat": args.repeat, "load_start": os.getloadavg(),
                 "local": {}, "remote": {}}
    work = tempfile.mkdtemp(prefix="rs-bench-corpora-")
    try:
        for layout in ([] if args.no_local else args.layouts.split(",")):
            r = out["local"][layout] = bench_layout(layout, files[layout], args.rows, args.repeat, args.resume_at,
                                                    work, tuple(args.readers.split(",")))
            report_layout(layout, r)
        if not args.no_remote:
            for layout in args.layouts.split(","):
                r = out["remote"][layout] = bench_remote(layout, files[layout], args.rows, args.repeat, work,
                                                         args.latency, tuple(args.remote_readers.split(",")),
                                                         args.trace)
                report_remote(layout, r, sum(os.path.getsize(f) for f in files[layout]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_end"] = os.getloadavg()
    print(f"load average at end: {out['load_end']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
