"""JSON lines to rows, equal to ``datasets``' json builder's (``load_dataset("json", ..., streaming=True)``).

Two ways, picked once per dataset by its features:

* **Lines** (plain string / int64 / float64 / bool / null values, lists and structs of them): a piece is handed on
  as a **lines table** (``lines_table``: one row per line pointing into the piece's text, no copy); a row is made
  only when the stream hands it out (``rows_of_lines``: ``orjson.loads`` and ``Conformer``). A line that does not
  fit that simply is parsed alone the blocks way: the row, or a bad sample.
* **Blocks** (any other features): pyarrow's JSON reader on a block of lines, then ``datasets``' own
  ``Json._cast_table`` (``Blocks``).

Where the two ways differ from ``datasets`` (ISO-8601-looking text, a key given twice): docs/limitations.md.
"""

from __future__ import annotations

import bisect
import functools
import io
import json
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import BAD_SAMPLE_COLUMN, BAD_SAMPLE_OMIT_NULL, SourceError
from . import jsonl_index
from .parquet_local import cast_like_datasets

log = logging.getLogger(__name__)

LINE_COLUMN = "__json_line__"          # a row's text (its line, and the blank lines after it: JSON whitespace)
FILE_COLUMN = "__json_file__"          # the file it is in (dictionary-encoded: one name per piece)
ROW_COLUMN = "__json_row__"            # its row number in that file (named in a bad sample's reason)
_KIND = b"resumable_stream.json_lines"


def marker_field() -> pa.Field:
    return pa.field(BAD_SAMPLE_COLUMN, pa.string(), metadata=BAD_SAMPLE_OMIT_NULL)


# ------------------------------------------------------------------------------ the features, compiled
_INT64 = (-(1 << 63), (1 << 63) - 1)
_SCALARS = {"string": "str", "int64": "int", "float64": "float", "bool": "bool", "null": None}


def _fixer(feature: Any) -> Callable[[Any], tuple[bool, Any]] | None:
    """A function ``fix(value) -> (fits, value as the builder gives it)`` for a feature in the features' dict
    form; None for a feature the lines way does not make (the blocks way makes the dataset)."""
    if not isinstance(feature, dict):
        return None
    kind = feature.get("_type")
    if kind == "Value":
        dtype = feature.get("dtype")
        if dtype not in _SCALARS:
            return None
        return _scalar_fixer(dtype)
    if kind == "List":
        if feature.get("length", -1) != -1:
            return None
        item = _fixer(feature.get("feature"))
        if item is None:
            return None
        return _list_fixer(item)
    if kind is not None:
        return None
    fields = {}
    for name, sub in feature.items():
        fixer = _fixer(sub)
        if fixer is None or not isinstance(name, str):
            return None
        fields[name] = fixer
    return _struct_fixer(fields)


_FITS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: type(v) is str, "int64": lambda v: type(v) is int and _INT64[0] <= v <= _INT64[1],
    "bool": lambda v: type(v) is bool, "null": lambda v: False}


def _scalar_fixer(dtype: str) -> Callable[[Any], tuple[bool, Any]]:
    if dtype == "float64":
        def fix(v):
            if type(v) is float or v is None:
                return True, v
            return (True, float(v)) if type(v) is int else (False, v)
        return fix
    fits = _FITS[dtype]
    return lambda v: (v is None or fits(v), v)


def _list_fixer(item: Callable[[Any], tuple[bool, Any]]) -> Callable[[Any], tuple[bool, Any]]:
    def fix(v):
        if v is None:
            return True, None
        if type(v) is not list:
            return False, v
        out = []
        for x in v:
            ok, x = item(x)
            if not ok:
                return False, v
            out.append(x)
        return True, out
    return fix


def _struct_fixer(fields: dict[str, Callable]) -> Callable[[Any], tuple[bool, Any]]:
    names = set(fields)

    def fix(v):
        if v is None:
            return True, None
        if type(v) is not dict or not names.issuperset(v):
            return False, v
        out = {}
        for name, sub in fields.items():
            ok, x = sub(v.get(name))
            if not ok:
                return False, v
            out[name] = x
        return True, out
    return fix


@functools.cache
def has_orjson() -> bool:
    """Whether orjson (a native accelerator, declared in pyproject) can be imported: without it every dataset is
    read the blocks way (pyarrow's JSON reader, the builder's cast): the same rows, more CPU per row."""
    try:
        import orjson  # noqa: F401
    except ImportError:
        log.warning("orjson is not installed: JSON lines are parsed by pyarrow's JSON reader (the same rows, "
                    "slower); pip install orjson")
        return False
    return True


class Conformer:
    """Makes a row of a line: ``orjson.loads``, then the value brought to the row the json builder gives for it
    (``maker(slow)``: a function of one line; a line that does not fit simply goes to ``slow``). Made once per
    features: the checks of the top-level columns are one generated function (``{'id': int, 'text': str}``: the
    parse, two type checks and a key-order check per row)."""

    def __init__(self, features: dict):
        self.names = tuple(features)
        fixers = {name: _fixer(f) for name, f in features.items()}
        self.fast = bool(features) and all(f is not None for f in fixers.values()) and \
            all(type(n) is str for n in self.names) and has_orjson()
        self._factory = self._compile(features, fixers) if self.fast else None

    def maker(self, mvs: list, starts: list, ends: list, fill: Callable, slow: Callable) -> Callable[[Any], dict]:
        """The function making the row of item ``i`` (``items_maker``): its line ``mvs[i][starts[i]:ends[i]]``
        (``mvs[i]`` None: ``fill(i)`` fills its table's and returns it), parsed and brought to the builder's row; a
        line that does not fit simply goes to ``slow(i)``."""
        import orjson

        return self._factory(orjson.loads, orjson.JSONDecodeError, mvs, starts, ends, fill, slow)

    def _compile(self, features: dict, fixers: dict) -> Callable:
        # generated from the feature names (repr'd string literals) and fixed code only: no data goes in
        fail = "            return slow(i)"
        lines = ["def factory(loads, JSONDecodeError, mvs, starts, ends, fill, slow):",
                 "    def make(i):",
                 "        if type(i) is not int:",
                 "            return i",
                 "        m = mvs[i]",
                 "        if m is None:",
                 "            m = fill(i)",
                 "        try:",
                 "            d = loads(m[starts[i]:ends[i]])",
                 "        except JSONDecodeError:",
                 "            return slow(i)",
                 "        if type(d) is not dict:",
                 fail,
                 "        if tuple(d) != NAMES:",
                 "            if not NAMESET.issuperset(d):",
                 "                return slow(i)",
                 "            d = {key: d.get(key) for key in NAMES}"]
        env: dict[str, Any] = {"NAMES": self.names, "NAMESET": frozenset(self.names), "LO": _INT64[0],
                               "HI": _INT64[1], "float": float, "type": type, "tuple": tuple, "dict": dict,
                               "str": str, "int": int, "bool": bool, "list": list}
        for i, (name, feature) in enumerate(features.items()):
            key = repr(name)
            dtype = feature.get("dtype") if feature.get("_type") == "Value" else None
            lines.append(f"        v = d[{key}]")
            if dtype == "string":
                lines += ["        if type(v) is not str and v is not None:", fail]
            elif dtype == "int64":
                lines += ["        if type(v) is not int:", "            if v is not None:", "    " + fail,
                          "        elif not LO <= v <= HI:", fail]
            elif dtype == "float64":
                lines += ["        if type(v) is not float:", "            if type(v) is int:",
                          f"                d[{key}] = float(v)", "            elif v is not None:", "    " + fail]
            elif dtype == "bool":
                lines += ["        if type(v) is not bool and v is not None:", fail]
            elif dtype == "null":
                lines += ["        if v is not None:", fail]
            else:
                env[f"fix{i}"] = fixers[name]
                lines += [f"        ok, v = fix{i}(v)", "        if not ok:", fail, f"        d[{key}] = v"]
        lines += ["        return d", "    return make"]
        exec("\n".join(lines), {"__builtins__": {}, **env}, env)      # noqa: S102 - see above
        return env["factory"]


@functools.cache
def conformer(features_json: bytes) -> Conformer:
    return Conformer(json.loads(features_json))


# ------------------------------------------------------------------------------ lines tables (source side)
def is_lines(schema: pa.Schema) -> bool:
    """Whether a table of this schema is a lines table (its rows made by ``rows_of_lines``)."""
    return len(schema) == 3 and schema.names[0] == LINE_COLUMN and bool(schema.field(0).metadata) and \
        schema.field(0).metadata.get(_KIND) is not None


def lines_schema(features_json: bytes) -> pa.Schema:
    return pa.schema([pa.field(LINE_COLUMN, pa.large_binary(), metadata={_KIND: features_json}),
                      pa.field(FILE_COLUMN, pa.dictionary(pa.int32(), pa.string())),
                      pa.field(ROW_COLUMN, pa.int64())])


def row_starts(text: bytes, lo: int, rows: int) -> np.ndarray:
    """The byte offsets of the ``rows`` rows of ``text`` from ``lo`` (a row's start), and the text's end: a row
    is its line and the blank lines after it (JSON whitespace to orjson). None when the text does not hold that
    many rows."""
    # memchr by bytes.find, line by line: numpy's ``== 10`` over the text costs a temporary as large as the text
    # (fresh pages, each faulted in) and a two-pass nonzero, ~10x the time
    out = [lo]
    find, add = text.find, out.append
    pos = find(b"\n", lo)
    while pos >= 0:
        add(pos + 1)
        pos = find(b"\n", pos + 1)
    if out[-1] == len(text):
        out.pop()                                   # the last line's newline ends the text
    if len(out) == rows:                            # no blank line: every line is a row
        out.append(len(text))
        return np.array(out, dtype=np.int64)
    spans = jsonl_index.row_spans(text, lo)         # blank lines: found one by one (rare)
    if len(spans) != rows:
        return None
    out = np.empty(rows + 1, dtype=np.int64)
    out[:rows] = [a for a, _ in spans]
    out[rows] = len(text)
    if rows:
        out[0] = lo                                 # blank lines before the first row are JSON whitespace too
    return out


def lines_table(text: bytes, offsets: np.ndarray, path: str, first_row: int, features_json: bytes) -> pa.Table:
    """The rows of ``text`` at ``offsets`` (``row_starts``) as a lines table: the text itself is the buffer."""
    n = len(offsets) - 1
    data = pa.py_buffer(text)            # (the first offset may be past 0: what comes before is not a row's)
    lines = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(np.ascontiguousarray(offsets)), data])
    files = pa.DictionaryArray.from_arrays(pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(
        np.zeros(n, dtype=np.int32))]), pa.array([path], pa.string()))
    rows = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(np.arange(first_row, first_row + n,
                                                                                dtype=np.int64))])
    return pa.Table.from_arrays([lines, files, rows], schema=lines_schema(features_json))


# ------------------------------------------------------------------------------ rows (stream side)
# A row handed out is made then, from its line (a window keeps numbers, not rows: parsing a window's rows at once
# and keeping them costs twice the parse, in fresh memory touched; a view or a copy of each line kept instead is an
# object the garbage collector walks, or a copy). An item is a row's place in the tables one after another: table
# k's row j is ``bases[k] + j``. So a row's line is three list lookups by that one number (``mvs[i]``,
# ``starts[i]``, ``ends[i]``), filled table by table as a first row of each is made.
def items_maker(schema: pa.Schema, sizes: list[int], table_of: Callable[[int], pa.Table]) -> Callable[[Any], dict]:
    """The function making the row of an item (a number: above) of lines tables of ``schema`` of ``sizes`` rows
    (``table_of(k)``: the k-th, read when a row of it is first made), as the json builder gives it. Anything but
    a number is handed back as it is (a row already made)."""
    features_json = schema.field(0).metadata[_KIND]
    bases = [0]
    for n in sizes:
        bases.append(bases[-1] + n)
    total = bases[-1]
    mvs: list = [None] * total       # None: its table not filled yet
    starts: list = [0] * total
    ends: list = [0] * total

    def fill(i: int) -> memoryview:
        k = bisect.bisect_right(bases, i) - 1
        table = table_of(k)
        at = bases[k]
        if table.num_rows != bases[k + 1] - at:
            raise SourceError(f"a lines table of {table.num_rows} rows where {bases[k + 1] - at} were planned")
        for chunk in table.column(0).chunks:
            n = len(chunk)
            if n == 0:
                continue
            _, off_buf, data_buf = chunk.buffers()
            bounds = np.frombuffer(off_buf, dtype=np.int64, count=n + 1, offset=chunk.offset * 8).tolist()
            mvs[at:at + n] = [memoryview(data_buf) if data_buf is not None else memoryview(b"")] * n
            starts[at:at + n] = bounds[:-1]
            ends[at:at + n] = bounds[1:]
            at += n
        return mvs[i]

    def slow(i: int) -> dict:
        k = bisect.bisect_right(bases, i) - 1
        table, j = table_of(k), i - bases[k]
        return _row_alone(bytes(mvs[i][starts[i]:ends[i]]), table.column(1)[j].as_py(), table.column(2)[j].as_py(),
                          features_json)

    return conformer(features_json).maker(mvs, starts, ends, fill, slow)


def rows_of_lines(table: pa.Table) -> list[dict]:
    """The rows of a lines table, in its order, as the json builder gives them (a bad sample: every column None and
    ``__bad_sample__`` naming the file, the row and why)."""
    make = items_maker(table.schema, [table.num_rows], lambda _: table)
    return [make(j) for j in range(table.num_rows)]


def _row_alone(line: bytes, path: str, row: int, features_json: bytes) -> dict:
    """A line the lines way does not make: parsed as the json builder parses a block, on its own (the row, or a
    bad sample naming its file and row)."""
    made = _blocks(features_json).table(line, 0, 1, lambda _: f"data file {path!r}: row {row}")
    out = made.to_pylist()[0]
    if out.get(BAD_SAMPLE_COLUMN) is None:
        out.pop(BAD_SAMPLE_COLUMN, None)
    return out


@functools.cache
def _blocks(features_json: bytes) -> Blocks:
    return Blocks(json.loads(features_json))


# ------------------------------------------------------------------------------ blocks (pyarrow, as datasets)
class Blocks:
    """Blocks of lines to tables in the dataset's features, as ``datasets``' json builder makes them."""

    def __init__(self, features: dict):
        self._features_dict = features

    def __getstate__(self) -> dict:
        return {"_features_dict": self._features_dict}      # the rest made again where it is read

    @functools.cached_property
    def _features(self):
        import datasets

        return datasets.Features.from_dict(self._features_dict)

    @functools.cached_property
    def schema(self) -> pa.Schema:
        return self._features.arrow_schema

    @functools.cached_property
    def _json_paths(self) -> list:
        try:
            from datasets.utils.json import get_json_field_paths_from_feature
        except ImportError:          # a datasets without JSON fields (before 5.x)
            return []
        return list(get_json_field_paths_from_feature(self._features))

    def _encoded(self, block: bytes) -> bytes:
        """The block with its JSON fields encoded as strings, as the builder does before parsing."""
        from datasets.utils.json import json_encode_field, ujson_dumps, ujson_loads

        examples = [ujson_loads(line) for line in block.splitlines() if not jsonl_index.is_blank(line)]
        for path in self._json_paths:
            examples = [json_encode_field(example, path) for example in examples]
        return "\n".join(ujson_dumps(example) for example in examples).encode()

    def parse(self, block: bytes) -> pa.Table:
        """``block`` (whole lines) as a table in the features; raises on anything the builder would refuse."""
        import pyarrow.json as paj

        if self._json_paths:
            block = self._encoded(block)
        table = paj.read_json(io.BytesIO(block), read_options=paj.ReadOptions(
            use_threads=False, block_size=max(len(block) + 1, 1 << 16)))
        cast = cast_like_datasets(table, self.schema)
        if cast is not None:
            return cast
        return self._cast(table)

    def _cast(self, table: pa.Table) -> pa.Table:
        """The builder's own ``_cast_table`` (missing columns added, structs to strings where the features say
        string, then ``table_cast``)."""
        from datasets.packaged_modules.json.json import Json

        # what _cast_table reads of its builder: info.features (datasets 5.x), config.features (4.x)
        shim = SimpleNamespace(info=SimpleNamespace(features=self._features),
                               config=SimpleNamespace(features=self._features))
        return Json._cast_table(shim, table)

    def table(self, text: bytes, lo: int, rows: int, where: Callable[[int], str]) -> pa.Table:
        """The ``rows`` rows of ``text`` from byte ``lo`` (a row's start), with the bad-sample column; a block
        that does not parse whole is parsed row by row, each row that fails a bad sample (``where(i)``: row
        ``i`` of the block, named for the reason)."""
        block = text[lo:] if lo else text
        try:
            table = self.parse(block)
            if table.num_rows == rows:
                return table.append_column(marker_field(), pa.nulls(rows, pa.string()))
        except Exception:   # noqa: BLE001 - parsed again row by row below, each failure named
            pass
        return self._row_by_row(text, lo, rows, where)

    def _row_by_row(self, text: bytes, lo: int, rows: int, where: Callable[[int], str]) -> pa.Table:
        from ..io.ranged import WrongBytes

        spans = jsonl_index.row_spans(text, lo)
        if len(spans) != rows:
            raise WrongBytes(f"{len(spans)} rows where the index says {rows}")
        good, reasons = [], []
        for a, b in spans:
            line = text[a:b]
            why = line_problem(line)
            if why is None:
                try:
                    good.append(self.parse(line))
                except Exception as e:   # noqa: BLE001 - a value the features cannot take: a bad sample
                    why = f"does not fit the dataset's features ({type(e).__name__}: {str(e)[:200]})"
            reasons.append(why)
        schema = self.schema
        bad_rows = [i for i, why in enumerate(reasons) if why is not None]
        for i in bad_rows:
            reasons[i] = _bad(where(i), reasons[i])
        nulls = pa.table({f.name: pa.nulls(len(bad_rows), f.type) for f in schema}, schema=schema)
        joined = pa.concat_tables([*good, nulls]) if good else nulls
        order, g, b = [], 0, len(good)
        for why in reasons:
            if why is None:
                order.append(g)
                g += 1
            else:
                order.append(b)
                b += 1
        out = joined.take(pa.array(order, pa.int64()))
        return out.append_column(marker_field(), pa.array(reasons, pa.string()))


def line_problem(line: bytes) -> str | None:
    """Why a row's line is not one JSON object (None: it is)."""
    try:
        value = json.loads(line.lstrip(b"\xef\xbb\xbf"))
    except (ValueError, UnicodeDecodeError) as e:
        return f"is not JSON ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(value, dict):
        return f"is a JSON {type(value).__name__}, not an object"
    return None


def _bad(where: str, why: str) -> str:
    reason = f"{where}: {why}"
    log.warning("%s; a bad sample, its columns are None", reason)
    return reason
