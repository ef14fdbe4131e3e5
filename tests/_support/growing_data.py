"""Small parquet datasets that grow, shared by the growth and follow tests."""

import os

import pyarrow as pa
import pyarrow.parquet as pq

from resumable_stream.testing import synthetic_rows, write_parquet_dataset

ROWS, FILES, RG = 400, 4, 25


def dataset(tmp_path) -> str:
    """ROWS rows (ids 0..ROWS-1) in FILES files of row groups of RG."""
    d = str(tmp_path / "data")
    write_parquet_dataset(d, rows=ROWS, files=FILES, row_group_size=RG)
    return d


def add(d: str, name: str, start: int, count: int = 100) -> list[int]:
    """A new file ``name``.parquet in ``d`` with ids ``start`` .. ``start + count - 1``; those ids."""
    pq.write_table(pa.table(synthetic_rows(start, count)), os.path.join(d, f"{name}.parquet"), row_group_size=RG)
    return list(range(start, start + count))
