"""A one-frame ``.jsonl.zst`` over the network is one shard read piece after piece: the next piece's compressed
bytes are fetched while the piece before decodes and is handed out (sources/jsonl.py ``_Ranges``), not when its own
decode starts (a round trip a piece). Asserted on the loopback server's request log: requests go out two at a
time, each byte once."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
import zstandard
from http_server import FileServer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.sources import jsonl_index

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]

LATENCY_S = 0.6                  # margins of half a latency and more: loaded CI cores stall threads for ~0.1 s
PIECE = 64 << 10
ROWS = 1500


def _one_frame(path, n: int) -> int:
    """A file of ``n`` rows in one zstd frame."""
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(3000)]
    text = "".join(json.dumps({"id": i, "text": " ".join(rng.choices(words, k=60))}) + "\n" for i in range(n))
    data = zstandard.ZstdCompressor(level=3).compress(text.encode())
    path.write_bytes(data)
    return len(data)


def _ranges(requests) -> list[tuple[float, int, int]]:
    out = []
    for r in requests:
        if r.method == "GET" and r.range:
            first, last = r.range.split("=")[1].split("-")
            out.append((r.at, int(first), int(last)))
    return sorted(out)


def test_a_one_frame_zst_files_next_pieces_are_requested_while_the_one_before_is_read(tmp_path, monkeypatch):
    """Pieces of 64 KiB of text, compressed ends known to 1 KiB: ~6 ranges. Without the read-ahead each request
    waits for the answer before it (a latency apart); with it, 3 go out at once (the piece and 2 ahead), then the
    next ones while those decode. No range asked for twice, bytes served <= 1.1x the file."""
    name = "a.jsonl.zst"
    monkeypatch.setattr(jsonl_index, "PIECE_MAX_BYTES", PIECE)
    monkeypatch.setattr(jsonl_index, "INPUT_CHUNK", 1 << 10)     # compressed ends known to 1 KiB, not 256 KiB
    site = tmp_path / "site"
    site.mkdir()
    size = _one_frame(site / name, ROWS)
    with FileServer(str(site)) as srv:
        cfg = StreamConfig(dataset_name_or_path="json", data_files=[srv.url(name)], shuffle=False,
                           index_path=str(tmp_path / "i.json"), verify_files=False, retries=2, timeout_s=20)
        ResumableStream(cfg).close()                           # builds and writes the index
        srv.latency_s = LATENCY_S
        srv.reset_stats()
        s = ResumableStream(cfg)
        assert len(s.source.shards) == 1                       # one frame: one shard
        pieces = len(s.source._files[0]["pieces"])
        assert pieces >= 6, pieces
        rows = list(itertools.islice(s, ROWS))
        s.close()
        gets = _ranges(srv.requests)
        served = srv.stats()["bytes_sent"]
    assert [r["id"] for r in rows] == list(range(ROWS))
    # each byte once: the ranges asked for do not overlap, and cover no more than the file
    spans = sorted((a, b) for _, a, b in gets)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(spans, spans[1:])), spans
    assert served <= 1.1 * size, (served, size)
    # the next piece goes out with the one before, not a round trip after it: without the read-ahead every request
    # waits for the answer before it (gaps >= LATENCY_S); with it, they go out in groups
    times = [t - gets[0][0] for t, _, _ in gets]
    paired = sum(1 for a, b in zip(times, times[1:]) if b - a < LATENCY_S / 2)
    assert len(gets) >= 5, gets
    assert times[2] < LATENCY_S / 2, times                     # 2 pieces asked for with the first
    assert paired >= (len(gets) - 1) // 2, times


def test_closing_mid_shard_asks_for_nothing_more(tmp_path, monkeypatch):
    """A stream closed while a piece is fetched ahead: what is ahead is cancelled or dropped, and no request starts
    after close() returns."""
    monkeypatch.setattr(jsonl_index, "PIECE_MAX_BYTES", PIECE)
    monkeypatch.setattr(jsonl_index, "INPUT_CHUNK", 1 << 10)     # compressed ends known to 1 KiB, not 256 KiB
    site = tmp_path / "site"
    site.mkdir()
    _one_frame(site / "a.jsonl.zst", ROWS)
    with FileServer(str(site)) as srv:
        cfg = StreamConfig(dataset_name_or_path="json", data_files=[srv.url("a.jsonl.zst")], shuffle=False,
                           index_path=str(tmp_path / "i.json"), verify_files=False, retries=2, timeout_s=20)
        ResumableStream(cfg).close()
        srv.latency_s = LATENCY_S
        srv.reset_stats()
        s = ResumableStream(cfg)
        first = list(itertools.islice(s, 250))                 # into the second piece
        s.close()
        import time

        closed = time.monotonic()
        asked = len(_ranges(srv.requests))
        time.sleep(LATENCY_S * 2)
        later = [r for r in _ranges(srv.requests)[asked:]]
    assert [r["id"] for r in first] == list(range(250))
    assert not later, (later, closed)


def test_the_read_ahead_holds_at_most_its_pieces():
    """What a shard fetches ahead (counted in ``data.prefetch_memory_mb`` where a prefetcher is given) is at most
    READAHEAD_PIECES + 1 ranges at once (the next pieces asked for at each piece, and one asked for at the piece
    before and not yet read), however far ahead it is asked to go; a range read in order takes the one fetched
    ahead, and a range asked for again is never fetched twice."""
    import threading

    from resumable_stream.sources.jsonl import READAHEAD_PIECES, _Ranges

    gate, asked = threading.Event(), []

    def fetch(a: int, b: int) -> bytes:
        asked.append((a, b))
        gate.wait(10)
        return bytes(b - a)

    ranges = _Ranges(fetch)
    for k in range(1, 8):                       # asked 7 ranges ahead while none has come back
        ranges.ahead(k * 100, (k + 1) * 100)
        ranges.ahead(k * 100, (k + 1) * 100)    # (again: nothing more)
        assert len(ranges._ahead) <= READAHEAD_PIECES + 1
    assert [r[:2] for r in ranges._ahead] == [(k * 100, k * 100 + 100) for k in range(1, READAHEAD_PIECES + 2)]
    gate.set()
    assert ranges.fetch(0, 100) == bytes(100)                 # before what is ahead: fetched now
    assert ranges.fetch(100, 200) == bytes(100)               # taken from what was fetched ahead
    ranges.close()
    assert sorted(set(asked)) == sorted(asked)                # no range fetched twice
    assert len([r for r in asked if r[0] >= 100]) == READAHEAD_PIECES + 1


def test_the_read_ahead_is_charged_to_the_prefetch_memory_budget():
    """A range fetched ahead counts against ``data.prefetch_memory_mb`` (the prefetcher's ``reserve``) from when it is
    asked for until the reader takes it or it is dropped; one that does not fit is not fetched ahead. Observed on
    the fetches made: ranges of 100 bytes under a budget of 250, while none comes back, at most 2 are fetched ahead
    (uncharged, READAHEAD_PIECES + 1 = 3), and a range taken gives its bytes back for the next one."""
    import threading

    import pyarrow as pa

    from resumable_stream.sources.jsonl import _Ranges
    from resumable_stream.sources.prefetch import Prefetcher

    class Rows:                                 # the prefetcher's own fetches: none here
        def fetch(self, shard):
            return pa.table({"x": [shard]})

    rows = Rows()
    budget = Prefetcher(rows.fetch, cap=4, budget=250)
    gate, asked = threading.Event(), []

    def fetch(a: int, b: int) -> bytes:
        asked.append((a, b))
        gate.wait(10)
        return bytes(b - a)

    ranges = _Ranges(fetch, budget)
    try:
        for k in range(1, 4):
            ranges.ahead(k * 100, (k + 1) * 100)
        time.sleep(0.2)
        assert sorted(asked) == [(100, 200), (200, 300)]        # the third did not fit: not fetched ahead
        assert budget.stats()["bytes"] == 200 and budget.stats()["declined"] == 1
        gate.set()
        assert ranges.fetch(100, 200) == bytes(100)             # taken: its 100 bytes are the reader's now
        assert budget.stats()["bytes"] == 100
        ranges.ahead(300, 400)                                  # fits again
        assert ranges.fetch(200, 300) == bytes(100) and ranges.fetch(300, 400) == bytes(100)
        assert sorted(asked) == [(100, 200), (200, 300), (300, 400)]
        ranges.ahead(400, 500)
        ranges.close()                                          # dropped: given back once its fetch is over
        deadline = time.monotonic() + 10
        while budget.stats()["bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.stats()["bytes"] == 0 and budget.stats()["peak_bytes"] <= 250
    finally:
        gate.set()
        ranges.close()
        budget.close()


def _incompressible(path, n: int) -> None:
    """``n`` rows of ~1 KB of base64 (zstd keeps ~3/4 of it) in one zstd frame."""
    import base64

    rng = random.Random(3)
    text = "".join(json.dumps({"id": i, "text": base64.b64encode(rng.randbytes(750)).decode()}) + "\n"
                   for i in range(n))
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(text.encode()))


ROWS_BIG = 14_000


@pytest.mark.parametrize("memory_mb", [1, 256])
def test_a_local_shards_read_ahead_stays_within_the_memory_budget(tmp_path, monkeypatch, memory_mb):
    """Pieces of ~3 MiB of text (~2.3 MiB compressed) in a one-frame local file: under a budget of 1 MiB no piece's
    bytes are fetched ahead (none fits), and the rows are the same; under 256 MiB they are."""
    from resumable_stream.sources import jsonl

    monkeypatch.setattr(jsonl_index, "PIECE_MAX_BYTES", 3 << 20)
    _incompressible(tmp_path / "a.jsonl.zst", ROWS_BIG)
    submitted = []
    real_pool = jsonl.readahead_pool

    class Watched:
        def submit(self, fn, start, end):
            submitted.append(end - start)
            return real_pool().submit(fn, start, end)

    monkeypatch.setattr(jsonl, "readahead_pool", Watched)
    cfg = StreamConfig(dataset_name_or_path="json", data_files=[str(tmp_path / "a.jsonl.zst")], shuffle=False,
                       prefetch_memory_mb=memory_mb)
    s = ResumableStream(cfg)
    try:
        assert len(s.source.shards) == 1 and len(s.source._files[0]["pieces"]) >= 4
        ids = [r["id"] for r in itertools.islice(s, ROWS_BIG)]
        stats = s.source.prefetch_stats()
    finally:
        s.close()
    assert ids == list(range(ROWS_BIG))
    assert stats["peak_bytes"] <= memory_mb << 20, stats
    if memory_mb == 1:
        assert submitted == [] and stats["declined"] >= 1, (submitted, stats)
    else:
        assert submitted and max(submitted) > 1 << 20 and stats["reserved"] == len(submitted), (submitted, stats)
