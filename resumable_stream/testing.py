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


def write_parquet_dataset(directory: str, rows: int, files: int, row_group_size: int, words: int = 8,
                          prefix: str = "part") -> list[str]:
    """``rows`` rows over ``files`` parquet files with row groups of ``row_group_size`` rows."""
    os.makedirs(directory, exist_ok=True)
    paths, start = [], 0
    for f in range(files):
        count = rows // files + (1 if f < rows % files else 0)
        table = pa.table(synthetic_rows(start, count, words))
        path = os.path.join(directory, f"{prefix}-{f:05d}.parquet")
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
        start += count
    return paths


def write_jsonl_dataset(directory: str, rows: int, files: int, words: int = 8) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths, start = [], 0
    for f in range(files):
        count = rows // files + (1 if f < rows % files else 0)
        cols = synthetic_rows(start, count, words)
        path = os.path.join(directory, f"part-{f:05d}.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for i in range(count):
                fh.write(json.dumps({k: v[i] for k, v in cols.items()}) + "\n")
        paths.append(path)
        start += count
    return paths
