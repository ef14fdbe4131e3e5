"""Real ``datasets`` streaming over plain http(s) URLs, served by a loopback file server.

Nothing here touches the network beyond 127.0.0.1: the data is generated into a temp dir
and served by ``tests/http_server.FileServer`` (HTTP/1.1, Range, ETag, Last-Modified), and
the Hub is forced offline for the whole module. ``HF_HUB_OFFLINE`` does not block plain
http data files in ``datasets`` 5.x (it only guards Hub / ``cached_path`` downloads), so no
workaround is needed; forcing it on here proves that.
"""

from __future__ import annotations

import email.utils
import http.client
import itertools
import os
import re
import shutil
import socket

import pyarrow.parquet as pq
import pytest
import torch.utils.data
from http_server import FileServer, file_etag

from resumable_stream import ConfigError, ResumableStream, SourceError, StreamConfig, StreamMismatchError
from resumable_stream.sources import open_source
from resumable_stream.sources.fingerprint_files import identities
from resumable_stream.testing import write_jsonl_dataset, write_parquet_dataset

PARQUET_ROWS, PARQUET_FILES, ROW_GROUP = 480, 3, 40      # 12 row groups -> 12 shards
JSONL_ROWS, JSONL_FILES = 400, 4
BUFFER = 64
BUILDER = {"parquet": "parquet", "jsonl": "json"}

# A stuck connection or a forked worker deadlock must fail fast, not eat the 300 s default.
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("hub_offline")]


# ---------------------------------------------------------------------------- fixtures
# hub_offline (the Hub made unreachable) comes from conftest.py
class Site:
    """A served dataset: the server, the local files and their URLs (in order)."""

    def __init__(self, srv: FileServer, paths: list[str], fmt: str):
        self.srv, self.paths, self.fmt = srv, paths, fmt
        self.urls = [srv.url(os.path.basename(p)) for p in paths]
        self.source = None                  # an opened Source, shared by tests that don't test opening
        self.reference: list[int] | None = None

    def config(self, **kw) -> StreamConfig:
        kw.setdefault("shuffle", True)
        kw.setdefault("buffer_size", BUFFER)
        kw.setdefault("retry_backoff_s", 0.05)   # a loopback hiccup is retried at once, not after seconds
        kw.setdefault("timeout_s", 10.0)
        return StreamConfig(dataset_name_or_path=BUILDER[self.fmt], data_files=list(self.urls), **kw)


def _write(fmt: str, directory: str, rows: int | None = None) -> list[str]:
    if fmt == "parquet":
        return write_parquet_dataset(directory, rows=rows or PARQUET_ROWS, files=PARQUET_FILES,
                                     row_group_size=ROW_GROUP)
    return write_jsonl_dataset(directory, rows=rows or JSONL_ROWS, files=JSONL_FILES)


def _rows(fmt: str) -> int:
    return PARQUET_ROWS if fmt == "parquet" else JSONL_ROWS


@pytest.fixture(scope="module")
def parquet_site(tmp_path_factory):
    d = tmp_path_factory.mktemp("http_parquet")
    paths = _write("parquet", str(d))
    with FileServer(d) as srv:
        yield Site(srv, paths, "parquet")


@pytest.fixture(scope="module")
def jsonl_site(tmp_path_factory):
    d = tmp_path_factory.mktemp("http_jsonl")
    paths = _write("jsonl", str(d))
    with FileServer(d) as srv:
        yield Site(srv, paths, "jsonl")


@pytest.fixture
def fresh_site(tmp_path):
    """A private served copy (function scope) for tests that modify or delete files."""
    sites: list[FileServer] = []

    def make(fmt: str) -> Site:
        d = tmp_path / f"site_{fmt}"
        paths = _write(fmt, str(d))
        srv = FileServer(d).start()
        sites.append(srv)
        return Site(srv, paths, fmt)

    yield make
    for srv in sites:
        srv.stop()


def _site(request, fmt: str) -> Site:
    return request.getfixturevalue(f"{fmt}_site")


def _shared_source(site: Site):
    """One opened Source per site, reused where a test does not exercise opening itself."""
    if site.source is None:
        site.source = open_source(site.config().source_spec)
    return site.source


def _take(stream, n: int) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


AFTER = 96   # rows compared after a resume


def _reference(site: Site) -> list[int]:
    """The uninterrupted (endless) stream: one epoch plus AFTER rows of the next."""
    if site.reference is None:
        stream = ResumableStream(site.config(), rank=0, world_size=1, source=_shared_source(site))
        site.reference = _take(stream, _rows(site.fmt) + AFTER)
    return site.reference


# ---------------------------------------------------------------------------- the server itself
def _get(conn: http.client.HTTPConnection, path: str, method: str = "GET", range_: str | None = None):
    conn.request(method, path, headers={"Range": range_} if range_ else {})
    resp = conn.getresponse()
    return resp, resp.read()


def test_file_server_http11_ranges_and_validators(tmp_path):
    (tmp_path / "a b.bin").write_bytes(bytes(range(100)))
    with FileServer(tmp_path) as srv:
        assert srv.url("a b.bin").endswith("/a%20b.bin")
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        path = "/a%20b.bin"
        resp, body = _get(conn, path, "HEAD")
        assert resp.status == 200 and body == b"" and resp.version == 11
        assert resp.getheader("Content-Length") == "100" and resp.getheader("Accept-Ranges") == "bytes"
        etag, modified = resp.getheader("ETag"), resp.getheader("Last-Modified")
        assert etag == file_etag(os.stat(tmp_path / "a b.bin"))
        assert email.utils.parsedate_to_datetime(modified) is not None
        cases = [  # Range -> (status, Content-Range, body)
            (None, 200, None, bytes(range(100))),
            ("bytes=10-19", 206, "bytes 10-19/100", bytes(range(10, 20))),
            ("bytes=90-", 206, "bytes 90-99/100", bytes(range(90, 100))),
            ("bytes=-5", 206, "bytes 95-99/100", bytes(range(95, 100))),
            ("bytes=-500", 206, "bytes 0-99/100", bytes(range(100))),
            ("bytes=95-500", 206, "bytes 95-99/100", bytes(range(95, 100))),
            ("bytes=100-", 416, "bytes */100", None),
            ("bytes=-0", 416, "bytes */100", None),
            ("bytes=0-1,5-6", 200, None, bytes(range(100))),     # multi-range: ignored, whole file
            ("bytes=9-3", 200, None, bytes(range(100))),         # invalid: ignored
        ]
        for rng, status, content_range, want in cases:
            resp, body = _get(conn, path, range_=rng)       # all on one keep-alive connection
            assert resp.status == status, rng
            assert resp.getheader("Content-Range") == content_range, rng
            assert int(resp.getheader("Content-Length")) == len(body), rng
            if want is not None:
                assert body == want, rng
            assert resp.getheader("Connection") != "close"
        assert _get(conn, "/missing.bin")[0].status == 404
        assert _get(conn, "/../../etc/passwd")[0].status == 404
        assert _get(conn, "/")[0].status == 404                  # no directory listings

        os.utime(tmp_path / "a b.bin", ns=(1_000_000_000, 1_000_000_000))
        resp, _ = _get(conn, path, "HEAD")
        assert resp.getheader("ETag") != etag and resp.getheader("Last-Modified") != modified

        srv.faults.append(lambda rec: 503 if rec.range else None)
        assert _get(conn, path, range_="bytes=0-0")[0].status == 503
        assert _get(conn, path)[0].status == 200
        srv.faults.clear()
        conn.close()

        st = srv.stats()
        assert st["requests"] == len(cases) + 7
        assert st["methods"]["HEAD"] == 2
        assert st["status"][206] == 5 and st["status"][416] == 2 and st["status"][404] == 3
        assert st["range_requests"] == 10      # 9 cases + the one answered 503
        assert st["bytes_sent"] >= 100 * 5
        port = srv.port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---------------------------------------------------------------------------- one epoch, exactly once
def test_parquet_over_http_every_row_once_and_resharded(parquet_site):
    site, srv = parquet_site, parquet_site.srv
    before = srv.stats()
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    groups = [pq.ParquetFile(p).metadata.num_row_groups for p in site.paths]
    shards = stream.source.shards
    assert len(shards) == sum(groups) == PARQUET_ROWS // ROW_GROUP
    assert [(s.file, s.part, s.num_rows) for s in shards] == [
        (url, g, ROW_GROUP) for url, n in zip(site.urls, groups) for g in range(n)]
    stream.set_epoch(0)
    ids = [row["id"] for row in stream]
    assert sorted(ids) == list(range(PARQUET_ROWS))
    assert ids != sorted(ids)                                   # shuffled
    after = srv.stats()
    assert after["requests"] > before["requests"]
    assert after["status"][206] > before["status"][206]         # the reader used Range requests
    assert after["range_requests"] > before["range_requests"]
    assert after["bytes_sent"] > before["bytes_sent"]
    assert not (after["status"] - before["status"]).keys() - {200, 206}   # no 404/416 along the way


def test_jsonl_over_http_every_row_once(jsonl_site):
    site = jsonl_site
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    # indexed: each file (under 16,384 rows) one piece, one shard
    assert [(s.file, s.part) for s in stream.source.shards] == [(url, 0) for url in site.urls]
    assert stream.fingerprint()["dataset"]["builder"] == "json"
    stream.set_epoch(0)
    ids = [row["id"] for row in stream]
    assert sorted(ids) == list(range(JSONL_ROWS))
    assert ids != sorted(ids)
    assert site.srv.stats()["requests"] > 0


def test_parquet_over_http_two_ranks_and_dataloader_workers(parquet_site):
    """Ranks split the row groups; forked DataLoader workers (aiohttp after fork) read them too."""
    site, src = parquet_site, _shared_source(parquet_site)
    seen = []
    for rank in range(2):
        stream = ResumableStream(site.config(), rank=rank, world_size=2, num_workers=2, source=src)
        stream.set_epoch(0)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, timeout=30)
        seen.append([int(row["id"]) for row in loader])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(PARQUET_ROWS))


# ---------------------------------------------------------------------------- exact resume
RESUME_CASES = [
    ("parquet", 37),            # inside the first window
    ("parquet", 2 * BUFFER),    # exactly at a window boundary
    ("parquet", 301),           # later, inside a window
    ("parquet", PARQUET_ROWS),  # at the epoch boundary: continues into epoch 1
    ("jsonl", 1),
    ("jsonl", BUFFER),
    ("jsonl", 250),
]


@pytest.mark.parametrize("fmt,k", RESUME_CASES, ids=[f"{f}-k{k}" for f, k in RESUME_CASES])
def test_resume_over_http_is_exact(request, tmp_path, fmt, k):
    site = _site(request, fmt)
    ref = _reference(site)
    first = ResumableStream(site.config(), rank=0, world_size=1, source=_shared_source(site))
    assert _take(first, k) == ref[:k]
    first.save_sidecar(tmp_path)
    # The resumed stream opens everything anew over http, as a restarted job does.
    resumed = ResumableStream(site.config(resume_state_path=str(tmp_path)), rank=0, world_size=1)
    assert _take(resumed, AFTER) == ref[k:k + AFTER]


# ---------------------------------------------------------------------------- identity and mismatch
def _fsspec_reports_last_modified(url: str) -> bool:
    """Does fsspec's HTTP info() give Last-Modified (filesystem_spec#1909, 2025)? fsspec 2025.3.0, the one
    beside LLaMA-Factory 0.9.5 (datasets 4.0.0 caps it), gives size and ETag only: so does the identity."""
    import fsspec

    return "Last-Modified" in fsspec.filesystem("http", skip_instance_cache=True).info(url)


def test_fingerprint_has_http_size_etag_and_last_modified(parquet_site):
    site = parquet_site
    files = identities(ResumableStream(site.config(), source=_shared_source(site)).fingerprint()["dataset"]["files"])
    assert [f["path"] for f in files] == site.urls
    last_modified = _fsspec_reports_last_modified(site.urls[0])
    for f, path in zip(files, site.paths):
        st = os.stat(path)
        assert f["size"] == st.st_size
        assert f["etag"] == file_etag(st)
        if last_modified:
            assert f["last-modified"] == email.utils.formatdate(st.st_mtime, usegmt=True)
        else:
            assert "last-modified" not in f


def _save_after(site: Site, directory, k: int = 50) -> None:
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    _take(stream, k)
    stream.save_sidecar(directory)


def test_resized_file_on_resume_raises_naming_the_url(fresh_site, tmp_path):
    site = fresh_site("parquet")
    _save_after(site, tmp_path / "state")
    size = os.path.getsize(site.paths[1])
    other = _write("parquet", str(tmp_path / "other"), rows=PARQUET_ROWS + 90)
    shutil.copyfile(other[1], site.paths[1])
    assert os.path.getsize(site.paths[1]) != size
    with pytest.raises(StreamMismatchError) as info:
        ResumableStream(site.config(resume_state_path=str(tmp_path / "state")), rank=0, world_size=1)
    msg = str(info.value)
    assert site.urls[1] in msg and "size" in msg
    assert site.urls[0] not in msg
    assert any(site.urls[1] in what for what, _, _ in info.value.differences)


def _shift_labels(path: str) -> None:
    """Same size, different content: every label digit d -> (d + 1) % 7."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = re.sub(r'"label": (\d)', lambda m: f'"label": {(int(m.group(1)) + 1) % 7}', text)
    assert new != text and len(new) == len(text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


def test_same_size_new_etag_on_resume_raises(fresh_site, tmp_path):
    site = fresh_site("jsonl")
    _save_after(site, tmp_path / "state")
    st = os.stat(site.paths[2])
    _shift_labels(site.paths[2])
    later = st.st_mtime_ns + 2_000_000_000            # a new ETag and Last-Modified, whatever the clock
    os.utime(site.paths[2], ns=(later, later))
    assert os.path.getsize(site.paths[2]) == st.st_size
    with pytest.raises(StreamMismatchError) as info:
        ResumableStream(site.config(resume_state_path=str(tmp_path / "state")), rank=0, world_size=1)
    assert site.urls[2] in str(info.value)
    validators = ("etag", "last-modified") if _fsspec_reports_last_modified(site.urls[2]) else ("etag",)
    assert {what for what, _, _ in info.value.differences} == {
        f"file modified: {site.urls[2]} ({v})" for v in validators}


def test_last_modified_reported_on_one_side_only_is_no_change_when_the_etags_agree():
    """A state / index saved with an fsspec that reports Last-Modified (newer) resumed with one that does not
    (2025.3.0, beside LLaMA-Factory 0.9.5), or the other way round: the ETag and size still decide."""
    from resumable_stream.sources.index import changed_files
    from resumable_stream.state.checks import fingerprint_diff

    url = "http://127.0.0.1:1/part-00000.parquet"
    newer = {"path": url, "size": 10, "etag": '"a"', "last-modified": "Wed, 21 Oct 2015 07:28:00 GMT"}
    older = {"path": url, "size": 10, "etag": '"a"'}
    for saved, now in ((newer, older), (older, newer)):
        assert fingerprint_diff({"files": [saved]}, {"files": [now]}) == []
        assert changed_files({"reader": "parquet", "files": [saved]}, [now]) == []
    rewritten = {**older, "etag": '"b"'}
    assert [w for w, _, _ in fingerprint_diff({"files": [newer]}, {"files": [rewritten]})] == [
        f"file modified: {url} (etag)"]
    no_etag = {"path": url, "size": 10}     # no ETag on one side: Last-Modified is all there is to compare
    assert [w for w, _, _ in fingerprint_diff({"files": [newer]}, {"files": [{**no_etag, "etag": None}]})] == [
        f"file modified: {url} (etag)", f"file modified: {url} (last-modified)"]
    assert changed_files({"reader": "parquet", "files": [{**no_etag, "last-modified": "x"}]}, [no_etag]) == [
        (url, "last-modified", "x", None)]


def test_same_size_same_validators_caught_by_next_sample_digest(fresh_site, tmp_path):
    """A host that keeps ETag / Last-Modified over a content change: the last line of defence."""
    site = fresh_site("jsonl")
    _save_after(site, tmp_path / "state")
    for path in site.paths:
        st = os.stat(path)
        _shift_labels(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    resumed = ResumableStream(site.config(resume_state_path=str(tmp_path / "state")), rank=0, world_size=1)
    # JSON lines are indexed: the text's CRC-32 catches it before a row is made (else the next-sample digest)
    with pytest.raises(StreamMismatchError, match="first sample after resume|does not match the index's CRC-32"):
        next(iter(resumed))


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_missing_url_in_data_files_raises_source_error(request, fmt):
    site = _site(request, fmt)
    ext = ".parquet" if fmt == "parquet" else ".jsonl"
    missing = site.srv.url("no-such-file" + ext)
    cfg = StreamConfig(dataset_name_or_path=BUILDER[fmt], data_files=[*site.urls, missing])
    with pytest.raises((SourceError, ConfigError)) as info:
        ResumableStream(cfg)
    assert missing in str(info.value)


def test_missing_url_as_dataset_path_raises_source_error(parquet_site):
    missing = parquet_site.srv.url("gone.parquet")
    with pytest.raises((SourceError, ConfigError)) as info:
        ResumableStream(StreamConfig(dataset_name_or_path=missing))
    assert missing in str(info.value)


def test_unreachable_server_raises_source_error(tmp_path):
    write_parquet_dataset(str(tmp_path), rows=10, files=1, row_group_size=10)
    with FileServer(tmp_path) as srv:
        url = srv.url("part-00000.parquet")
    with pytest.raises((SourceError, ConfigError)) as info:     # connection refused
        ResumableStream(StreamConfig(dataset_name_or_path="parquet", data_files=[url], retries=1,
                                     retry_backoff_s=0.01))
    assert url in str(info.value)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_file_vanishing_while_streaming_raises_source_error(fresh_site, fmt):
    site = fresh_site(fmt)
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    for path in site.paths:
        os.remove(path)
    stream.set_epoch(0)
    try:
        list(stream)
    except SourceError as e:
        assert any(url in str(e) for url in site.urls)
        return
    pytest.fail("no SourceError")


# ---------------------------------------------------------------------------- a file's identity and footer
def _suffix_get(rec) -> bool:
    return rec.method == "GET" and (rec.range or "").startswith("bytes=-")


def test_parquet_identity_and_footer_come_in_one_request_per_file(fresh_site):
    """A cold start over http(s) asks each file once for its tail (a suffix range, whose Content-Range names
    the size): no HEAD before it. The identity it records is the one a HEAD gives, so a resume (which asks by
    HEAD) agrees with it."""
    from resumable_stream.sources.resolve import file_identity

    site = fresh_site("parquet")
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    opened = list(site.srv.requests)
    assert [r.method for r in opened].count("HEAD") == 0
    assert sum(_suffix_get(r) for r in opened) == PARQUET_FILES
    assert sorted(r.path for r in opened if _suffix_get(r)) == sorted("/" + os.path.basename(p) for p in site.paths)
    recorded = identities(stream.fingerprint()["dataset"]["files"])
    assert [{k: v for k, v in f.items() if k != "footer"} for f in recorded] == [file_identity(u) for u in site.urls]
    stream.set_epoch(0)
    assert sorted(row["id"] for row in stream) == list(range(PARQUET_ROWS))


def test_server_ignoring_the_suffix_range_is_asked_by_head(fresh_site):
    """A server that answers the suffix range with something else than 206 (the whole file, a redirect): the
    file is asked as before (HEAD, then ranged reads), and every row comes once."""
    site = fresh_site("parquet")
    site.srv.faults.append(lambda rec: 200 if _suffix_get(rec) else None)
    stream = ResumableStream(site.config(), rank=0, world_size=1)
    methods = [r.method for r in site.srv.requests]
    assert methods.count("HEAD") == PARQUET_FILES
    stream.set_epoch(0)
    assert sorted(row["id"] for row in stream) == list(range(PARQUET_ROWS))


def test_user_http_options_go_through_fsspec(fresh_site):
    """With the user's own storage_options (headers, auth, ...) every request goes through fsspec with them:
    the identity is asked by HEAD."""
    site = fresh_site("parquet")
    stream = ResumableStream(site.config(storage_options={"https": {"headers": {"X-Test": "1"}}}),
                             rank=0, world_size=1)
    assert [r.method for r in site.srv.requests].count("HEAD") == PARQUET_FILES
    stream.set_epoch(0)
    assert sorted(row["id"] for row in stream) == list(range(PARQUET_ROWS))


def test_read_tail_gives_the_heads_identity_and_the_last_bytes(fresh_site, monkeypatch):
    from resumable_stream.io import ranged

    site = fresh_site("parquet")
    with open(site.paths[0], "rb") as f:
        data = f.read()
    st = os.stat(site.paths[0])
    identity, tail = ranged.read_tail(site.urls[0], 100, 5.0)
    assert tail == data[-100:]
    assert identity["size"] == len(data) and identity["etag"] == file_etag(st)
    assert ranged.read_tail(site.urls[0], 10 * len(data), 5.0)[1] == data      # more than the file: all of it
    with pytest.raises(FileNotFoundError):
        ranged.read_tail(site.srv.url("gone.parquet"), 100, 5.0)
    # an fsspec whose HEAD does not report Last-Modified (2025.3.0): nor does the identity read here
    monkeypatch.setattr(ranged, "_fsspec_reports_last_modified", lambda: False)
    assert "last-modified" not in ranged.read_tail(site.urls[0], 100, 5.0)[0]
    monkeypatch.setattr(ranged, "_fsspec_reports_last_modified", lambda: None)   # cannot tell: asked by HEAD
    assert ranged.read_tail(site.urls[0], 100, 5.0) is None
