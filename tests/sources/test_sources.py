"""Sources through real HF ``datasets`` over local files (no network).

Covers every local format we route through ``datasets`` (parquet, json/jsonl, csv, text, arrow),
a directory or a single file given as ``dataset_name_or_path``, ``streaming: false`` and
``backend: local``; the shard lists (parquet row groups, one shard per file otherwise); the
dataset fingerprint (files with size and mtime) and every way a changed file is reported on
resume; the next-sample content check; and the errors for missing files.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Callable

import datasets
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from resumable_stream import ConfigError, ResumableStream, SourceError, StreamConfig, StreamMismatchError
from resumable_stream.sources.fingerprint_files import identities
from resumable_stream.testing import synthetic_rows, write_jsonl_dataset, write_parquet_dataset

N = 240          # rows of every dataset in the format tests
FILES = 3        # files they are spread over
BUF = 64         # shuffle window: several windows per epoch, the resume point falls inside one
K = 100          # rows read before saving: window 1, offset 36


# ---------------------------------------------------------------------------------------- helpers
def _take(stream_or_iter, n: int) -> list[dict]:
    return list(itertools.islice(stream_or_iter, n))


def _stream(cfg: StreamConfig) -> ResumableStream:
    return ResumableStream(cfg, rank=0, world_size=1)


def _split_rows(rows: int, files: int) -> list[tuple[int, int]]:
    """(start, count) of each file, the way synthetic.write_*_dataset splits rows."""
    out, start = [], 0
    for f in range(files):
        count = rows // files + (1 if f < rows % files else 0)
        out.append((start, count))
        start += count
    return out


def _write_csv(d: str, rows: int = N, files: int = FILES) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = []
    for f, (start, count) in enumerate(_split_rows(rows, files)):
        path = os.path.join(d, f"part-{f:05d}.csv")
        pacsv.write_csv(pa.table(synthetic_rows(start, count)), path)
        paths.append(path)
    return paths


def _write_text(d: str, rows: int = N, files: int = FILES) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = []
    for f, (start, count) in enumerate(_split_rows(rows, files)):
        path = os.path.join(d, f"part-{f:05d}.txt")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(synthetic_rows(start, count)["text"]) + "\n")
        paths.append(path)
    return paths


def _write_json_lines_as_json(d: str, rows: int = N, files: int = FILES) -> list[str]:
    """JSON lines in files named ``.json`` (the json builder reads both)."""
    paths = write_jsonl_dataset(d, rows, files)
    out = []
    for p in paths:
        q = p[: -len(".jsonl")] + ".json"
        os.rename(p, q)
        out.append(q)
    return out


def _write_arrow(d: str, rows: int = N, files: int = FILES, ipc_file: bool = False) -> list[str]:
    """Arrow IPC files. The ``arrow`` builder opens each with ``pa.ipc.open_stream`` and falls
    back to ``pa.ipc.open_file``; the stream format (``pa.ipc.new_stream``) is its first choice."""
    os.makedirs(d, exist_ok=True)
    paths = []
    for f, (start, count) in enumerate(_split_rows(rows, files)):
        table = pa.table(synthetic_rows(start, count))
        path = os.path.join(d, f"part-{f:05d}.arrow")
        writer = pa.ipc.new_file if ipc_file else pa.ipc.new_stream
        with pa.OSFile(path, "wb") as sink, writer(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=30):   # several record batches per file
                w.write_batch(batch)
        paths.append(path)
    return paths


def _write_parquet(d: str, rows: int = N, files: int = FILES) -> list[str]:
    return write_parquet_dataset(d, rows=rows, files=files, row_group_size=25)


def _write_jsonl(d: str, rows: int = N, files: int = FILES) -> list[str]:
    return write_jsonl_dataset(d, rows, files)


def _save_local(d: str, dict_split: str | None = None) -> None:
    ds = datasets.Dataset.from_dict(synthetic_rows(0, N))
    if dict_split is None:
        ds.save_to_disk(d)
    else:
        other = datasets.Dataset.from_dict(synthetic_rows(10_000, 17))
        datasets.DatasetDict({dict_split: ds, "other": other}).save_to_disk(d)


# Each case: (writer into a directory -> StreamConfig keywords, the column that identifies a row).
def _glob(builder: str, writer: Callable, ext: str) -> Callable[[str], dict]:
    def make(d: str) -> dict:
        writer(d)
        return dict(dataset_name_or_path=builder, data_files=os.path.join(d, f"*{ext}"))
    return make


def _directory(writer: Callable) -> Callable[[str], dict]:
    def make(d: str) -> dict:
        writer(d)
        return dict(dataset_name_or_path=d)
    return make


def _single_file(writer: Callable) -> Callable[[str], dict]:
    def make(d: str) -> dict:
        (path,) = writer(d, N, 1)
        return dict(dataset_name_or_path=path)
    return make


def _not_streaming(builder: str, writer: Callable, ext: str) -> Callable[[str], dict]:
    def make(d: str) -> dict:
        writer(d)
        return dict(dataset_name_or_path=builder, data_files=os.path.join(d, f"*{ext}"), streaming=False)
    return make


def _local(dict_split: str | None) -> Callable[[str], dict]:
    def make(d: str) -> dict:
        _save_local(d, dict_split)
        kw = dict(dataset_name_or_path=d, backend="local", streaming=False)
        if dict_split is not None:
            kw["split"] = dict_split
        return kw
    return make


CASES: dict[str, tuple[Callable[[str], dict], str]] = {
    "parquet-glob": (_glob("parquet", _write_parquet, ".parquet"), "id"),
    "parquet-dir": (_directory(_write_parquet), "id"),
    "parquet-file": (_single_file(_write_parquet), "id"),
    "jsonl-glob": (_glob("json", _write_jsonl, ".jsonl"), "id"),
    "jsonl-dir": (_directory(_write_jsonl), "id"),
    "jsonl-file": (_single_file(_write_jsonl), "id"),
    "json-glob": (_glob("json", _write_json_lines_as_json, ".json"), "id"),
    "json-file": (_single_file(_write_json_lines_as_json), "id"),
    "csv-glob": (_glob("csv", _write_csv, ".csv"), "id"),
    "csv-dir": (_directory(_write_csv), "id"),
    "csv-file": (_single_file(_write_csv), "id"),
    "text-glob": (_glob("text", _write_text, ".txt"), "text"),
    "text-dir": (_directory(_write_text), "text"),
    "text-file": (_single_file(_write_text), "text"),
    "arrow-glob": (_glob("arrow", _write_arrow, ".arrow"), "id"),
    "arrow-dir": (_directory(_write_arrow), "id"),
    "arrow-file": (_single_file(_write_arrow), "id"),
    "arrow-ipc-file-format": (_glob("arrow", lambda d: _write_arrow(d, ipc_file=True), ".arrow"), "id"),
    "parquet-not-streaming": (_not_streaming("parquet", _write_parquet, ".parquet"), "id"),
    "jsonl-not-streaming": (_not_streaming("json", _write_jsonl, ".jsonl"), "id"),
    "local-dataset": (_local(None), "id"),
    "local-datasetdict-split": (_local("validation"), "id"),
}


def _expected(key: str) -> Counter:
    rows = synthetic_rows(0, N)
    return Counter(rows[key])


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    make, key = CASES[request.param]
    kw = make(str(tmp_path / "data"))
    cfg = StreamConfig(**kw, shuffle=True, shuffle_seed=7, buffer_size=BUF)
    return request.param, cfg, key


# ----------------------------------------------------------------------------- every format
def test_one_epoch_yields_every_row_exactly_once(case):
    name, cfg, key = case
    stream = _stream(cfg)
    rows = _take(stream, N)
    assert len(rows) == N
    assert Counter(r[key] for r in rows) == _expected(key), name
    want_cols = {"text"} if key == "text" else {"id", "text", "label"}
    assert set(rows[0]) == want_cols
    if key == "id":   # values come through with their types, and rows stay whole
        ref = synthetic_rows(0, N)
        for r in rows:
            assert r["text"] == ref["text"][r["id"]] and r["label"] == ref["label"][r["id"]]
    assert [r[key] for r in rows] != sorted(r[key] for r in rows), "shuffle: true must change the order"

    # set_epoch(0): the finite epoch holds exactly the same rows, no more.
    finite = _stream(cfg)
    finite.set_epoch(0)
    assert Counter(r[key] for r in finite) == _expected(key)


def test_exact_resume_matches_uninterrupted(case, tmp_path):
    name, cfg, key = case
    m = N - K + 30                          # crosses into epoch 1
    reference = _take(_stream(cfg), K + m)

    original = _stream(cfg)
    it = iter(original)
    assert _take(it, K) == reference[:K]
    state_dir = str(tmp_path / "state")
    original.save_sidecar(state_dir)
    assert _take(it, m) == reference[K:], f"{name}: saving must not disturb the stream"

    resumed = _stream(cfg.replace(resume_state_path=state_dir))
    assert _take(resumed, m) == reference[K:], name


def test_directory_with_split_files_selects_the_split(tmp_path):
    d = tmp_path / "splits"
    write_jsonl_dataset(str(d / "a"), 50, 1)
    write_jsonl_dataset(str(d / "b"), 30, 1)
    os.rename(d / "a" / "part-00000.jsonl", d / "train.jsonl")
    os.rename(d / "b" / "part-00000.jsonl", d / "test.jsonl")
    os.rmdir(d / "a")
    os.rmdir(d / "b")
    stream = _stream(StreamConfig(dataset_name_or_path=str(d), split="test", shuffle=True, buffer_size=8))
    stream.set_epoch(0)
    assert sorted(r["id"] for r in stream) == list(range(30))
    assert [f["path"] for f in stream.fingerprint()["dataset"]["files"]] == [str(d / "test.jsonl")]


def test_unknown_split_is_a_config_error_naming_the_splits(tmp_path):
    """BUG (source.py:198-200): the split names are NamedSplit objects, ``', '.join`` raises TypeError."""
    d = str(tmp_path / "pq")
    write_parquet_dataset(d, rows=40, files=1, row_group_size=20)
    with pytest.raises(ConfigError) as e:
        _stream(StreamConfig(dataset_name_or_path=d, split="test"))
    assert "data.split" in str(e.value) and "'test'" in str(e.value) and "train" in str(e.value)


# ---------------------------------------------------------------------------------- shards
def test_parquet_is_resharded_to_row_groups(tmp_path):
    d = str(tmp_path / "pq")
    files = write_parquet_dataset(d, rows=250, files=2, row_group_size=40)   # 125 rows: 40, 40, 40, 5
    stream = _stream(StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(d, "*.parquet")))
    shards = stream.source.shards
    expected = [(f, rg, pq.ParquetFile(f).metadata.row_group(rg).num_rows)
                for f in files for rg in range(pq.ParquetFile(f).metadata.num_row_groups)]
    assert [(s.file, s.part, s.num_rows) for s in shards] == expected
    assert [s.num_rows for s in shards] == [40, 40, 40, 5] * 2
    assert [s.index for s in shards] == list(range(len(expected)))
    assert shards[1].name == "part-00000.parquet#1"
    for s in shards:   # shard i reads exactly its row group, also from a row inside it
        group = pq.ParquetFile(s.file).read_row_group(s.part)
        got = pa.concat_tables(list(stream.source.read(s.index)))
        assert got.column("id").to_pylist() == group.column("id").to_pylist()
        tail = pa.concat_tables(list(stream.source.read(s.index, 3)))
        assert tail.column("id").to_pylist() == group.column("id").to_pylist()[3:]
    fp = stream.fingerprint()["dataset"]
    assert fp["num_shards"] == 8 and fp["builder"] == "parquet"


@pytest.mark.parametrize("fmt", ["csv", "text", "arrow"])      # JSON lines: indexed, tests/sources/test_jsonl.py
def test_other_formats_have_one_shard_per_file(tmp_path, fmt):
    writer, builder, ext, key = {
        "jsonl": (_write_jsonl, "json", ".jsonl", "id"),
        "csv": (_write_csv, "csv", ".csv", "id"),
        "text": (_write_text, "text", ".txt", "text"),
        "arrow": (_write_arrow, "arrow", ".arrow", "id"),
    }[fmt]
    d = str(tmp_path / fmt)
    files = writer(d)
    stream = _stream(StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(d, f"*{ext}")))
    shards = stream.source.shards
    assert [(s.index, s.file, s.part) for s in shards] == [(i, f, None) for i, f in enumerate(files)]
    ref = synthetic_rows(0, N)[key]
    for s, (start, count) in zip(shards, _split_rows(N, FILES)):   # shard i is file i
        got = pa.concat_tables(list(stream.source.read(s.index))).column(key).to_pylist()
        assert got == ref[start:start + count]


# ----------------------------------------------------------------------------- fingerprint
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_fingerprint_lists_files_with_size_and_mtime(tmp_path, fmt):
    d = str(tmp_path / fmt)
    files = _write_parquet(d) if fmt == "parquet" else _write_jsonl(d)
    builder = "parquet" if fmt == "parquet" else "json"
    cfg = StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(d, f"*.{fmt}"))
    fp = _stream(cfg).fingerprint()
    listed = fp["dataset"]["files"]
    if fmt == "parquet":      # an indexed dataset's: their count and digest, which stand for the index's identities
        assert set(listed) == {"count", "digest"} and listed["count"] == len(files)
        listed = identities(listed)
    assert [f["path"] for f in listed] == files
    for f in listed:
        st = os.stat(f["path"])
        assert f["size"] == st.st_size
        assert abs(f["mtime"] - st.st_mtime) < 1e-5
    json.dumps(fp)   # goes into the sidecar metadata as JSON
    assert _stream(cfg).fingerprint() == fp   # deterministic


def test_local_backend_fingerprint_lists_its_arrow_files(tmp_path):
    d = str(tmp_path / "local")
    _save_local(d)
    fp = _stream(StreamConfig(dataset_name_or_path=d, backend="local")).fingerprint()["dataset"]
    arrows = [f for f in fp["files"] if f["path"].endswith(".arrow")]
    assert arrows and all(f["size"] == os.path.getsize(f["path"]) and "mtime" in f for f in arrows)
    assert fp["num_rows"] == N


def _saved(cfg: StreamConfig, state_dir: str, k: int = 30) -> None:
    stream = _stream(cfg)
    _take(stream, k)
    stream.save_sidecar(state_dir)


def _add(fmt: str, d: str, files: list[str]) -> str:
    path = os.path.join(d, f"part-99999.{fmt}")
    if fmt == "parquet":
        pq.write_table(pa.table(synthetic_rows(N, 10)), path)
    else:
        write_jsonl_dataset(os.path.join(d, "_new"), 10, 1)
        os.rename(os.path.join(d, "_new", "part-00000.jsonl"), path)
        os.rmdir(os.path.join(d, "_new"))
    return path


def _remove(fmt: str, d: str, files: list[str]) -> str:
    os.remove(files[-1])
    return files[-1]


def _resize(fmt: str, d: str, files: list[str]) -> str:
    path = files[1]
    if fmt == "parquet":
        pq.write_table(pa.table(synthetic_rows(80, 60)), path, row_group_size=25)
    else:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"id": 10_000, "text": "row 10000: extra", "label": 0}) + "\n")
    return path


def _touch(fmt: str, d: str, files: list[str]) -> str:
    path = files[1]
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("change,word", [(_add, "added"), (_remove, "removed"), (_resize, "resized"),
                                         (_touch, "modified")], ids=["add", "remove", "resize", "touch"])
def test_changed_files_make_resume_fail(tmp_path, fmt, change, word):
    d = str(tmp_path / fmt)
    files = _write_parquet(d) if fmt == "parquet" else _write_jsonl(d)
    builder = "parquet" if fmt == "parquet" else "json"
    cfg = StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(d, f"*.{fmt}"),
                       shuffle=True, buffer_size=BUF)
    state_dir = str(tmp_path / "state")
    _saved(cfg, state_dir)
    path = change(fmt, d, files)
    with pytest.raises(StreamMismatchError) as e:
        _take(_stream(cfg.replace(resume_state_path=state_dir)), 1)
    msg = str(e.value)
    assert f"file {word}: {path}" in msg, msg
    assert any(path in what and word in what for what, _, _ in e.value.differences)


@pytest.mark.parametrize("key,old,new", [("shuffle_seed", 42, 43), ("buffer_size", 64, 32)])
def test_changed_order_settings_make_resume_fail(tmp_path, parquet_small, key, old, new):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(parquet_small, "*.parquet"),
                       shuffle=True, shuffle_seed=42, buffer_size=64)
    state_dir = str(tmp_path / "state")
    _saved(cfg, state_dir)
    with pytest.raises(StreamMismatchError) as e:
        _stream(cfg.replace(resume_state_path=state_dir, **{key: new}))
    assert f"data.{key}: saved {old!r}, now {new!r}" in str(e.value), str(e.value)


# ------------------------------------------------------------------------- content check
def _rewrite_same_size(path: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` (same byte length) in ``path`` and put back its exact times."""
    assert len(old.encode()) == len(new.encode()) and old != new
    st = os.stat(path)
    with open(path, encoding="utf-8") as fh:
        content = fh.read()
    assert content.count(old) == 1
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(content.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


# JSON lines are indexed: a same-size, same-mtime rewrite is named on resume already (its head, or its CRCs before a
# row is made: tests/sources/test_jsonl.py)
@pytest.mark.parametrize("fmt,shuffle", [("csv", False), ("csv", True), ("text", True)])
def test_changed_content_with_same_identity_fails_at_first_sample(tmp_path, fmt, shuffle):
    writer, builder, ext = {"jsonl": (_write_jsonl, "json", ".jsonl"), "csv": (_write_csv, "csv", ".csv"),
                            "text": (_write_text, "text", ".txt")}[fmt]
    d = str(tmp_path / fmt)
    files = writer(d, 60, 2)
    buffer_size = 16 if shuffle else 10
    cfg = StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(d, f"*{ext}"),
                       shuffle=shuffle, buffer_size=buffer_size)
    k = 25                                   # mid-window: the resume re-reads the window, skips 25 % size rows
    reference = _take(_stream(cfg), k + 1)
    if not shuffle:
        assert [r["id"] for r in reference] == list(range(k + 1))

    stream = _stream(cfg)
    _take(stream, k)
    state_dir = str(tmp_path / "state")
    stream.save_sidecar(state_dir)
    saved_fp = stream.fingerprint()

    # The row the cursor points at: same byte length, other words, same size and mtime.
    text = reference[k]["text"]
    head, tail = text.split(": ", 1)
    changed = f"{head}: {tail.upper()}"
    (path,) = [f for f in files if text in open(f, encoding="utf-8").read()]
    _rewrite_same_size(path, text, changed)

    resumed = _stream(cfg.replace(resume_state_path=state_dir))   # fingerprints agree: no error yet
    assert resumed.fingerprint() == saved_fp
    with pytest.raises(StreamMismatchError) as e:
        _take(resumed, 1)
    msg = str(e.value)
    assert "first sample" in msg and "digest" in msg, msg
    assert [what for what, _, _ in e.value.differences] == ["next_sample_digest"]


def test_unchanged_content_with_restored_mtime_resumes(tmp_path):
    """Control for the content check: rewriting the same bytes and restoring the times is no change."""
    d = str(tmp_path / "jsonl")
    files = _write_jsonl(d, 60, 2)
    cfg = StreamConfig(dataset_name_or_path="json", data_files=os.path.join(d, "*.jsonl"), buffer_size=10)
    reference = _take(_stream(cfg), 40)
    stream = _stream(cfg)
    _take(stream, 25)
    stream.save_sidecar(str(tmp_path / "state"))
    for f in files:
        st = os.stat(f)
        with open(f, "rb") as fh:
            data = fh.read()
        with open(f, "wb") as fh:
            fh.write(data)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _take(_stream(cfg.replace(resume_state_path=str(tmp_path / "state"))), 15) == reference[25:]


# ----------------------------------------------------------------------------------- errors
def _error_for(**kw) -> Exception:
    with pytest.raises((SourceError, ConfigError)) as e:
        _take(_stream(StreamConfig(**kw)), 1)
    return e.value


def test_missing_file_in_list_is_named(tmp_path):
    d = str(tmp_path / "pq")
    files = write_parquet_dataset(d, rows=40, files=1, row_group_size=20)
    missing = os.path.join(d, "missing-00001.parquet")
    err = _error_for(dataset_name_or_path="parquet", data_files=[files[0], missing])
    assert missing in str(err)


def test_missing_single_data_file_is_named(tmp_path):
    missing = str(tmp_path / "nothing.jsonl")
    assert missing in str(_error_for(dataset_name_or_path="json", data_files=missing))


def test_missing_path_as_dataset_name_is_named(tmp_path):
    for missing in (str(tmp_path / "no-such-dir"), str(tmp_path / "no-such-file.parquet")):
        assert missing in str(_error_for(dataset_name_or_path=missing))


@pytest.mark.parametrize("streaming", [True, False])
def test_glob_matching_nothing_is_named(tmp_path, streaming):
    """BUG (source.py:190-221): an empty glob passes load_dataset_builder and fails later with
    'streaming failed' / 'loading without streaming failed' that does not name data.data_files."""
    d = str(tmp_path / "pq")
    write_parquet_dataset(d, rows=40, files=1, row_group_size=20)
    for pattern in (os.path.join(d, "*.csv"), str(tmp_path / "nowhere" / "*.parquet")):
        err = _error_for(dataset_name_or_path="parquet", data_files=pattern, streaming=streaming)
        assert pattern in str(err), str(err)


def test_local_backend_errors_name_the_directory(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    assert missing in str(_error_for(dataset_name_or_path=missing, backend="local"))
    plain = str(tmp_path / "plain")
    write_jsonl_dataset(plain, 10, 1)
    err = _error_for(dataset_name_or_path=plain, backend="local")
    assert isinstance(err, SourceError) and plain in str(err) and "save_to_disk" in str(err)
    dd = str(tmp_path / "dd")
    _save_local(dd, "validation")
    err = _error_for(dataset_name_or_path=dd, backend="local", split="train")
    assert isinstance(err, ConfigError) and "data.split" in str(err) and "validation" in str(err)


def test_data_dir_narrows_a_dataset_to_one_folder(tmp_path):
    """data.data_dir is load_dataset's data_dir (LLaMA-Factory's dataset_info ``folder``): only that folder's
    files are read, and it is part of what a saved state or index was made for."""
    import itertools

    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.sources.index import resolution_key
    from resumable_stream.testing import write_parquet_dataset

    root = tmp_path / "ds"
    write_parquet_dataset(str(root / "big"), rows=300, files=2, row_group_size=50)
    write_parquet_dataset(str(root / "small"), rows=40, files=1, row_group_size=20)
    cfg = StreamConfig(dataset_name_or_path=str(root), data_dir="small")
    stream = ResumableStream(cfg)
    stream.set_epoch(0)
    rows = list(itertools.islice(stream, 1000))
    assert len(rows) == 40
    assert all("/small/" in f["path"] for f in identities(stream.source.fingerprint["files"]))
    assert stream.source.fingerprint["data_dir"] == "small" and resolution_key(cfg.source_spec.data)["data_dir"] == "small"
    assert "data_dir" not in resolution_key(cfg.replace(data_dir=None).source_spec.data)   # unset: keys saved before it still match
