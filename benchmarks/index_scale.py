#!/usr/bin/env python
"""The dataset index at corpus scale: synthetic indexes of 10k / 100k / 1M parquet files (10 row groups
each), built in memory without I/O, and what they cost each rank of 8 to 4,096 simulated ranks.

Per file count, each part in a fresh process (no heap of the others around):

* ``index``: the bytes rank 0 broadcasts to every other rank (the message ``open_job_source`` sends), the
  memory a rank holds for the index once it has decoded that message (tracemalloc), and once it has opened
  its source from it (plus the shard list and the dataset fingerprint the source keeps; the peak is over
  both), the decode time, the checkpoint's index file in both forms (packed: what a checkpoint writes; JSON:
  what it wrote before and ``data.index_path`` holds; bytes, encode and decode time), the dataset
  fingerprint's JSON size, and the fingerprint check of a resume: the same files (as a state saves them),
  a state that lists every file (written before), and one changed file named;
* ``plan``: the plan's time for one epoch at 8 ... 4,096 partitions (one per simulated rank): the
  layout a rank builds from the source plus the first ``shards_for`` of an epoch (the whole deal),
  for a fresh epoch each time (the plan of an epoch is computed once per process);
* ``state``: ``state_dict`` / save (``write_sidecar`` + manifest) / load (``load_sidecar``) of one process
  that holds all 8 ... 4,096 partitions, and the elastic merge: rank 0 of 8 ranks loading that state
  (its partitions out of a state saved at another size).

    .venv/bin/python benchmarks/index_scale.py [--files 10000,100000,1000000] [--ranks 8,64,512,4096]
                                               [--json out.json]

Times are CPU seconds of the measuring process (``time.process_time``): on a shared machine wall time
measures the neighbours.

The same script runs against an older checkout (``PYTHONPATH=/path/to/old`` before the command) for before /
after figures: where the older library has no binary message it measures the JSON one it sent.
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
import tracemalloc

import _common  # noqa: F401  (sets HF_DATASETS_CACHE before datasets is imported)

ROW_GROUPS = 10
ROWS_PER_GROUP = 1000
FILES = (10_000, 100_000, 1_000_000)
RANKS = (8, 64, 512, 4096)
PARTS = ("index", "plan", "state")
# CPU seconds of this process: on a shared machine wall time measures the neighbours
clock = time.process_time


def synthetic_index(files: int, row_groups: int = ROW_GROUPS) -> dict:
    """A parquet dataset index of ``files`` files of ``row_groups`` row groups, as ``build_index`` makes one
    for local files (path, size, mtime, footer digest and length, [rows, start, end] per row group)."""
    from resumable_stream.testing import synthetic_parquet_index

    return synthetic_parquet_index(files, row_groups, ROWS_PER_GROUP)


def config(files: int, partitions: int):
    from resumable_stream import StreamConfig

    return StreamConfig(dataset_name_or_path="parquet", data_files="/corpus/*.parquet", shuffle=True,
                        buffer_size=1024, num_partitions=partitions, elastic=True,
                        prefetch_blocks=0)


def broadcast(index: dict) -> bytes:
    """The message rank 0 sends every other rank for this one index."""
    from resumable_stream.dataset import index_message

    if hasattr(index_message, "encode_message"):
        return index_message.encode_message([{"index": index, "footers": {}}], {})
    return json.dumps({"sources": [{"index": index, "footers": {}}], "agree": {}}).encode()    # before: JSON


def received(message: bytes) -> dict:
    from resumable_stream.dataset import index_message

    if hasattr(index_message, "decode_message"):
        return index_message.decode_message(message)["sources"][0]["index"]
    from resumable_stream.sources.index import decode_index

    return decode_index(json.dumps(json.loads(message)["sources"][0]["index"]).encode(), "x")


def fingerprint_checks(source) -> dict:
    """CPU seconds of the resume's fingerprint check: the same files, a state that lists them (written before the
    compact fingerprint), one file changed (named); absent where the library has no compact fingerprint."""
    try:
        from resumable_stream.sources.fingerprint_files import compact, expanded
        from resumable_stream.sources.index_table import FileTable
    except ImportError:
        return {}
    from resumable_stream.errors import StreamMismatchError
    from resumable_stream.state.checks import check_fingerprint

    fp = source.fingerprint
    out = {}
    t0 = clock()
    check_fingerprint(json.loads(json.dumps(fp)), fp, "x")
    out["check_same_s"] = round(clock() - t0, 4)
    listed = expanded(fp)
    t0 = clock()
    check_fingerprint(listed, fp, "x")
    out["check_listed_s"] = round(clock() - t0, 3)
    del listed
    arrays = source.index["files"].arrays()
    arrays["mtime"] = arrays["mtime"].copy()
    arrays["mtime"][len(arrays["mtime"]) // 2] += 1
    changed = FileTable(arrays)
    t0 = clock()
    try:
        check_fingerprint({**fp, "files": compact(changed)}, fp, "x")
    except StreamMismatchError as e:
        assert len(e.differences) == 1 and "(mtime)" in e.differences[0][0], e.differences
    out["check_one_changed_s"] = round(clock() - t0, 3)
    return out


def index_part(files: int) -> dict:
    from resumable_stream.sources import open_source
    from resumable_stream.sources.index import decode_index, encode_index, encode_message

    index = synthetic_index(files)
    t0 = clock()
    message = broadcast(index)
    encode_s = clock() - t0
    del index
    cfg = config(files, 8)
    tracemalloc.start()
    t0 = clock()
    index = received(message)
    decode_s = clock() - t0
    held_index = tracemalloc.get_traced_memory()[0]
    t0 = clock()
    source = open_source(cfg.source_spec, index=index)
    open_s = clock() - t0
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    forms = {}
    for form, encode in (("packed", encode_message), ("json", encode_index)):
        t0 = clock()
        saved = encode(source.index)
        save_s = clock() - t0
        t0 = clock()
        decode_index(saved, "'index'")
        forms[form] = (len(saved), round(save_s, 3), round(clock() - t0, 3))
        del saved
    fingerprint_bytes = len(json.dumps(source.fingerprint, sort_keys=True, separators=(",", ":"),
                                       default=lambda v: list(v)))
    checks = fingerprint_checks(source)
    row = {"files": files, "row_groups": files * ROW_GROUPS, "broadcast_bytes": len(message),
           "broadcast_encode_s": round(encode_s, 3), "decode_s": round(decode_s, 3), "open_source_s": round(open_s, 3),
           "index_memory_mb": round(held_index / 1e6, 1), "rank_memory_mb": round(held / 1e6, 1), "peak_memory_mb": round(peak / 1e6, 1),
           "fingerprint_json_bytes": fingerprint_bytes, **checks}
    for form, (size, save_s, load_s) in forms.items():
        row.update({f"checkpoint_index_{form}_bytes": size, f"checkpoint_index_{form}_encode_s": save_s,
                    f"checkpoint_index_{form}_decode_s": load_s})
    print(f"  {files:>9,} files: broadcast {len(message) / 1e6:8.1f} MB (encode {encode_s:6.2f} s, decode "
          f"{decode_s:6.2f} s), per rank: index {held_index / 1e6:8.1f} MB, with the source {held / 1e6:8.1f} MB (peak {peak / 1e6:8.1f} MB, open "
          f"{open_s:6.2f} s); fingerprint {fingerprint_bytes / 1e3:8.1f} KB; checkpoint index file "
          + ", ".join(f"{form} {size / 1e6:8.1f} MB (write {w:6.2f} s, read {r:6.2f} s)"
                      for form, (size, w, r) in forms.items())
          + "".join(f"; {k} {v}" for k, v in checks.items()), flush=True)
    return row


def plan_part(files: int, ranks_list) -> list[dict]:
    from resumable_stream import ResumableStream
    from resumable_stream.sources import open_source

    source = open_source(config(files, 8).source_spec, index=synthetic_index(files))
    rows = []
    for epoch, ranks in enumerate(ranks_list):
        t0 = clock()
        stream = ResumableStream(config(files, ranks), rank=0, world_size=ranks, source=source)
        layout_s = clock() - t0
        t0 = clock()
        shards = stream.layout.shards_for(epoch + 1, 0)     # a fresh epoch: the whole deal
        deal_s = clock() - t0
        t0 = clock()
        for p in range(0, ranks, max(1, ranks // 64)):      # the other partitions of that epoch: cached
            stream.layout.shards_for(epoch + 1, p)
        again_s = clock() - t0
        rows.append({"files": files, "ranks": ranks, "stream_open_s": round(layout_s, 3), "plan_epoch_s": round(deal_s, 3),
                     "shards_of_partition_0": len(shards), "later_partitions_s": round(again_s, 4)})
        print(f"  {files:>9,} files x {ranks:>5} ranks: stream open {layout_s:6.2f} s, plan of an epoch "
              f"{deal_s:6.2f} s ({len(shards)} shards in partition 0)", flush=True)
    return rows


def rows_without_files(source) -> None:
    """Make ``source`` (an indexed parquet source over files that do not exist) give each row group's rows made
    up (an ``id`` column): a state needs the next sample of every partition, the benchmark no I/O."""
    import pyarrow as pa

    shards = source.shards

    def fetch(shard: int) -> pa.Table:
        start = shard * 2048
        return pa.table({"id": pa.array(range(start, start + shards[shard].num_rows), pa.int64())})

    source._fetch_row_group = fetch


def state_part(files: int, ranks_list) -> list[dict]:
    from resumable_stream import ResumableStream
    from resumable_stream.sources import open_source

    source = open_source(config(files, 8).source_spec, index=synthetic_index(files))
    rows_without_files(source)
    rows = []
    for ranks in ranks_list:
        out = tempfile.mkdtemp(prefix="rs-index-scale-")
        stream = ResumableStream(config(files, ranks), rank=0, world_size=1, source=source)
        t0 = clock()
        stream.state_dict()                 # the first: builds every partition's window
        first_s = clock() - t0
        t0 = clock()
        state = stream.state_dict()
        state_s = clock() - t0
        t0 = clock()
        stream.write_sidecar(os.path.join(out, "stream_state"), state, manifest=True)
        save_s = clock() - t0
        again = ResumableStream(config(files, ranks), rank=0, world_size=1, source=source)
        t0 = clock()
        again.load_sidecar(out)
        load_s = clock() - t0
        merged = ResumableStream(config(files, ranks), rank=0, world_size=8, source=source)
        t0 = clock()
        merged.load_sidecar(out)
        merge_s = clock() - t0
        state_dir = os.path.join(out, "stream_state")
        sizes = {f: os.path.getsize(os.path.join(state_dir, f)) for f in os.listdir(state_dir)}
        rows.append({"files": files, "ranks": ranks, "first_state_dict_s": round(first_s, 3),
                     "state_dict_ms": round(1000 * state_s, 2),
                     "save_s": round(save_s, 3), "load_s": round(load_s, 3), "elastic_merge_s": round(merge_s, 3),
                     "stream_state_bytes": sum(sizes.values()), "files_bytes": sizes})
        print(f"  {files:>9,} files x {ranks:>5} partitions: state_dict {1000 * state_s:8.1f} ms (the first "
              f"{first_s:6.2f} s), save "
              f"{save_s:6.2f} s, load {load_s:6.2f} s, elastic merge (-> 8 ranks) {merge_s:6.2f} s, stream_state "
              f"{sum(sizes.values()) / 1e6:8.1f} MB", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", default=",".join(map(str, FILES)))
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)))
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)   # one part, in this process
    args = ap.parse_args()
    _common.quiet_logs()
    files_list = [int(x) for x in args.files.split(",")]
    ranks_list = [int(x) for x in args.ranks.split(",")]
    if args.part:
        (files,) = files_list
        result = (index_part(files) if args.part == "index" else
                  plan_part(files, ranks_list) if args.part == "plan" else state_part(files, ranks_list))
        print("RESULT " + json.dumps(result), flush=True)
        return
    import resumable_stream

    print(f"resumable_stream from {os.path.dirname(resumable_stream.__file__)}; python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; {ROW_GROUPS} row groups per file")
    results: dict[str, list] = {part: [] for part in PARTS}
    for part in PARTS:
        print(f"{part}:", flush=True)
        for files in files_list:
            cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--files", str(files),
                   "--ranks", args.ranks]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            print("\n".join(line for line in out.splitlines() if not line.startswith("RESULT ")), flush=True)
            found = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            results[part] += found if isinstance(found, list) else [found]
            print(f"    ({time.perf_counter() - t0:.0f} s wall in all)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "library": os.path.dirname(resumable_stream.__file__)}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
