"""Bytes are verified before they become rows or cache blocks (issue 20, item 1; DESIGN principle 9).

The lying servers here are the loopback FileServer's (tests/_support/http_server.py): ``ranges_from`` answers the
ranged GETs of one file with another file's bytes under the first file's own headers (a CDN or proxy with a
broken cache key), ``honour_if_match`` makes it ignore If-Match as plain file servers do. The two files
have the same layout (byte spans of every row group) and different rows, so that only the checks of the
decoded rows against the footer can tell them apart.
"""

from __future__ import annotations

import io
import itertools
import os
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from http_server import FileServer

from resumable_stream import ResumableStream, SourceError, StreamConfig, StreamMismatchError
from resumable_stream.app.warmup import run_warmup
from resumable_stream.cache import CachedSource
from resumable_stream.sources import open_source
from resumable_stream.sources import parquet_checks as row_group_check
from resumable_stream.sources.parquet_footer import row_group_layout

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]

ROWS, GROUP = 4000, 500          # per file: 8 row groups


def _table(first_id: int) -> pa.Table:
    ids = list(range(first_id, first_id + ROWS))
    return pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {i:07d}" for i in ids]})


def _write(path: str, first_id: int, **kw) -> None:
    # no compression, no dictionary, fixed-width values: two files of other rows have the same byte layout
    pq.write_table(_table(first_id), path, row_group_size=GROUP, compression="none", use_dictionary=False, **kw)


@pytest.fixture()
def site(tmp_path):
    d = tmp_path / "www"
    d.mkdir()
    _write(str(d / "a.parquet"), 0)
    _write(str(d / "b.parquet"), 5_000_000)
    layouts = [row_group_layout(pq.read_metadata(d / n)) for n in ("a.parquet", "b.parquet")]
    assert [rg[1:] for rg in layouts[0]] == [rg[1:] for rg in layouts[1]]   # the same byte spans
    with FileServer(d) as srv:
        yield srv, d


def _config(srv: FileServer, **kw) -> StreamConfig:
    kw.setdefault("retry_backoff_s", 0.05)
    kw.setdefault("timeout_s", 10.0)
    return StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url("a.parquet")], shuffle=False, **kw)


def _ranged_gets(srv: FileServer) -> list:
    return [r for r in srv.requests if r.method == "GET" and r.range]


def test_another_files_bytes_are_refused_naming_file_and_row_group(site):
    srv, _ = site
    source = open_source(_config(srv, prefetch_blocks=0).source_spec)          # the index (footers) from the true file
    srv.ranges_from = {"a.parquet": "b.parquet"}
    before = len(_ranged_gets(srv))
    stream = ResumableStream(_config(srv, prefetch_blocks=0), source=source)
    yielded = []
    with pytest.raises(SourceError) as err:
        for row in stream:
            yielded.append(row["id"])
    assert yielded == []                                           # not one row of the other file
    text = str(err.value)
    assert srv.url("a.parquet") in text and "row group 0" in text and "footer" in text
    assert "column 'id'" in text
    assert len(_ranged_gets(srv)) - before == 2                    # read once more from the source, then refused


def test_one_wrong_answer_is_read_again_and_every_row_is_right(site):
    srv, _ = site
    source = open_source(_config(srv, prefetch_blocks=0).source_spec)
    gets = []

    def lie_once(rec):               # the proxy lies to the first ranged GET only (faults run before answering)
        if rec.range:
            gets.append(rec)
            if len(gets) == 2:
                srv.ranges_from = {}
        return None

    srv.ranges_from = {"a.parquet": "b.parquet"}
    srv.faults.append(lie_once)
    ids = [r["id"] for r in itertools.islice(ResumableStream(_config(srv, prefetch_blocks=0), source=source), ROWS)]
    assert ids == list(range(ROWS))
    assert len(gets) == 8 + 1                                      # 8 row groups, one of them read twice


def test_prefetched_wrong_bytes_are_refused_too(site):
    srv, _ = site
    source = open_source(_config(srv, prefetch_blocks=4).source_spec)
    srv.ranges_from = {"a.parquet": "b.parquet"}
    with pytest.raises(SourceError, match="row group"):
        list(itertools.islice(ResumableStream(_config(srv, prefetch_blocks=4), source=source), ROWS))


def test_a_warmup_through_a_lying_proxy_caches_nothing_wrong(site, tmp_path):
    srv, _ = site
    cfg = _config(srv, cache_dir=str(tmp_path / "cache"))
    source = open_source(cfg.source_spec)
    srv.ranges_from = {"a.parquet": "b.parquet"}
    with pytest.raises(SourceError, match="row group"):
        run_warmup(cfg, ROWS, source=CachedSource(source, cfg.cache_spec), progress=False)
    srv.ranges_from = {}                                           # the server is fixed
    ids = [r["id"] for r in itertools.islice(ResumableStream(cfg, source=source), ROWS)]
    assert ids == list(range(ROWS))


def _rewrite_in_place(path: str) -> None:
    """Same size, other rows, a new mtime (and so a new ETag): an S3 / HTTP overwrite."""
    before = os.path.getsize(path)
    tmp = path + ".new"
    _write(tmp, 6_000_000)
    assert os.path.getsize(tmp) == before
    st = os.stat(path)
    os.replace(tmp, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.mark.parametrize("honour_if_match", [True, False], ids=["if-match-412", "etag-compared"])
def test_an_object_rewritten_mid_epoch_is_a_mismatch(site, honour_if_match):
    srv, d = site
    srv.honour_if_match = honour_if_match
    cfg = _config(srv, prefetch_blocks=0)
    stream = ResumableStream(cfg)
    it = iter(stream)
    first = [next(it)["id"] for _ in range(GROUP)]                 # row group 0 read from the true file
    assert first == list(range(GROUP))
    _rewrite_in_place(str(d / "a.parquet"))
    more = []
    with pytest.raises(StreamMismatchError) as err:
        for row in it:
            more.append(row["id"])
    assert all(i < ROWS for i in more)                             # none of the new object's rows
    assert "modified" in str(err.value) and srv.url("a.parquet") in str(err.value)
    statuses = [r.status for r in _ranged_gets(srv)]
    assert (412 in statuses) == honour_if_match


def test_a_local_file_rewritten_mid_epoch_is_a_mismatch(tmp_path):
    path = str(tmp_path / "a.parquet")
    _write(path, 0)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[path], shuffle=False, prefetch_blocks=0)
    it = iter(ResumableStream(cfg))
    assert [next(it)["id"] for _ in range(GROUP)] == list(range(GROUP))
    _rewrite_in_place(path)
    with pytest.raises(StreamMismatchError, match="modified"):
        for row in it:
            assert row["id"] < ROWS


def test_a_server_that_ignores_range_is_named_at_its_first_answer(tmp_path):
    """The real ``python -m http.server`` (SimpleHTTPRequestHandler): no Range support at all."""
    import functools
    import http.server
    import threading

    _write(str(tmp_path / "a.parquet"), 0)
    seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            seen.append(self.command)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/a.parquet"
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[url], retry_backoff_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(SourceError) as err:
            ResumableStream(cfg)
        assert time.monotonic() - t0 < 5                         # no retries
        assert url in str(err.value) and "Range" in str(err.value) and "HTTP 200" in str(err.value)
        # the GET of a file's last bytes answered 200 (the whole file, not read) sends it the usual way: a HEAD,
        # then a ranged GET, whose 200 names the server
        assert seen == ["GET", "HEAD", "GET"]
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------------------- the footer checks themselves
def _file(table: pa.Table, **kw) -> pq.ParquetFile:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    return pq.ParquetFile(io.BytesIO(buf.getvalue()))


def test_every_row_group_of_a_varied_file_passes_its_own_footer():
    import datetime
    import decimal

    n = 60
    table = pa.table({
        "i8": pa.array([i - 30 for i in range(n)], pa.int8()),
        "u64": pa.array([2**63 + i for i in range(n)], pa.uint64()),
        "f": pa.array([float("nan") if i % 5 == 0 else (None if i % 7 == 0 else i / 3) for i in range(n)]),
        "b": [i % 2 == 0 for i in range(n)],
        "s": [f"x{i}" if i % 3 else None for i in range(n)],
        "bin": [bytes([i, 255 - i]) for i in range(n)],
        "ts": pa.array([datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
                        + datetime.timedelta(seconds=i) for i in range(n)], pa.timestamp("ms", tz="UTC")),
        "dur": pa.array(list(range(n)), pa.duration("s")),
        "dec": pa.array([decimal.Decimal(f"{i}.5") for i in range(n)], pa.decimal128(8, 2)),
        "dict": pa.array([f"c{i % 4}" for i in range(n)]).dictionary_encode(),
        "messages": [[{"role": "user", "content": f"hi {i}"}] if i % 4 else None for i in range(n)],
        "meta": [{"a": i, "b": None if i % 2 else "y"} for i in range(n)],
        "tags": pa.array([[("k", i)] for i in range(n)], pa.map_(pa.string(), pa.int64())),
    })
    for options in ({}, {"use_dictionary": False}, {"write_page_checksum": True}):
        pf = _file(table, row_group_size=20, **options)
        for g in range(pf.metadata.num_row_groups):
            assert row_group_check.problem(pf.read_row_group(g), pf.metadata, g) is None


@pytest.mark.parametrize("column", ["i8", "s", "messages", "meta"])
def test_a_row_group_decoded_against_another_ones_footer_is_caught(column):
    n = 40
    values = {"i8": pa.array(list(range(n)), pa.int8()), "s": [f"s{i:03d}" for i in range(n)],
              "messages": [[{"content": f"m{i:03d}"}] for i in range(n)],
              "meta": [{"a": None if i < 20 and i % 2 else i} for i in range(n)]}
    pf = _file(pa.table({column: values[column]}), row_group_size=20)
    assert row_group_check.problem(pf.read_row_group(1), pf.metadata, 0) is not None
    assert row_group_check.problem(pf.read_row_group(0).slice(0, 10), pf.metadata, 0) == \
        "10 rows decoded, the footer says 20"


def test_a_truncating_writers_string_bounds_are_bounds_not_values():
    """Other writers may store a prefix as min and a bigger string as max: decoded values inside them pass."""
    pf = _file(pa.table({"s": ["apple pie", "banana split"]}))
    md = pf.metadata

    class Stats:
        has_null_count, null_count, has_min_max, min, max = True, 0, True, "apple", "bananb"

    class Column:
        statistics, path_in_schema = Stats(), "s"

    class Group:
        num_rows, num_columns = 2, 1

        def column(self, j):
            return Column()

    class Other:
        created_by = "parquet-rs version 54.0.0"

        def row_group(self, g):
            return Group()

    assert row_group_check.problem(pf.read_row_group(0), Other(), 0) is None
    assert row_group_check.problem(pf.read_row_group(0), md, 0) is None
    Stats.max = "b"
    assert "outside" in row_group_check.problem(pf.read_row_group(0), Other(), 0)


def test_a_corrupt_page_of_a_local_file_is_refused_after_one_more_read(tmp_path):
    path = str(tmp_path / "a.parquet")
    _write(path, 0, write_page_checksum=True)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[path], shuffle=False, prefetch_blocks=0)
    source = open_source(cfg.source_spec)
    _, start, end = source.index["files"][0]["row_groups"][2]
    st = os.stat(path)
    with open(path, "r+b") as f:                 # one flipped byte in row group 2's data, size and mtime kept
        f.seek((start + end) // 2)
        byte = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    ids = []
    with pytest.raises(SourceError, match=r"row group 2.*(CRC|checksum|footer|decode)"):
        for row in ResumableStream(cfg, source=source):
            ids.append(row["id"])
    assert not [i for i in ids if 2 * GROUP <= i < 3 * GROUP]     # nothing of the damaged row group


def test_blocks_cached_by_an_older_format_are_not_served(tmp_path, monkeypatch):
    """A block of the format before verification existed lives in another namespace: a miss, then re-read."""
    from resumable_stream.cache import store

    path = str(tmp_path / "a.parquet")
    _write(path, 0)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[path], shuffle=False,
                       cache_dir=str(tmp_path / "cache"))
    source = open_source(cfg.source_spec)
    with monkeypatch.context() as m:
        m.setattr(store, "FORMAT", "rs-block-v2")
        old = CachedSource(source, cfg.cache_spec)
        old.store.put(0, 0, _table(5_000_000).slice(0, old.block_rows), False)
        old.close()
    fresh = CachedSource(source, cfg.cache_spec)
    assert fresh.store.ns != old.store.ns
    ids = [r["id"] for r in itertools.islice(ResumableStream(cfg, source=fresh), 10)]
    assert ids == list(range(10)) and fresh.stats()["hits"] == 0


def test_the_checks_leave_the_copied_dataset_alone(tmp_path):
    """A byte-identical copy of the files elsewhere reads as before (the index is rebuilt for the copy)."""
    a = tmp_path / "a"
    a.mkdir()
    _write(str(a / "a.parquet"), 0)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for d in (a, b):
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[str(d / "a.parquet")], shuffle=False)
        assert [r["id"] for r in itertools.islice(ResumableStream(cfg), ROWS)] == list(range(ROWS))
