"""The rows of a table a source's ``read`` yielded, when its columns are not the rows'.

A JSON-lines source hands on the lines of a piece (``jsonl_rows``: a lines table), each made into a row only as it
is used; every other source's table has the dataset's columns. Whoever makes rows of a source's tables asks here
first: ``table_rows`` (all the rows at once: LLaMA-Factory's held-out rows), or ``item_maker`` (the partition
reader: a window of such tables keeps numbers, and makes each row as it hands it out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

_LINES = "__json_line__"


def is_items(schema: pa.Schema) -> bool:
    """Whether a table of this schema holds items to be made into rows (not the rows' columns)."""
    if not schema.names or schema.names[0] != _LINES:
        return False
    from .jsonl_rows import is_lines

    return is_lines(schema)


def table_rows(table: pa.Table) -> list[dict] | None:
    """The rows of ``table`` when it is not a plain table of the dataset's columns; None for a plain one."""
    if not is_items(table.schema):
        return None
    from .jsonl_rows import rows_of_lines

    return rows_of_lines(table)


def item_maker(schema: pa.Schema, sizes: list[int], table_of: Callable[[int], pa.Table]) -> Callable[[Any], dict]:
    """For tables of ``schema`` that hold items, of ``sizes`` rows: the function making the row of item
    ``sum(sizes[:k]) + j`` (row ``j`` of table ``table_of(k)``), as it is handed out. Anything but such a number is
    handed back as it is (a row made already)."""
    from .jsonl_rows import items_maker

    return items_maker(schema, sizes, table_of)
