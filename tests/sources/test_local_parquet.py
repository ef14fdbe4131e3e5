"""Local parquet opened without ``datasets`` gives what ``datasets`` gives: the same files in the same order,
the same features, the same tables; and a fresh start or a resume of local parquet does not import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resumable_stream import StreamConfig
from resumable_stream.sources import RetryPolicy, open_source
from resumable_stream.sources.parquet_local import (
    cast_like_datasets,
    resolve_local_parquet,
    simple_features,
    simple_schema,
)
from resumable_stream.sources.resolve import builder_args, resolve_files
from resumable_stream.testing import synthetic_rows, write_parquet_dataset


def _table(start: int = 0, n: int = 10) -> pa.Table:
    return pa.table(synthetic_rows(start, n))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """Files that datasets' resolution treats specially: hidden files and directories, __special__ ones,
    README.md, other extensions, sub-directories matching a pattern, symlinks, odd names."""
    root = tmp_path_factory.mktemp("tree")
    for rel in ("a/p-0.parquet", "a/p-1.parquet", "a/p-10.parquet", "a/P-2.parquet", "a/.hidden.parquet",
                "a/.hid/x.parquet", "a/__cache__/y.parquet", "a/sub/z.parquet", "a/sub/deeper/w.parquet",
                "a/with space é.parquet", "a/README.md", "a/dataset_info.json", "a/notes.txt",
                "b/q-0.parquet", "b/q-1.parquet"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".parquet"):
            pq.write_table(_table(len(rel), 5), str(path))
        else:
            path.write_text("x")
    (root / "a" / "dir.parquet").mkdir()                           # a directory that matches *.parquet
    os.symlink(root / "b" / "q-0.parquet", root / "a" / "link.parquet")
    os.symlink(root / "b", root / "a" / "linkdir.parquet")          # a symlink to a directory
    os.symlink(root / "nowhere.parquet", root / "a" / "broken.parquet")
    return str(root)


def _patterns(root: str) -> list:
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    return [
        os.path.join(a, "*.parquet"),
        os.path.join(a, "p-?.parquet"),
        os.path.join(a, "*"),
        os.path.join(a, ".*"),
        os.path.join(a, "**"),
        os.path.join(a, "**", "*.parquet"),
        os.path.join(a, "*", "*.parquet"),
        os.path.join(a, "__*", "*.parquet"),
        os.path.join(a, ".hid", "*"),
        os.path.join(a, "README.md"),
        os.path.join(a, "p-1.parquet"),
        os.path.join(a, "link.parquet"),
        os.path.join(a, "with space é.parquet"),
        [os.path.join(b, "q-1.parquet"), os.path.join(b, "q-0.parquet"), os.path.join(b, "q-1.parquet")],
        [os.path.join(b, "*.parquet"), os.path.join(a, "p-*.parquet")],
        [os.path.join(b, "*.parquet"), os.path.join(a, "nomatch-*.parquet")],
        {"train": os.path.join(a, "p-*.parquet"), "test": [os.path.join(b, "*.parquet")]},
        "a/*.parquet",                              # relative: to the working directory
        "./b/*.parquet",
        "a/../b/q-*.parquet",
        os.path.join(a, "nomatch-*.parquet"),
        os.path.join(a, "missing.parquet"),
        os.path.join(a, "broken.parquet"),
        os.path.join(a, "dir.parquet"),
        os.path.join(a, "[pq]-0.parquet"),
        "file://" + os.path.join(b, "*.parquet"),
    ]


def _datasets_files(cfg):
    path, data_files = builder_args(cfg.source_spec.data)
    try:
        return resolve_files(cfg.source_spec.data, path, data_files, [], RetryPolicy(cfg.source_spec.net, remote=False))[1]
    except Exception as e:      # noqa: BLE001  (what datasets says then is its answer; ours must be None)
        return e


@pytest.mark.parametrize("i", range(26))
@pytest.mark.parametrize("split", ["train", "test"])
def test_files_resolve_as_datasets_resolves_them(tree, i, split, monkeypatch):
    monkeypatch.chdir(tree)
    data_files = _patterns(tree)[i]
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=data_files, split=split)
    ours = resolve_local_parquet(cfg.source_spec.data, *builder_args(cfg.source_spec.data))
    theirs = _datasets_files(cfg)
    if ours is not None:
        assert ours == theirs, f"{data_files!r}: resolved {ours}, datasets resolves {theirs}"
    # the common forms are resolved without datasets
    if split == "train" and i in (0, 1, 2, 5, 10, 11, 12, 13, 14, 16, 17):
        assert ours is not None, f"{data_files!r}: left to datasets"


def test_a_named_file_resolves_as_datasets_resolves_it(tree):
    cfg = StreamConfig(dataset_name_or_path=os.path.join(tree, "a", "p-0.parquet"))
    assert resolve_local_parquet(cfg.source_spec.data, *builder_args(cfg.source_spec.data)) == _datasets_files(cfg) == [
        os.path.join(tree, "a", "p-0.parquet")]


@pytest.mark.parametrize("kw", [{"name": "default"}, {"data_dir": "a"},
                                {"storage_options": {"anon": True}}, {"streaming": False}])
def test_other_settings_are_left_to_datasets(tree, kw):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(tree, "a", "*.parquet"), **kw)
    spec = cfg.source_spec
    assert resolve_local_parquet(spec.data, *builder_args(spec.data), storage_options=spec.net.storage_options) is None


_PLAIN = {"b": pa.bool_(), "i8": pa.int8(), "i16": pa.int16(), "i32": pa.int32(), "i64": pa.int64(),
          "u8": pa.uint8(), "u16": pa.uint16(), "u32": pa.uint32(), "u64": pa.uint64(), "f16": pa.float16(),
          "f32": pa.float32(), "f64": pa.float64(), "s": pa.string(), "ls": pa.large_string(), "y": pa.binary(),
          "ly": pa.large_binary()}
_OTHER = {"lst": pa.list_(pa.int64()), "st": pa.struct([("x", pa.int32())]), "d": pa.date32(),
          "ts": pa.timestamp("ms"), "dec": pa.decimal128(5, 2), "dict": pa.dictionary(pa.int32(), pa.string()),
          "fsl": pa.list_(pa.float32(), 2), "n": pa.null()}


def test_features_and_schema_are_datasets_own():
    import datasets

    schema = pa.schema([pa.field(n, t) for n, t in _PLAIN.items()])
    theirs = datasets.Features.from_arrow_schema(schema)
    assert simple_features(schema) == theirs.to_dict()
    assert json.dumps(simple_features(schema)) == json.dumps(theirs.to_dict())       # the same key order too
    ours = simple_schema(theirs.to_dict())
    assert ours.equals(theirs.arrow_schema, check_metadata=True)
    assert ours.metadata == theirs.arrow_schema.metadata
    for name, t in _OTHER.items():          # left to datasets
        assert simple_features(pa.schema([pa.field("a", pa.int64()), pa.field(name, t)])) is None
    hf = pa.schema([pa.field("a", pa.int64())]).with_metadata(theirs.arrow_schema.metadata)
    assert simple_features(hf) is None
    assert simple_schema({"a": {"dtype": "int64", "id": None, "_type": "Value"}}) is None   # an older datasets'


def _values(field: pa.Field) -> pa.Array:
    import numpy as np

    t = field.type
    if pa.types.is_boolean(t):
        values = [True, False]
    elif pa.types.is_float16(t):
        values = list(np.array([0.5, 1.5], dtype=np.float16))
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        values = ["x", "yz"]
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        values = [b"x", b"yz"]
    else:
        values = [1, 2]
    return pa.array(values + ([None] if field.nullable else values[:1]), t)


@pytest.mark.parametrize("order", ["file", "sorted", "reversed"])
@pytest.mark.parametrize("nullable", [True, False])
def test_cast_is_datasets_table_cast(order, nullable):
    """Features in the file's order (a fresh index), sorted (an index read back from JSON), reversed; a
    required column (a real cast then: left to datasets)."""
    import datasets
    from datasets.table import table_cast

    fields = [pa.field(n, t, nullable=nullable or n != "i64") for n, t in _PLAIN.items()]
    table = pa.table([_values(f) for f in fields], schema=pa.schema(fields))
    features = datasets.Features.from_arrow_schema(table.schema).to_dict()
    names = {"file": list(features), "sorted": sorted(features), "reversed": list(features)[::-1]}[order]
    features = {n: features[n] for n in names}
    schema = simple_schema(features)
    theirs = table_cast(table, datasets.Features.from_dict(features).arrow_schema)
    ours = cast_like_datasets(table, schema)
    if not nullable:
        assert ours is None
        return
    assert ours.equals(theirs, check_metadata=True) and ours.schema.metadata == theirs.schema.metadata
    assert ours.column_names == theirs.column_names and ours.to_pylist() == theirs.to_pylist()


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    write_parquet_dataset(str(d), rows=900, files=3, row_group_size=100)
    return str(d)


def test_the_index_is_the_one_datasets_resolution_builds(plain_dir, monkeypatch):
    """Opened without datasets, or with it (resolution by ``load_dataset_builder``): the same index, tables."""
    from resumable_stream.sources import parquet_local as local_parquet
    from resumable_stream.sources import resolve
    from resumable_stream.sources.index import encode_index

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(plain_dir, "*.parquet"))
    ours = open_source(cfg.source_spec)
    with monkeypatch.context() as mp:
        mp.setattr(resolve, "resolve_local_parquet", lambda *a: None)
        mp.setattr(local_parquet, "simple_features", lambda schema: None)
        mp.setattr("resumable_stream.sources.parquet_rows.simple_schema", lambda features: None)
        theirs = open_source(cfg.source_spec)
    assert encode_index(ours.index) == encode_index(theirs.index)      # (its files are columnar: not plain JSON)
    assert ours.fingerprint == theirs.fingerprint
    for shard in range(len(ours.shards)):
        a, b = list(ours.read(shard)), list(theirs.read(shard))
        assert len(a) == len(b) and all(x.equals(y, check_metadata=True) for x, y in zip(a, b))


_NO_DATASETS = r"""
import itertools, json, sys
from resumable_stream import ResumableStream, StreamConfig
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=sys.argv[1], shuffle=True, buffer_size=64,
                   resume_state_path=sys.argv[3] if sys.argv[2] == "resume" else None)
s = ResumableStream(cfg)
rows = [r["id"] for r in itertools.islice(s, 50)]
if sys.argv[2] == "save":
    s.save_sidecar(sys.argv[3])
print(json.dumps({"ids": rows, "imported": sorted(m for m in ("datasets", "pandas", "fsspec") if m in sys.modules)}))
"""


@pytest.mark.slow     # a process of its own
def test_local_parquet_starts_and_resumes_without_datasets(plain_dir, tmp_path):
    """A fresh start and a resume from a state directory (the index saved with it; files verified) import
    neither datasets nor pandas (~0.75 s of CPU together), nor fsspec for a plain glob."""
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _NO_DATASETS, os.path.join(plain_dir, "*.parquet"), mode,
                              str(tmp_path / "state")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run("save")
    again = run("resume")
    assert first["imported"] == [] and again["imported"] == []
    assert again["ids"][0] not in first["ids"]


def test_row_groups_decode_as_parquet_file_decodes_them(tmp_path, monkeypatch):
    """Our reader (allocating from pyarrow's jemalloc, where it has one, else the system pool) gives
    pq.ParquetFile's tables, nested and dictionary columns included; ARROW_DEFAULT_MEMORY_POOL set: pyarrow's
    default pool, as the user chose."""
    import pyarrow as pa

    from resumable_stream.runtime import arrow_pool
    from resumable_stream.sources import parquet_rows as parquet_files

    table = pa.table({"i": pa.array([1, None, 3] * 40, pa.int64()), "s": ["a", "bb", None] * 40,
                      "l": pa.array([[1, 2], None, []] * 40, pa.list_(pa.int32())),
                      "st": pa.array([{"x": 1}, None, {"x": 3}] * 40, pa.struct([("x", pa.int16())])),
                      "d": pa.array(["u", "v", "u"] * 40).dictionary_encode()})
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=50)
    md = pq.read_metadata(path)
    try:
        pa.jemalloc_memory_pool()
        expected = "jemalloc"
    except NotImplementedError:
        expected = "system"
    assert arrow_pool.rows_pool().backend_name == expected
    for group in range(md.num_row_groups):
        ours = parquet_files.read_row_group(path, md, group)
        theirs = pq.ParquetFile(path, metadata=md, pre_buffer=False).read_row_group(group)
        assert ours.equals(theirs, check_metadata=True) and ours.schema == theirs.schema
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")
    assert arrow_pool.rows_pool() is None
    assert parquet_files.read_row_group(path, md, 1).equals(pq.ParquetFile(path).read_row_group(1))


def test_rows_pool_falls_back_to_the_system_allocator_without_jemalloc(monkeypatch):
    """A pyarrow built without jemalloc (Windows, macOS wheels) raises NotImplementedError for its pool: the
    rows then come from the system allocator, not an error."""
    import pyarrow as pa

    from resumable_stream.runtime import arrow_pool

    def no_jemalloc():
        raise NotImplementedError("This Arrow build does not enable jemalloc")

    monkeypatch.setattr(pa, "jemalloc_memory_pool", no_jemalloc)
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    arrow_pool._own_pool.cache_clear()
    try:
        assert arrow_pool.rows_pool().backend_name == "system"
    finally:
        arrow_pool._own_pool.cache_clear()


@pytest.mark.parametrize("blocks,interleave", [(0, 4), (1, 4), (8, 4), (8, 1), (256, 4), (256, 64)])
def test_local_prefetch_depth_keeps_the_next_shards_in_flight_and_no_more(plain_dir, blocks, interleave):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(plain_dir, "*.parquet"),
                       prefetch_blocks=blocks, interleave_shards=interleave)
    src = open_source(cfg.source_spec)
    want = min(blocks, max(os.cpu_count() or 1, interleave))
    assert src.prefetch_depth == want
    assert src._prefetch is None if not blocks else src._prefetch._threads == min(blocks, os.cpu_count() or 1)
    src.close()


@pytest.mark.parametrize("i", range(26))
def test_the_directory_scan_is_fsspecs_glob(tree, i, monkeypatch):
    """Plain patterns are listed with one os.scandir: the same files as through fsspec's glob."""
    from resumable_stream.sources import parquet_local as local_parquet

    monkeypatch.chdir(tree)
    patterns = _patterns(tree)[i]
    for pattern in [patterns] if isinstance(patterns, str) else (
            patterns if isinstance(patterns, list) else list(patterns.values())):
        for p in [pattern] if isinstance(pattern, str) else pattern:
            if ":" in p:
                continue
            full = p if os.path.isabs(p) else os.path.join(os.path.realpath(tree), p)
            scanned = local_parquet._scanned(full)
            if scanned is None:
                continue
            with monkeypatch.context() as mp:
                mp.setattr(local_parquet, "_scanned", lambda pattern: None)
                assert scanned == local_parquet._resolve_pattern(full, "/"), p
