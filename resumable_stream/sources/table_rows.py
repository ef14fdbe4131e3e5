"""The rows of a table a source's ``read`` yielded, when its columns are not the rows' (``table_rows``).

A JSON-lines source hands on the lines of a piece (``jsonl_rows``: a lines table), made into rows only as they are
used; every other source's table has the dataset's columns. Whoever makes rows of a source's tables (the partition
reader, LLaMA-Factory's held-out rows) asks ``table_rows`` first.
"""

from __future__ import annotations

import pyarrow as pa


def table_rows(table: pa.Table) -> list[dict] | None:
    """The rows of ``table`` when it is not a plain table of the dataset's columns; None for a plain one."""
    names = table.schema.names
    if names and names[0] == "__json_line__":
        from .jsonl_rows import is_lines, rows_of_lines

        if is_lines(table.schema):
            return rows_of_lines(table)
    return None
