"""The prefetch depth adapts to the measured latency within ``data.prefetch_memory_mb``, over the loopback server.

The server (``tests/http_server.FileServer``) injects a latency per request; the prefetcher's counters
(``ParquetSource.prefetch_stats()``) and the server's own count of requests served at once say how deep
it fetched ahead and what it held. The samples are those of a read without prefetch, in every case.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
from http_server import FileServer

from resumable_stream import ConfigError, ResumableStream, StreamConfig
from resumable_stream.sources import open_source
from resumable_stream.testing import write_parquet_dataset

ROWS, FILES, ROW_GROUP = 48_000, 8, 1000        # 48 row groups of ~14 KB on the wire, ~80 KB decoded
READ = 24_000

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("hub_offline")]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch_parquet")
    paths = write_parquet_dataset(str(d), rows=ROWS, files=FILES, row_group_size=ROW_GROUP)
    with FileServer(d) as srv:
        srv.urls = [srv.url(os.path.basename(p)) for p in paths]
        yield srv


def _config(srv, **kw) -> StreamConfig:
    kw.setdefault("shuffle", True)
    kw.setdefault("buffer_size", 4096)
    kw.setdefault("timeout_s", 20.0)
    return StreamConfig(dataset_name_or_path="parquet", data_files=list(srv.urls), **kw)


@pytest.fixture(scope="module")
def reference(site):
    site.latency_s = 0.0
    return [r["id"] for r in itertools.islice(ResumableStream(_config(site, prefetch_blocks=0)), READ)]


def _read(srv, latency: float, **kw) -> tuple[list[int], dict, dict]:
    srv.latency_s = 0.0
    source = open_source(_config(srv, **kw).source_spec)             # opening is not what is measured
    srv.latency_s = latency
    srv.reset_stats()
    try:
        stream = ResumableStream(_config(srv, **kw), source=source)
        ids = [r["id"] for r in itertools.islice(stream, READ)]
        return ids, source.prefetch_stats(), srv.stats()
    finally:
        source.close()
        srv.latency_s = 0.0


def _max_span(srv) -> int:
    import pyarrow.parquet as pq

    spans = []
    for name in sorted(os.listdir(srv.root)):
        if name.endswith(".parquet"):
            md = pq.ParquetFile(os.path.join(srv.root, name)).metadata
            spans += [sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
                      for g in range(md.num_row_groups)]
    return max(spans)


def test_higher_latency_fetches_deeper_within_the_budget(site, reference):
    low_ids, low, low_srv = _read(site, 0.002)
    high_ids, high, high_srv = _read(site, 0.15)
    assert low_ids == reference and high_ids == reference          # the plan's rows, in the plan's order
    d_low, d_high = low["depth_median"], high["depth_median"]   # the depth kept, over the hand-overs
    assert d_high > d_low, (low, high)
    assert d_high <= high["cap"] == 64                             # null prefetch_blocks: adaptive, at most 64
    assert high["fetch_s"] >= 0.15 > low["fetch_s"]
    # deeper is what the server saw: more requests in flight at once
    assert high_srv["max_in_flight"] > low_srv["max_in_flight"], (low_srv, high_srv)
    assert high["peak_bytes"] <= high["budget"] and low["peak_bytes"] <= low["budget"]


def test_prefetch_blocks_caps_the_adaptive_depth(site, reference):
    ids, stats, served = _read(site, 0.15, prefetch_blocks=3)
    assert ids == reference
    assert stats["cap"] == 3 and max(stats["depth"].values()) <= 3
    # the server saw at most the 3 fetches ahead plus the reader's own read of a shard not fetched ahead
    assert stats["peak_in_flight"] <= 3 and served["max_in_flight"] <= 3 + 1


def test_bytes_in_flight_and_held_never_exceed_the_memory_budget(site, reference):
    budget_mb = 1
    budget = budget_mb * 2**20
    ids, stats, served = _read(site, 0.15, prefetch_memory_mb=budget_mb)
    assert ids == reference
    # the prefetcher's own count: reserved for fetches in flight + decoded tables held, at most so far
    assert 0 < stats["peak_bytes"] <= budget, stats
    # the budget, not the latency, bounded the depth here: without it, far more fetches run at once
    _, free, free_served = _read(site, 0.15)
    assert free["peak_bytes"] > budget
    assert served["max_in_flight"] < free_served["max_in_flight"], (served, free_served)
    # what the server saw: the row-group bodies fetched ahead at once (all in flight but the reader's own
    # read) fit the budget
    assert (served["max_in_flight"] - 1) * _max_span(site) <= budget
    # every table held counted its real size: the decoded bytes per fetched byte were measured
    assert stats["ratio"] is not None and stats["ratio"] > 1


def test_a_row_group_larger_than_the_budget_is_read_by_the_reader_itself(tmp_path, hub_offline):
    paths = write_parquet_dataset(str(tmp_path), rows=60_000, files=1, row_group_size=30_000)
    with FileServer(tmp_path) as srv:
        srv.urls = [srv.url(os.path.basename(p)) for p in paths]
        reference = [r["id"] for r in itertools.islice(ResumableStream(_config(srv, prefetch_blocks=0)), 40_000)]
        source = open_source(_config(srv, prefetch_memory_mb=1).source_spec)
        try:
            ids = [r["id"] for r in itertools.islice(ResumableStream(_config(srv, prefetch_memory_mb=1),
                                                                     source=source), 40_000)]
            stats = source.prefetch_stats()
        finally:
            source.close()
    assert ids == reference
    assert stats["started"] == 0 and stats["peak_bytes"] == 0


@pytest.mark.parametrize("value", [0, 0.5, -1, float("nan"), float("inf"), "64", True, 2_000_000])
def test_a_bad_prefetch_memory_mb_names_the_key_the_value_and_what_is_allowed(value):
    with pytest.raises(ConfigError, match=r"data\.prefetch_memory_mb: got .*; allowed: a number of MiB from 1 to "
                                          r"1048576"):
        StreamConfig(dataset_name_or_path="parquet", data_files="/x/*.parquet", prefetch_memory_mb=value)


def test_prefetch_blocks_null_is_adaptive_and_an_integer_still_allowed():
    assert StreamConfig(dataset_name_or_path="parquet", data_files="/x/*.parquet").prefetch_blocks is None
    assert StreamConfig(dataset_name_or_path="parquet", data_files="/x/*.parquet", prefetch_blocks=8).prefetch_blocks == 8
    with pytest.raises(ConfigError, match=r"data\.prefetch_blocks: got 257; allowed: null \(adaptive"):
        StreamConfig(dataset_name_or_path="parquet", data_files="/x/*.parquet", prefetch_blocks=257)


def test_a_forked_worker_does_not_wait_on_a_lock_its_parent_held_at_the_fork():
    """A fetch thread of the parent may hold the prefetcher's lock at the moment a DataLoader worker is forked;
    the worker's copy of that lock would stay taken forever. The worker starts afresh instead."""
    import multiprocessing
    import threading

    import pyarrow as pa

    from resumable_stream.sources.prefetch import Prefetcher

    class Rows:
        def fetch(self, shard):
            return pa.table({"x": [shard]})

    rows = Rows()
    prefetcher = Prefetcher(rows.fetch, cap=2)
    held, release = threading.Event(), threading.Event()

    def hold():
        with prefetcher._lock:          # what a parent's fetch thread does while it accounts a fetch
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)

    def child():
        prefetcher.hint(0, [1, 2])
        future = prefetcher.take(1)
        assert future is None or future.result(timeout=10).num_rows == 1
        prefetcher.stats()
        prefetcher.close()

    try:
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(20)
        alive = proc.is_alive()
        if alive:
            proc.kill()
    finally:
        release.set()
        holder.join()
    assert not alive, "the forked worker hung on the parent's prefetch lock"
    assert proc.exitcode == 0


def test_a_consumer_pause_does_not_cut_the_depth():
    """An evaluation, a checkpoint save or a garbage collection stops the consumer for a while. The depth is
    sized by the consumer time of the median window, so after the pause it is still what the steady consumer
    needs; a running mean of the hand-over intervals took the pause for a slow consumer and cut the depth to
    a few fetches, and the consumer then waited on nearly every row group until the mean recovered."""
    import time

    import pyarrow as pa

    from resumable_stream.sources.prefetch import Prefetcher

    latency, per_row_group, window_rows = 0.05, 0.004, 4     # a window opens 4 row groups, then consumes them

    class Rows:
        def fetch(self, shard):
            time.sleep(latency)
            return pa.table({"x": [shard]})

    rows = Rows()
    prefetcher = Prefetcher(rows.fetch, cap=64)
    taken = 0

    def window() -> None:
        nonlocal taken
        prefetcher.hint(0, list(range(taken, taken + 256)))      # the plan from here, as a window build hints it
        for shard in range(taken, taken + window_rows):
            assert prefetcher.take(shard).result(timeout=30).column("x")[0].as_py() == shard
        taken += window_rows
        time.sleep(per_row_group * window_rows)                 # the consumer's work on the window's rows

    try:
        for _ in range(12):
            window()
        steady = prefetcher.depth_for(0)
        time.sleep(1.0)                                         # the pause: 250x one row group's consumer time
        for _ in range(3):
            window()
        after = prefetcher.depth_for(0)
    finally:
        prefetcher.close()
    # the steady depth covers a fetch at the consumer's pace (latency / per_row_group = 12.5 row groups)
    assert steady >= 6, steady
    assert after >= 0.75 * steady, (steady, after)


def test_a_local_partitions_first_fetch_runs_alone_until_it_is_done():
    """Local files (``first_alone``): the first sample waits for one row group's decoding, which the row groups
    hinted after it would share the cores with; they start once it is done. Remote: all at once."""
    import threading

    import pyarrow as pa

    from resumable_stream.sources.prefetch import Prefetcher

    class Rows:
        def __init__(self):
            self.started, self.gate = [], threading.Event()

        def fetch(self, shard):
            self.started.append(shard)
            if shard == 3:
                self.gate.wait(30)
            return pa.table({"x": [shard]})

    for alone in (True, False):
        rows = Rows()
        prefetcher = Prefetcher(rows.fetch, cap=8, threads=4, first_alone=alone)
        prefetcher.hint(0, [3, 1, 2, 0])
        future = prefetcher.take(3)
        time.sleep(0.2)
        assert rows.started == [3] if alone else sorted(rows.started) == [0, 1, 2, 3]
        rows.gate.set()
        assert future.result(timeout=10).num_rows == 1
        deadline = time.monotonic() + 10
        while len(rows.started) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(rows.started) == [0, 1, 2, 3]
        prefetcher.close()


def test_a_fetch_that_decodes_is_timed_whole_where_the_source_says_so(tmp_path):
    """A local JSON-lines piece's fetch reads its bytes in ~2 ms and then inflates them for ~50-100 ms on the
    prefetch thread. Timed by its read alone (the requests' time), the depth covers ~2 ms and the reader waits on
    each inflate; ``whole_call`` times the whole fetch, so the depth covers the decode too."""
    import pyarrow as pa

    from resumable_stream.io.ranged import read_range
    from resumable_stream.sources.prefetch import Prefetcher

    path = tmp_path / "piece"
    path.write_bytes(bytes(4096))
    decode_s, per_row_group = 0.06, 0.01

    class Rows:
        def fetch(self, shard):
            read_range(str(path), 0, 4096, {})       # a local read: counted as the fetch's request time
            time.sleep(decode_s)                      # its decoding, off the consumer's thread
            return pa.table({"x": [shard]})

    depths = {}
    for whole in (False, True):
        rows = Rows()
        prefetcher = Prefetcher(rows.fetch, cap=16, whole_call=whole)
        try:
            for w in range(6):                        # windows of 2 row groups, consumed at per_row_group each
                prefetcher.hint(0, list(range(2 * w, 64)))
                for shard in (2 * w, 2 * w + 1):
                    assert prefetcher.take(shard).result(timeout=30).column("x")[0].as_py() == shard
                time.sleep(2 * per_row_group)
            stats = prefetcher.stats()
            depths[whole] = prefetcher.depth_for(0)
        finally:
            prefetcher.close()
        if whole:
            assert stats["fetch_s"] >= decode_s, stats
        else:
            assert stats["fetch_s"] < decode_s, stats
    # covering the decode needs about decode_s / per_row_group fetches ahead; timed by the read alone, one
    assert depths[True] >= 3 and depths[False] <= 2, depths


def test_memory_a_source_holds_ahead_on_its_own_counts_against_the_budget():
    """``reserve`` / ``release`` (a JSON-lines shard's read-ahead): granted while it fits beside the fetches, declined
    past the budget, and a fetch held back for memory starts once the bytes are given back."""
    import threading

    import pyarrow as pa

    from resumable_stream.sources.prefetch import Prefetcher

    started = threading.Event()

    class Rows:
        def size(self, shard):
            return 40

        def decoded(self, shard):
            return 10                              # a fetch reserves 50 bytes

        def fetch(self, shard):
            started.set()
            return pa.table({"x": [shard]})

    rows = Rows()
    prefetcher = Prefetcher(rows.fetch, cap=4, budget=100, size=rows.size, decoded=rows.decoded)
    try:
        assert prefetcher.reserve(60)
        assert not prefetcher.reserve(50)              # 110 > 100
        prefetcher.hint(0, [0])                        # 60 + 50 > 100: held back for memory
        assert not started.wait(0.3)
        assert prefetcher.stats()["held_for_memory"] == 1
        prefetcher.release(60)                         # room again: the held fetch starts
        assert started.wait(10)
        assert prefetcher.take(0).result(timeout=10).num_rows == 1
        stats = prefetcher.stats()
        assert stats["reserved"] == 1 and stats["declined"] == 1, stats
        assert stats["peak_bytes"] <= 100 and stats["bytes"] == 0, stats
    finally:
        prefetcher.close()
