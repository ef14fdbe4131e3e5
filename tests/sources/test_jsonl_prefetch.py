"""A remote JSON-lines file's pieces fetched ahead (sources/prefetch.py with sources/jsonl.py): the first window's
pieces are requested together and within the memory budget, the next ones once its first sample is out, and every
byte is served once. Asserted on the loopback server's request log."""

from __future__ import annotations

import itertools
import json
import os

import pytest
from http_server import FileServer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.sources import jsonl_index

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]

LATENCY_S = 0.6                  # margins of half a latency and more: loaded CI cores stall threads for ~0.1 s
PIECE = 64 << 10


def _file(path: str, n: int) -> int:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "text": f"row {i} " + "w" * (400 + i % 200)}) + "\n")
    return os.path.getsize(path)


@pytest.mark.parametrize("memory_mb", [1, 256])
def test_a_remote_files_first_window_pieces_are_requested_together_within_the_budget(tmp_path, monkeypatch,
                                                                                    memory_mb):
    """Pieces of 64 KiB, a budget of 1 MiB: the reservation is a piece's text, not 9x its bytes (a parquet row group's
    guess, with which one piece at a time fitted: the first window's 4 pieces were requested one after another, a
    latency each). With either budget the first window's 4 pieces (interleave_shards) go out at once and nothing
    else before the first of them is answered: the next pieces do not share the link with the first sample's."""
    monkeypatch.setattr(jsonl_index, "PIECE_MAX_BYTES", PIECE)
    site = tmp_path / "site"
    site.mkdir()
    size = _file(str(site / "a.jsonl"), 1200)
    with FileServer(str(site)) as srv:
        url = srv.url("a.jsonl")
        cfg = StreamConfig(dataset_name_or_path="json", data_files=[url], shuffle=True, buffer_size=200,
                           interleave_shards=4, prefetch_memory_mb=memory_mb, index_path=str(tmp_path / "i.json"),
                           verify_files=False, retries=2, timeout_s=20)
        ResumableStream(cfg).close()                           # builds and writes the index
        srv.latency_s = LATENCY_S
        srv.reset_stats()
        s = ResumableStream(cfg)
        pieces = len(s.source.shards)
        assert pieces >= 8, pieces                             # (more pieces than the first window opens)
        rows = list(itertools.islice(s, 1200))
        stats = s.source.prefetch_stats()
        s.close()
        gets = sorted(r.at for r in srv.requests if r.method == "GET" and r.range)
        served = srv.stats()["bytes_sent"]
    assert sorted(r["id"] for r in rows) == list(range(1200))
    first = gets[0]
    before_an_answer = [t for t in gets if t < first + LATENCY_S * 0.75]
    assert len(before_an_answer) == 4, repr(([round(t - first, 3) for t in gets], stats))          # the first window's pieces, together and alone
    assert len(gets) == pieces and stats["taken"] == pieces     # every piece fetched ahead, once
    assert stats["peak_bytes"] <= memory_mb * 2**20 and stats["over_budget"] == 0, stats
    assert served <= 1.1 * size, (served, size)
