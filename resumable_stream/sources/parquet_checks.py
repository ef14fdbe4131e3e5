"""Does a decoded parquet row group agree with what its file's footer says about it?

Bytes of the right length can still be the wrong bytes (a proxy answering with another range, an object
rewritten between two reads): before a row group becomes rows it is checked against the footer the index vouches
for, its row count and per column chunk the statistics (null count, min, max): exactly where they are exact
(numbers, booleans, times; byte arrays written by Arrow), as bounds elsewhere (writers may truncate strings).
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# created_by of the writers whose byte-array statistics are the exact min / max (parquet-cpp never truncates)
_EXACT_WRITERS = ("parquet-cpp",)


def leaves(table: pa.Table) -> list[tuple[pa.Array, bool]]:
    """(values, nested) per parquet leaf column, in the footer's column order; ``nested``: under a list or
    map (its null count counts levels, not values, so only min / max compare)."""
    out: list[tuple[pa.Array, bool]] = []
    for column in table.columns:
        _walk(column.chunk(0) if column.num_chunks == 1 else column.combine_chunks(), False, out)
    return out


def _walk(arr: pa.Array, nested: bool, out: list) -> None:
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_struct(t):
        for child in arr.flatten():        # the struct's own nulls merged into its fields
            _walk(child, nested, out)
    elif pa.types.is_map(t):
        _walk(arr.keys, True, out)
        _walk(arr.items, True, out)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        _walk(arr.flatten(), True, out)
    else:
        out.append((arr, nested))


def _comparable(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    if isinstance(a, numbers) and isinstance(b, numbers):
        return True
    # datetimes: both naive or both aware (Python cannot order one against the other)
    return type(a) is type(b) and (getattr(a, "tzinfo", None) is None) == (getattr(b, "tzinfo", None) is None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def problem(table: pa.Table, metadata: pq.FileMetaData, group: int) -> str | None:
    """What in the decoded ``table`` of row group ``group`` contradicts the footer ``metadata`` (None: nothing)."""
    check = RunningCheck(metadata, group)
    if table.num_rows != check.rg.num_rows:
        return f"{table.num_rows} rows decoded, the footer says {check.rg.num_rows}"
    if any(column.num_chunks > 1 for column in table.columns):     # (decoded in batches) batch by batch, no copy
        for batch in table.to_batches():
            found = check.add(pa.Table.from_batches([batch]))
            if found is not None:
                return found
        return check.finish()
    return check.add(table) or check.finish()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RunningCheck:
    """:func:`problem` for a row group decoded batch by batch (a large one, whose first rows are handed on before
    its last are decoded): each batch is checked against the footer's bounds before it becomes rows (its values
    inside the stored min / max, the nulls so far at most the stored count), and the whole group exactly when its
    last batch was added (:meth:`finish`: the row count, the null counts, the exact min / max)."""

    def __init__(self, metadata: pq.FileMetaData, group: int):
        self.rg = metadata.row_group(group)
        self.exact_bytes = (metadata.created_by or "").startswith(_EXACT_WRITERS)
        self.rows = 0
        self._seen: list[list] | None = None       # per leaf: [nulls, low, high, nested] so far

    def add(self, table: pa.Table) -> str | None:
        """What in this batch contradicts the footer (None: nothing)."""
        rg = self.rg
        self.rows += table.num_rows
        if self.rows > rg.num_rows:
            return f"{self.rows} rows decoded so far, the footer says {rg.num_rows}"
        columns = leaves(table)
        if len(columns) != rg.num_columns:
            return None
        if self._seen is None:
            self._seen = [[0, None, None, nested] for _, nested in columns]
        for j, (values, nested) in enumerate(columns):
            stats = rg.column(j).statistics
            if stats is None:
                continue
            seen = self._seen[j]
            name = rg.column(j).path_in_schema
            seen[0] += values.null_count
            if stats.has_null_count and not nested and seen[0] > stats.null_count:
                return f"column {name!r}: {seen[0]} nulls decoded so far, the footer says {stats.null_count}"
            if not stats.has_min_max or len(values) == values.null_count:
                continue
            try:
                low, high = (x.as_py() for x in pc.min_max(values).values())
                saved_low, saved_high = stats.min, stats.max
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                continue
            if not (_comparable(low, saved_low) and _comparable(high, saved_high)):
                continue
            seen[1] = low if seen[1] is None else min(seen[1], low)
            seen[2] = high if seen[2] is None else max(seen[2], high)
            if not (saved_low <= low and high <= saved_high):
                return (f"column {name!r}: decoded values span {_short(low)} .. {_short(high)}, outside the footer's "
                        f"{_short(saved_low)} .. {_short(saved_high)}")
        return None

    def finish(self) -> str | None:
        """What in the whole group contradicts the footer, once every batch was added (None: nothing)."""
        rg = self.rg
        if self.rows != rg.num_rows:
            return f"{self.rows} rows decoded, the footer says {rg.num_rows}"
        for j, seen in enumerate(self._seen or []):
            stats = rg.column(j).statistics
            if stats is None:
                continue
            name = rg.column(j).path_in_schema
            if stats.has_null_count and not seen[3] and seen[0] != stats.null_count:
                return f"column {name!r}: {seen[0]} nulls decoded, the footer says {stats.null_count}"
            low, high = seen[1], seen[2]
            if low is None or not stats.has_min_max:
                continue
            exact = self.exact_bytes or not isinstance(low, (str, bytes, float))
            if exact and not (_same(low, stats.min) and _same(high, stats.max)):
                return (f"column {name!r}: decoded values span {_short(low)} .. {_short(high)}, the footer says "
                        f"{_short(stats.min)} .. {_short(stats.max)}")
        return None

