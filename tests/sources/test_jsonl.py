"""JSON lines read by us (sources/jsonl.py): the rows and features of datasets' json builder on the same files
(plain, .gz, .zst; nested fields, nulls, mixed types, blank lines, CRLF, a BOM), every shard readable from any
row while parsing only from there, bad lines as bad samples, the text checked against the index, and a resume
that reads one piece, not the file's prefix."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random

import pyarrow as pa
import pytest
import zstandard

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import BAD_SAMPLE_COLUMN, SourceError, StreamMismatchError
from resumable_stream.sources import jsonl_index, jsonl_rows, open_source
from resumable_stream.sources.index import decode_index, encode_index
from resumable_stream.stream.partition import _rows_of

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("hub_offline")]


def _rows(seed: int, n: int, first_id: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        row = {"id": first_id + i, "text": " ".join(rng.choice(["alpha", "beta", "γάμμα", "δ", "e\"q", "tab\t"])
                                                  for _ in range(rng.randint(1, 40))),
               "score": rng.choice([None, rng.random(), rng.randint(0, 9)]),       # ints and floats: a double
               "meta": {"url": f"http://x/{i}", "tags": [rng.choice("abc") for _ in range(rng.randint(0, 3))],
                        "lang": rng.choice([None, "en", "fr"])},
               "flag": rng.choice([True, False, None])}
        if rng.random() < 0.2:
            del row["flag"]                     # a key missing in some rows: None there
        out.append(row)
    return out


def _text(rows: list[dict], blank_every: int = 0, crlf: bool = False, bom: bool = False) -> bytes:
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r, ensure_ascii=i % 2 == 0))
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("  \t" if i % 2 else "")
    end = "\r\n" if crlf else "\n"
    data = end.join(lines).encode()                       # the last line has no newline
    return (b"\xef\xbb\xbf" + data) if bom else data


def _write(path: str, data: bytes, frames: int = 1) -> str:
    if path.endswith(".gz"):
        with open(path, "wb") as f:
            f.write(gzip.compress(data, 6))
    elif path.endswith(".zst"):
        c = zstandard.ZstdCompressor(level=3)
        step = max(1, -(-len(data) // frames))
        with open(path, "wb") as f:
            for i in range(0, len(data), step):
                f.write(c.compress(data[i:i + step]))
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def _theirs(files: list[str]):
    import datasets

    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    return list(ds.decode(False)), ds.features      # undecoded, as a stream's rows are (Json fields: text)


def _ours(files: list[str], **kw):
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=files, **kw).source_spec)
    assert type(src).__name__ == "JsonLinesSource"
    tables = [t for s in range(len(src.shards)) for t in src.read(s)]
    rows = [r for t in tables for r in _rows_of(t, t.num_rows)]
    return src, rows


def _clean(rows: list[dict]) -> list[dict]:
    assert all(BAD_SAMPLE_COLUMN not in r for r in rows)
    return rows


def _dated(rows: list[dict]) -> list[dict]:
    """The rows with a field of ISO dates (pyarrow's JSON reader makes it a timestamp column): features the
    lines way does not make, so the blocks way (pyarrow + the builder's cast) makes them."""
    return [{**r, "day": f"2020-01-{1 + r['id'] % 28:02d}"} for r in rows]


@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".json"])
def test_rows_and_features_equal_datasets_json_builder(tmp_path, ext):
    files = [_write(str(tmp_path / f"part-{i}{ext}"), _text(_rows(i, 300, i * 300), blank_every=7 * (i + 1),
                                                            crlf=i == 1, bom=i == 0)) for i in range(3)]
    theirs, features = _theirs(files)
    src, ours = _ours(files)
    assert src.index["features"] == features.to_dict()
    assert _clean(ours) == theirs
    assert len(ours) == 900 and sum(s.num_rows for s in src.shards) == 900


@pytest.mark.parametrize("ext", [".jsonl", ".jsonl.gz"])
def test_without_the_native_accelerators_the_rows_are_the_same(tmp_path, monkeypatch, ext):
    """orjson and isal are accelerators: without orjson every line is read the blocks way (pyarrow's reader and
    the builder's cast), without isal CRC-32 and inflate are zlib's; the rows and the index are the same."""
    import zlib

    files = [_write(str(tmp_path / f"part-{i}{ext}"), _text(_rows(i, 300, i * 300), blank_every=5)) for i in range(2)]
    theirs, features = _theirs(files)
    fast_src, fast = _ours(files)
    assert fast_src._lines
    monkeypatch.setattr(jsonl_rows, "has_orjson", lambda: False)
    monkeypatch.setattr(jsonl_index, "crc32", zlib.crc32)
    monkeypatch.setattr(jsonl_index, "_isal_decompressobj", None)
    src, ours = _ours(files)
    assert not src._lines
    assert _clean(ours) == theirs == fast
    assert src.index["files"] == fast_src.index["files"]


def test_mixed_struct_types_are_json_fields_as_datasets_makes_them(tmp_path):
    """datasets 5.x turns a field whose structure changes from row to row into a Json feature (its text in the rows,
    undecoded, as every feature of a stream's rows: decoding is the transform's)."""
    rows = [{"id": i, "payload": {"a": 1} if i % 2 else {"b": [1, 2]}} for i in range(50)]
    files = [_write(str(tmp_path / "mixed.jsonl"), _text(rows))]
    theirs, features = _theirs(files)
    src, ours = _ours(files)
    assert src.index["features"] == features.to_dict()
    assert _clean(ours) == theirs


def test_stream_rows_have_no_mark_and_resume_is_exact(tmp_path):
    files = [_write(str(tmp_path / f"p{i}.jsonl.zst"), _text(_rows(i, 400, i * 400))) for i in range(3)]
    cfg = StreamConfig(dataset_name_or_path="json", data_files=files, shuffle=True, buffer_size=64)
    first = ResumableStream(cfg)
    head = list(itertools.islice(first, 333))
    state = first.state_dict()
    tail = list(itertools.islice(first, 300))
    first.close()
    assert all(BAD_SAMPLE_COLUMN not in r for r in head + tail)
    again = ResumableStream(cfg)
    again.load_state_dict(state)
    assert list(itertools.islice(again, 300)) == tail
    again.close()


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(jsonl_index, "PIECE_MAX_BYTES", 8 << 10)
    monkeypatch.setattr(jsonl_index, "PIECE_MAX_ROWS", 50)
    monkeypatch.setattr(jsonl_index, "POINT_SLACK", 64 << 10)
    monkeypatch.setattr(jsonl_index, "GZIP_SPACING", 40 << 10)       # (indexed_gzip: more than its 32 KiB window)
    monkeypatch.setattr(jsonl_index, "INPUT_CHUNK", 4 << 10)


@pytest.mark.parametrize("way", ["lines", "blocks"])
@pytest.mark.parametrize("ext,frames", [(".jsonl", 1), (".jsonl.gz", 1), (".jsonl.zst", 1), (".jsonl.zst", 7)])
def test_every_shard_reads_from_any_row_parsing_only_from_there(tmp_path, small_pieces, monkeypatch, ext, frames,
                                                                way):
    n = 5000 if ext.endswith(".gz") else 1500
    rows = _rows(3, n) if way == "lines" else _dated(_rows(3, n))
    path = _write(str(tmp_path / f"big{ext}"), _text(rows, blank_every=11), frames)
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
    assert src._lines == (way == "lines")
    theirs = _theirs([path])[0]
    entry = src.index["files"][0]
    assert entry["rows"] == n and len(entry["pieces"]) > 5
    if ext == ".jsonl.gz":                            # points inside a byte: the inflate's input is shifted
        assert any(p[2] for p in entry["points"])
    if ext == ".jsonl.zst" and frames == 1:
        assert len(src.shards) == 1                   # one frame: one access point, one shard
    else:
        assert len(src.shards) > 2
    parsed = []
    real_parse = jsonl_rows.Blocks.parse
    monkeypatch.setattr(jsonl_rows.Blocks, "parse", lambda self, block: parsed.append(block) or real_parse(self, block))
    rng = random.Random(1)
    start = 0
    for s, info in enumerate(src.shards):
        for row in sorted({0, info.num_rows - 1, *(rng.randrange(info.num_rows) for _ in range(3))}):
            parsed.clear()
            tables = list(src.read(s, row))
            got = [r for t in tables for r in _rows_of(t, t.num_rows)]
            assert _clean(got) == theirs[start + row:start + info.num_rows]
            # nothing before the row was parsed: the first block parsed (the lines way: the first line handed on,
            # parsed when it is used) begins with the row's own line
            first = parsed[0] if way == "blocks" else tables[0].column(0)[0].as_py()
            assert way == "lines" or all(t.schema.names[0] != jsonl_rows.LINE_COLUMN for t in tables)
            assert first.lstrip(b"\xef\xbb\xbf").startswith(json.dumps(rows[start + row],
                                                                       ensure_ascii=(start + row) % 2 == 0)
                                                            .encode()[:40])
        start += info.num_rows
    assert start == n


def test_a_gzip_file_of_several_members_reads_from_any_row(tmp_path, small_pieces):
    """Gzip members one after another (``cat a.gz b.gz``, cut anywhere, even inside a line): every shard read from
    any row gives datasets' rows (the inflate goes on into the next member, whose start the index need not hold:
    found after the member's trailer, from a point inside a byte too)."""
    rows = _rows(8, 3000)
    data = _text(rows, blank_every=13)
    cuts = [0, 1, 4097, 4098, 70001, 150000, len(data) // 2 + 3, len(data)]
    path = str(tmp_path / "members.jsonl.gz")
    with open(path, "wb") as f:
        for a, b in zip(cuts, cuts[1:]):
            f.write(gzip.compress(data[a:b], 6))
    theirs = _theirs([path])[0]
    src, ours = _ours([path])
    assert _clean(ours) == theirs
    start = 0
    rng = random.Random(2)
    for s, info in enumerate(src.shards):
        for row in {0, info.num_rows - 1, rng.randrange(info.num_rows)}:
            got = [r for t in src.read(s, row) for r in _rows_of(t, t.num_rows)]
            assert got == theirs[start + row:start + info.num_rows]
        start += info.num_rows
    assert start == len(rows)


def test_the_next_member_is_found_from_a_point_inside_a_byte(tmp_path, small_pieces):
    """The inflate started at an access point inside a byte (its input shifted) goes on into a member that follows:
    the text from the point on, through the second member's."""
    from resumable_stream.sources.jsonl import _Inflate

    first, second = _text(_rows(9, 5000), blank_every=11) + b"\n", _text(_rows(10, 300)) + b"\n"
    path = _write(str(tmp_path / "a.jsonl.gz"), first)
    entry = dict(_ours([path])[0].index["files"][0])
    with open(path, "rb") as f:
        data = f.read() + gzip.compress(second, 6)
    entry["size"] = len(data)
    text = first + second
    shifted = [i for i, p in enumerate(entry["points"]) if p[2]]
    assert shifted
    for i in shifted:
        inflate, out = _Inflate(entry, i, lambda a, b: data[a:b]), []
        want = len(text) - entry["points"][i][0]
        while want:
            out.append(inflate.more(entry["size"], want))
            want -= len(out[-1])
        assert b"".join(out) == text[entry["points"][i][0]:]


@pytest.mark.parametrize("words", [1 << 15, 1, 2, 7])
def test_a_deflate_stream_inside_a_byte_is_shifted_as_its_bits(monkeypatch, words):
    """A gzip access point inside a byte: the compressed bytes handed on in parts of any size (the first byte of the
    first part being the carry) come out as the bit stream from that bit on, byte-aligned (checked against Python
    integers), shifted ``words`` 64-bit words at a time."""
    from resumable_stream.sources import jsonl
    from resumable_stream.sources.jsonl import _shifted

    monkeypatch.setattr(jsonl, "_SHIFT_WORDS", words)
    rng = random.Random(5)
    data = bytes(rng.randrange(256) for _ in range(3001))
    for shift in range(1, 8):
        want = (int.from_bytes(data, "little") >> shift).to_bytes(len(data), "little")[:len(data) - 1]
        for sizes in ([3001], [1, 2000, 1000], [8, 7, 1, 9, 2976], [1] * 40 + [2961]):
            got, carry, at = [], None, 0
            for size in sizes:
                out, carry = _shifted(data[at:at + size], shift, carry)
                got.append(bytes(out))
                at += size
            assert b"".join(got) == want and carry == data[-1]


def test_a_resume_reads_one_piece_not_the_prefix(tmp_path, small_pieces, monkeypatch):
    """A shard reopened at a row reads its bytes from the row's piece (plain, gzip: its own access point)."""
    from resumable_stream.io import ranged
    from resumable_stream.sources import base  # where jsonl's ranged reads are made (base.fetcher)

    for ext in (".jsonl", ".jsonl.gz"):
        path = _write(str(tmp_path / f"r{ext}"), _text(_rows(5, 5000)))
        src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
        read = []
        real = ranged.read_range
        monkeypatch.setattr(base, "read_range",
                            lambda p, a, b, *x, read=read, real=real: read.append(b - a) or real(p, a, b, *x))
        last = len(src.shards) - 1
        next(iter(src.read(last, src.shards[last].num_rows - 2)))
        entry = src.index["files"][0]
        biggest = max((p[2] - p[1]) if ext == ".jsonl" else (p[5] - entry["points"][p[4]][1])
                      for p in entry["pieces"])
        assert sum(read) <= biggest + jsonl_index.INPUT_CHUNK, (ext, read, biggest)
        assert sum(read) < os.path.getsize(path) / 5
        monkeypatch.setattr(base, "read_range", real)


def test_bad_lines_are_bad_samples_and_good_rows_stay_datasets_rows(tmp_path):
    rows = _rows(9, 30)
    lines = [json.dumps(r) for r in rows]
    lines[3] = '{"id": 3, "text": "cut'                  # does not parse
    lines[10] = "[1, 2, 3]"                               # no object
    lines[17] = '{"id": 17} {"id": 18}'                   # two values on one line
    path = _write(str(tmp_path / "bad.jsonl"), "\n".join(lines).encode() + b"\n")
    src, ours = _ours([path])
    assert len(ours) == 30
    bad = {i: r[BAD_SAMPLE_COLUMN] for i, r in enumerate(ours) if r.get(BAD_SAMPLE_COLUMN) is not None}
    assert sorted(bad) == [3, 10, 17]
    assert bad[3].startswith(f"data file {path!r}: row 3") and "is not JSON" in bad[3]
    assert "not an object" in bad[10] and "is not JSON" in bad[17]
    assert all(ours[i][c] is None for i in bad for c in src.column_names)
    good = [r for i, r in enumerate(ours) if i not in bad]
    want = [r for i, r in enumerate(rows) if i not in bad]
    assert [r["id"] for r in good] == [r["id"] for r in want]
    assert [r["text"] for r in good] == [r["text"] for r in want]
    # through the stream: the mark only on the bad rows; the text transform's bad_sample: skip drops them
    stream = ResumableStream(StreamConfig(dataset_name_or_path="json", data_files=[path]))
    got = list(itertools.islice(stream, 30))
    stream.close()
    assert [i for i, r in enumerate(got) if BAD_SAMPLE_COLUMN in r] == [3, 10, 17]


def test_text_that_differs_from_the_index_is_never_a_row(tmp_path):
    path = _write(str(tmp_path / "x.jsonl"), _text(_rows(2, 200)))
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2
    data[at:at + 5] = b"ZZZZZ" if data[at:at + 5] != b"ZZZZZ" else b"YYYYY"      # same size
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))              # and the same mtime
    with pytest.raises(StreamMismatchError, match="x.jsonl.*on two reads"):
        [t for s in range(len(src.shards)) for t in src.read(s)]


def test_a_rewritten_local_file_is_named_on_resume(tmp_path):
    path = _write(str(tmp_path / "y.jsonl"), _text(_rows(4, 200)))
    cfg = StreamConfig(dataset_name_or_path="json", data_files=[path], shuffle=True, buffer_size=32)
    first = ResumableStream(cfg)
    list(itertools.islice(first, 50))
    first.save_sidecar(str(tmp_path / "state"))
    first.close()
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[2:4] = b"ID" if data[2:4] != b"ID" else b"XX"
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = ResumableStream(cfg, index_from=str(tmp_path / "state"))
    with pytest.raises(StreamMismatchError, match="y.jsonl.*head"):
        again.load_sidecar(str(tmp_path / "state"))


def test_the_index_round_trips_and_a_forged_one_is_refused(tmp_path):
    path = _write(str(tmp_path / "z.jsonl.gz"), _text(_rows(6, 100)))
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
    data = encode_index(src.index)
    assert decode_index(data, "here")["files"] == src.index["files"]
    index = json.loads(data)
    index["files"][0]["pieces"][0][2] = index["files"][0]["length"] + 10        # past the file's text
    with pytest.raises(SourceError, match="is not inside the file"):
        decode_index(json.dumps(index).encode(), "forged")


@pytest.mark.parametrize("ext", [".json", ".json.gz"])
def test_a_json_array_file_is_read_by_datasets(tmp_path, ext):
    rows = _rows(7, 20)
    path = _write(str(tmp_path / f"array{ext}"), json.dumps(rows, indent=1).encode())
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
    assert type(src).__name__ != "JsonLinesSource"
    got = [r for s in range(len(src.shards)) for t in src.read(s) for r in t.to_pylist()]
    import datasets

    assert got == list(datasets.load_dataset("json", data_files=[path], split="train", streaming=True))


def test_other_compressions_are_read_by_datasets(tmp_path):
    import bz2

    path = str(tmp_path / "c.jsonl.bz2")
    with open(path, "wb") as f:
        f.write(bz2.compress(_text(_rows(8, 20))))
    src = open_source(StreamConfig(dataset_name_or_path="json", data_files=[path]).source_spec)
    assert type(src).__name__ != "JsonLinesSource"


def test_the_marker_column_is_omitted_only_where_null():
    marker = jsonl_rows.marker_field()
    table = pa.table({"a": [1, 2]}).append_column(marker, pa.array([None, "why"], pa.string()))
    assert _rows_of(table, 2) == [{"a": 1}, {"a": 2, BAD_SAMPLE_COLUMN: "why"}]
    plain = pa.table({"a": [1], BAD_SAMPLE_COLUMN: pa.array([None], pa.string())})      # webdataset's: kept
    assert _rows_of(plain, 1) == [{"a": 1, BAD_SAMPLE_COLUMN: None}]


def test_large_rows_permuted_as_python_objects_come_out_the_same(tmp_path, monkeypatch):
    """Windows of large rows are permuted as Python objects (no Arrow take copying the text): the same samples."""
    from resumable_stream.stream import partition

    files = [_write(str(tmp_path / f"l{i}.jsonl"), _text(_rows(i, 300, i * 300))) for i in range(3)]
    cfg = StreamConfig(dataset_name_or_path="json", data_files=files, shuffle=True, buffer_size=100)

    def read(large: int) -> list[dict]:
        monkeypatch.setattr(partition, "LARGE_ROW_BYTES", large)
        stream = ResumableStream(cfg)
        try:
            return list(itertools.islice(stream, 700))
        finally:
            stream.close()

    assert read(0) == read(1 << 40)


def test_features_where_datasets_infers_none_while_streaming(tmp_path, monkeypatch):
    """datasets 4.x streams JSON without features: the first block's, as its IterableDataset resolves them."""
    import datasets

    path = _write(str(tmp_path / "f.jsonl"), _text(_rows(3, 50)))
    monkeypatch.setattr(datasets.builder.DatasetBuilder, "as_streaming_dataset",
                        lambda self, split=None, **k: type("Stream", (), {"features": None})())
    src, ours = _ours([path])
    assert datasets.Features.from_dict(src.index["features"]) == datasets.Features.from_arrow_schema(
        pa.Table.from_pylist(_theirs_plain(path)).schema)
    assert [r["id"] for r in _clean(ours)] == list(range(50))


def _theirs_plain(path: str) -> list[dict]:
    import pyarrow.json as paj

    return paj.read_json(path).to_pylist()


@pytest.mark.parametrize("ext,frames", [(".jsonl", 1), (".jsonl.gz", 1), (".jsonl.zst", 5)])
def test_over_http_the_same_rows_and_no_byte_fetched_twice(tmp_path, small_pieces, ext, frames):
    """Over the loopback server: the rows of the local files, in the same order; reading an epoch from a built
    index fetches each compressed byte about once (what a piece's decompression needs beyond its end: a few KiB)."""
    from http_server import FileServer

    d = tmp_path / "site"
    d.mkdir()
    paths = [_write(str(d / f"p{i}{ext}"), _text(_rows(i, 2500, i * 2500)), frames) for i in range(2)]
    size = sum(os.path.getsize(p) for p in paths)
    with FileServer(str(d)) as srv:
        urls = [srv.url(os.path.basename(p)) for p in paths]
        kw = {"shuffle": True, "buffer_size": 200, "retries": 2, "timeout_s": 10}
        remote = StreamConfig(dataset_name_or_path="json", data_files=urls, index_path=str(tmp_path / "i.json"), **kw)
        ResumableStream(remote).close()                         # builds and writes the index
        srv.reset_stats()
        s = ResumableStream(remote)
        got = list(itertools.islice(s, 5000))
        s.close()
        served = srv.stats()["bytes_sent"]
    local = ResumableStream(StreamConfig(dataset_name_or_path="json", data_files=paths, **kw))
    want = list(itertools.islice(local, 5000))
    local.close()
    assert [r["id"] for r in got] == [r["id"] for r in want] and got == want
    assert served <= 1.1 * size + 64 * jsonl_index.INPUT_CHUNK, (served, size)


def test_the_block_cache_changes_nothing(tmp_path):
    """Cold or warm block cache: the same rows, the bad-sample mark still only on the bad rows."""
    lines = [json.dumps(r) for r in _rows(11, 200)]
    lines[7] = "{not json"
    path = _write(str(tmp_path / "c.jsonl.zst"), "\n".join(lines).encode())
    base = {"dataset_name_or_path": "json", "data_files": [path], "shuffle": True, "buffer_size": 50}
    plain = ResumableStream(StreamConfig(**base))
    want = list(itertools.islice(plain, 200))
    plain.close()
    for _ in range(2):                                  # cold, then warm
        s = ResumableStream(StreamConfig(**base, cache_dir=str(tmp_path / "cache")))
        assert list(itertools.islice(s, 200)) == want
        s.close()
    assert sum(BAD_SAMPLE_COLUMN in r for r in want) == 1


def test_the_lines_way_gives_datasets_rows_for_odd_but_valid_lines(tmp_path, monkeypatch):
    """Rows made with orjson (the lines way) equal the json builder's on lines that take its casts: keys in another
    order or missing, ints in a float column and in lists of floats, numbers past what a
    float holds exactly, escapes and surrogate pairs, empty and null values, an all-null column. A line that does not
    fit simply is made alone the builder's way."""
    lines = []
    for i in range(400):
        row = {"id": i, "score": [1.5, i, 2 ** 53 + 1, -0.0, 1e300][i % 5], "nothing": None,
               "text": ["plain", "\u00e9t\u00e9", "emoji \U0001F600", "", 'quote " and \\ back'][i % 5],
               "meta": {"w": [1, 2.5, i][: i % 4], "lang": None if i % 3 else "en", "deep": {"k": i % 7}},
               "flag": [True, False, None][i % 3]}
        if i % 7 == 2:
            del row["flag"]                                # a missing top-level key: None
        if i % 11 == 3:
            row = dict(reversed(list(row.items())))        # keys in another order
        if i % 13 == 4:
            row["meta"] = None
        lines.append(json.dumps(row, ensure_ascii=i % 2 == 0))
    lines[5] = lines[5].replace('"score": 1e+300', '"score": 1E+300')
    # a byte-order mark before the first line: orjson refuses it, pyarrow reads past it
    path = _write(str(tmp_path / "odd.jsonl"), b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())
    alone = []
    real = jsonl_rows._row_alone
    monkeypatch.setattr(jsonl_rows, "_row_alone", lambda *a: alone.append(a[2]) or real(*a))
    theirs, features = _theirs([path])
    src, ours = _ours([path])
    assert src._lines and src.index["features"] == features.to_dict()
    assert _clean(ours) == theirs
    assert [list(r) for r in ours] == [list(r) for r in theirs]          # the keys in the same order too
    assert alone == [0]                                                   # only the line orjson refuses


def test_the_lines_way_fills_and_orders_nested_keys_as_datasets(tmp_path):
    """Features inferred from the first file (a struct); a later file's objects miss a key of it or give its keys in
    another order: None there, the features' order, as the builder's cast makes them."""
    first = [{"id": i, "m": {"x": i, "y": "a", "z": [i, 0.5]}} for i in range(20)]
    later = [{"id": i, "m": {"x": i} if i % 2 else {"z": [], "y": "q", "x": 1}} for i in range(20)]
    files = [_write(str(tmp_path / "a.jsonl"), _text(first)), _write(str(tmp_path / "b.jsonl"), _text(later))]
    theirs, features = _theirs(files)
    src, ours = _ours(files)
    assert src._lines and src.index["features"] == features.to_dict()
    assert _clean(ours) == theirs
    assert [list(r["m"]) for r in ours] == [list(r["m"]) for r in theirs] == [["x", "y", "z"]] * 40


def test_items_of_several_tables_in_any_order_are_their_rows(tmp_path):
    """A window's items number the rows of its tables one table after another (partition.py): item
    ``sum(sizes[:k]) + j`` is row j of table k, whatever order they are made in and whichever table is read first;
    a table of another length than planned is an error, never rows of the wrong lines."""
    features = {"id": {"dtype": "int64", "_type": "Value"}, "text": {"dtype": "string", "_type": "Value"}}
    fj = json.dumps(features, separators=(",", ":")).encode()
    tables, want = [], []
    for k, n in enumerate([5, 1, 9, 3]):
        rows = [{"id": k * 100 + j, "text": f"t{k}.{j}"} for j in range(n)]
        text = "".join(json.dumps(r) + "\n" for r in rows).encode()
        tables.append(jsonl_rows.lines_table(text, jsonl_rows.row_starts(text, 0, n), f"f{k}", 0, fj))
        want += rows
    read = []

    def table_of(k):
        read.append(k)
        return tables[k]

    make = jsonl_rows.items_maker(tables[0].schema, [t.num_rows for t in tables], table_of)
    order = random.Random(3).sample(range(len(want)), len(want))
    assert [make(i) for i in order] == [want[i] for i in order]
    assert sorted(read) == [0, 1, 2, 3] and read[0] != 0          # each table read once, as first needed
    short = jsonl_rows.items_maker(tables[0].schema, [5, 2], lambda k: tables[k])
    assert short(0) == want[0]
    with pytest.raises(SourceError, match="1 rows where 2 were planned"):
        short(5)
