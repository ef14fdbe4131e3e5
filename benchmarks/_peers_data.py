"""The data of benchmarks/peers.py: one generated dataset, written as parquet (ours, HF), litdata and MDS.

The rows are those of ``resumable_stream.testing`` (``id``, ``text``, ``label``) with ``words`` words of
text: 44 words make ~300 bytes a row (int64 id + label + ~284 bytes of text). The parquet files are written
first (``write_parquet_dataset``); the litdata chunks (``litdata.optimize``) and the MDS shards
(``streaming.MDSWriter``) are written from those files, file by file in order, so all three hold the same rows.
Each directory is generated once under ``.bench/`` (keyed by its parameters) and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

WORDS = 44                 # ~300 bytes per row
SHARD_BYTES = 1 << 26      # litdata chunk_bytes / MDS size_limit: MDSWriter's default (64 MiB), litdata's "64MB"
FILE_CHUNK_BYTES = 20_000_000   # litdata chunks of ~1 parquet file each (1M rows in 16 files: ~20 MB a file)


def _complete(path: str) -> bool:
    return os.path.exists(os.path.join(path, "COMPLETE"))


def _finish(tmp: str, path: str, meta: dict, t0: float) -> str:
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    print(f"    written in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def parquet_dir(data_dir: str, rows: int, files: int, row_group_size: int, words: int = WORDS) -> str:
    name = f"peers-parquet-{rows}r-{files}f-{row_group_size}rg-{words}w"
    path = os.path.join(data_dir, name)
    if _complete(path):
        return path
    from resumable_stream.testing import write_parquet_dataset

    os.makedirs(data_dir, exist_ok=True)
    t0 = time.perf_counter()
    print(f"  generating {rows:,} rows ({words} words of text) in {files} parquet files -> {path}", flush=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=data_dir)
    write_parquet_dataset(tmp, rows=rows, files=files, row_group_size=row_group_size, words=words)
    return _finish(tmp, path, {"rows": rows, "files": files, "row_group_size": row_group_size, "words": words}, t0)


def parquet_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))


def rows_of_file(path: str):
    """litdata.optimize's fn: the rows of one parquet file, in order (module level: its workers import it)."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def litdata_dir(data_dir: str, parquet: str, shard_bytes: int = SHARD_BYTES) -> str:
    path = os.path.join(data_dir, os.path.basename(parquet).replace("peers-parquet-", "peers-litdata-")
                        + f"-{shard_bytes}b")
    if _complete(path):
        return path
    import litdata

    t0 = time.perf_counter()
    print(f"  writing litdata chunks (litdata.optimize, chunk_bytes {shard_bytes:,}) -> {path}", flush=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=data_dir)
    out = os.path.join(tmp, "data")
    # one worker, files in their order: the chunks hold the rows in the parquet order
    litdata.optimize(fn=rows_of_file, inputs=parquet_files(parquet), output_dir=out, chunk_bytes=shard_bytes,
                     num_workers=1, reorder_files=False, keep_data_ordered=True, verbose=False)
    for f in os.listdir(out):
        os.replace(os.path.join(out, f), os.path.join(tmp, f))
    os.rmdir(out)
    return _finish(tmp, path, {"from": parquet, "chunk_bytes": shard_bytes}, t0)


def mds_dir(data_dir: str, parquet: str, shard_bytes: int = SHARD_BYTES) -> str:
    path = os.path.join(data_dir, os.path.basename(parquet).replace("peers-parquet-", "peers-mds-")
                        + f"-{shard_bytes}b")
    if _complete(path):
        return path
    import _peers_compat
    import pyarrow.parquet as pq

    _peers_compat.stub_torchvision()
    from streaming import MDSWriter

    t0 = time.perf_counter()
    print(f"  writing MDS shards (MDSWriter, size_limit {shard_bytes:,}) -> {path}", flush=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=data_dir)
    out = os.path.join(tmp, "data")
    with MDSWriter(out=out, columns={"id": "int64", "text": "str", "label": "int64"}, size_limit=shard_bytes) as w:
        for f in parquet_files(parquet):
            for batch in pq.ParquetFile(f).iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    w.write(row)
    for f in os.listdir(out):
        os.replace(os.path.join(out, f), os.path.join(tmp, f))
    os.rmdir(out)
    return _finish(tmp, path, {"from": parquet, "size_limit": shard_bytes}, t0)


def shard_count(path: str, kind: str) -> int:
    """Files (parquet), chunks (litdata) or shards (MDS) of a written dataset."""
    if kind == "parquet":
        return len(parquet_files(path))
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    return len(index["chunks"] if kind == "litdata" else index["shards"])
