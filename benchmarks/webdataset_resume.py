#!/usr/bin/env python
"""Resuming inside a WebDataset tar: time to the first resumed sample and bytes read, ours vs datasets.

A ~200 MB tar (random-noise PNG + txt members) served by the loopback server (``tests/_support/http_server.py``) with
50 ms of latency per request. A stream positioned after ~80% of the tar resumes:

* ours: the tar index saved with the state (no resolving, no re-indexing), the window around the position
  fetched by ranged reads of its shards;
* today's path for tars, ``datasets``' webdataset builder streaming the tar, skipping to the same sample
  (``IterableDataset.skip``: it re-reads the tar's prefix).

Prints both and the ratios (datasets / ours). Indexing the tar once (one pass) is printed too.

    .venv/bin/python benchmarks/webdataset_resume.py [--mb 200] [--latency-ms 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
import tarfile
import tempfile
import time

import _common  # noqa: F401  (sets HF_DATASETS_CACHE before datasets is imported)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests", "_support"))

SIDE = 256                 # a 256x256 noise PNG is ~197 KB


def _write_tar(path: str, mb: int) -> int:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    n = 0
    with tarfile.open(path, "w") as tar:
        while os.path.getsize(path) < mb * 10**6 if os.path.exists(path) else True:
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(buf, format="PNG",
                                                                                       compress_level=1)
            for suffix, data in (("png", buf.getvalue()), ("txt", f"noise image {n}".encode())):
                info = tarfile.TarInfo(f"s{n:06d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            n += 1
            tar.fileobj.flush()
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--at", type=float, default=0.8, help="where in the tar the resume is (share of its samples)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import datasets
    from http_server import FileServer

    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.sources import open_source

    work = tempfile.mkdtemp(prefix="wds-bench-")
    n = _write_tar(os.path.join(work, "big.tar"), args.mb)
    size = os.path.getsize(os.path.join(work, "big.tar"))
    at = int(n * args.at)
    with FileServer(work) as srv:
        url = srv.url("big.tar")
        cfg = StreamConfig(dataset_name_or_path="webdataset", data_files=[url], buffer_size=256)
        srv.latency_s = args.latency_ms / 1000
        t0 = time.perf_counter()
        src = open_source(cfg.source_spec)
        index_s, index_bytes = time.perf_counter() - t0, srv.stats()["bytes_sent"]
        srv.latency_s = 0.0
        stream = ResumableStream(cfg, source=src)
        list(itertools.islice(stream, at))                 # position the stream (not timed)
        state = stream.state_dict()
        stream.close()

        srv.latency_s = args.latency_ms / 1000
        srv.reset_stats()
        t0 = time.perf_counter()
        resumed = ResumableStream(cfg, source=open_source(cfg.source_spec, index=src.index))
        resumed.load_state_dict(state)
        first = next(iter(resumed))
        ours_s, ours = time.perf_counter() - t0, srv.stats()
        resumed.close()

        srv.reset_stats()
        t0 = time.perf_counter()
        ds = datasets.load_dataset("webdataset", data_files=[url], split="train", streaming=True)
        theirs_first = next(iter(ds.skip(at)))
        theirs_s, theirs = time.perf_counter() - t0, srv.stats()
    assert first["__key__"] == theirs_first["__key__"] == f"s{at:06d}", (first["__key__"], theirs_first["__key__"])
    out = {
        "tar_mb": round(size / 1e6, 1), "samples": n, "resume_at": at, "latency_ms": args.latency_ms,
        "index_once_s": round(index_s, 2), "index_once_mb": round(index_bytes / 1e6, 1),
        "ours_first_sample_s": round(ours_s, 3), "ours_mb_read": round(ours["bytes_sent"] / 1e6, 2),
        "ours_requests": ours["requests"],
        "datasets_first_sample_s": round(theirs_s, 3), "datasets_mb_read": round(theirs["bytes_sent"] / 1e6, 2),
        "datasets_requests": theirs["requests"],
    }
    out["ratio_time"] = round(theirs_s / ours_s, 1)
    out["ratio_bytes"] = round(theirs["bytes_sent"] / max(1, ours["bytes_sent"]), 1)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
