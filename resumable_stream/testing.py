"""Small generated datasets for the demo, the tests and the benchmarks (no network needed)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_WORDS = ("stream resume shard window cursor epoch rank worker sample token batch model data order seed "
          "buffer block parquet arrow train loss step").split()


def synthetic_rows(start: int, count: int, words: int = 8) -> dict[str, list]:
    """Rows ``start .. start+count-1``: a unique ``id``, a short deterministic ``text`` and a ``label``."""
    ids = np.arange(start, start + count, dtype=np.int64)
    picks = (ids[:, None] * 2654435761 + np.arange(words)[None, :] * 40503) % len(_WORDS)
    text = [f"row {i}: " + " ".join(_WORDS[j] for j in row) for i, row in zip(ids.tolist(), picks.tolist())]
    return {"id": ids.tolist(), "text": text, "label": (ids % 7).tolist()}


def _file_rows(rows: int, files: int) -> list[tuple[int, int]]:
    """(first row, rows) of each of ``files`` files sharing ``rows`` rows, the first ones a row more."""
    counts = [rows // files + (1 if f < rows % files else 0) for f in range(files)]
    return [(sum(counts[:f]), n) for f, n in enumerate(counts)]


def write_parquet_dataset(directory: str, rows: int, files: int, row_group_size: int, words: int = 8,
                          prefix: str = "part") -> list[str]:
    """``rows`` rows over ``files`` parquet files with row groups of ``row_group_size`` rows."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{prefix}-{f:05d}.parquet") for f in range(files)]
    for path, (start, count) in zip(paths, _file_rows(rows, files)):
        pq.write_table(pa.table(synthetic_rows(start, count, words)), path, row_group_size=row_group_size)
    return paths


def write_jsonl_dataset(directory: str, rows: int, files: int, words: int = 8) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"part-{f:05d}.jsonl") for f in range(files)]
    for path, (start, count) in zip(paths, _file_rows(rows, files)):
        cols = synthetic_rows(start, count, words)
        with open(path, "w", encoding="utf-8") as fh:
            for i in range(count):
                fh.write(json.dumps({k: v[i] for k, v in cols.items()}) + "\n")
    return paths


def synthetic_parquet_index(files: int, row_groups: int, rows: int, root: str = "/corpus") -> dict:
    """A parquet dataset index of ``files`` files of ``row_groups`` row groups of about ``rows`` rows each, as
    ``build_index`` makes one for local files, made without any file (the index benchmark and its tests).
    The files do not exist: a stream over it plans, saves and loads states, but reads no row."""
    group_bytes = 40 * rows
    entries = []
    for f in range(files):
        spans, start = [], 4
        for g in range(row_groups):
            n = rows + (f * 7 + g * 3) % 64        # uneven row counts: the deal balances rows, not shards
            spans.append([n, start, start + group_bytes])
            start += group_bytes
        entries.append({"path": f"{root}/part-{f:07d}.parquet", "size": start + 2000, "mtime": 1.7e9 + f / 8,
                        "footer": f"{f:032x}", "footer_bytes": 1990, "row_groups": spans})
    return {"format": "resumable-stream-index", "version": 1,
            "resolution": {"dataset_name_or_path": "parquet", "name": None, "data_files": f"{root}/*.parquet",
                           "split": "train"},
            "builder": "parquet", "features": {"id": {"dtype": "int64", "_type": "Value"}}, "files": entries,
            "reader": "parquet"}
