"""One owner per cursor: a stream read while other threads watch it yields what an unwatched one yields.

Every method meant to be called from another thread (the loader's ``metrics_reading`` / ``data_metrics`` /
``data_epoch``, the Prometheus collector and endpoint over them, a stream's ``data_epoch`` and the data-path
counters) runs in a loop from 16 threads while a StreamLoader (0 and 2 workers) or a ResumableStream iterates,
over a single dataset and a mixture, parquet and WebDataset tars, under several seeds. The batches and the
state saved after them must equal an unwatched run's (docs/architecture.md, "One owner per cursor").

The interpreter's switch interval is cut to 1 us while the watchers run, so that a watcher that built or moved
reader state on its own thread would interleave with the consumer often enough to be seen (an earlier
``data_epoch`` built a window on the scraping thread: one window of rows came out twice in about half the runs).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from wds_data import text_samples, write_tars

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader
from resumable_stream.observe import metrics
from resumable_stream.observe.prometheus import DataPathCollector, serve
from resumable_stream.stream.mixture import MixtureStream
from resumable_stream.testing import synthetic_rows

pytestmark = pytest.mark.timeout(240)

BATCHES, BATCH_SIZE, BUFFER = 150, 10, 64
WATCHERS = 16


def _parquet_dir(directory, first_id: int) -> str:
    os.makedirs(directory, exist_ok=True)
    for f in range(6):
        pq.write_table(pa.table(synthetic_rows(first_id + f * 500, 500, words=4)),
                       os.path.join(directory, f"part-{f:05d}.parquet"), row_group_size=100)
    return str(directory)


def _later_files(file: int, n: int):
    """Source b's samples: other keys than source a's (files 10, 11, ...)."""
    return text_samples(10 + file, n)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("watched")
    out = {"parquet": [_parquet_dir(root / "pa", 0), _parquet_dir(root / "pb", 100_000)]}
    out["webdataset"] = [write_tars(root / "wa", 6, 250), write_tars(root / "wb", 6, 250, _later_files)]
    return out


def _source(fmt: str, where) -> dict:
    if fmt == "parquet":
        return {"dataset_name_or_path": "parquet", "data_files": os.path.join(where, "*.parquet")}
    return {"dataset_name_or_path": "webdataset", "data_files": list(where)}


def _config(data, fmt: str, kind: str, seed: int):
    shared = {"shuffle": True, "shuffle_seed": seed, "buffer_size": BUFFER}
    if kind == "single":
        return StreamConfig.from_dict({**_source(fmt, data[fmt][0]), **shared})
    return StreamConfig.from_dict({**shared, "stopping": "never", "sources": [
        {"label": label, "weight": w, **_source(fmt, where)}
        for label, w, where in zip(("a", "b"), (0.6, 0.4), data[fmt])]})


def _key(row: dict) -> str:
    return str(row["id"]) if "id" in row else row["__key__"]


def _open(cfg, workers: int):
    if hasattr(cfg, "sources"):
        return MixtureStream(cfg, rank=0, world_size=1, num_workers=workers)
    return ResumableStream(cfg, rank=0, world_size=1, num_workers=workers)


def _collate(rows: list[dict]) -> list[str]:
    return [_key(r) for r in rows]


class _Watchers:
    """``WATCHERS`` threads calling ``calls`` round-robin until stopped; the first error is kept."""

    def __init__(self, calls):
        self.calls, self.stop, self.errors, self.count = calls, threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(WATCHERS)]

    def _run(self, i: int) -> None:
        for call in itertools.cycle(self.calls[i % len(self.calls):] + self.calls[:i % len(self.calls)]):
            if self.stop.is_set():
                return
            try:
                call()
                self.count += 1
            except Exception as e:   # noqa: BLE001 - kept and reported by the test
                self.errors.append(repr(e))
                return

    def __enter__(self):
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)
        sys.setswitchinterval(self._interval)


def _loader_run(cfg, workers: int, watched: bool) -> tuple[list, dict]:
    stream = _open(cfg, workers)
    loader = StreamLoader(stream, batch_size=BATCH_SIZE, collate_fn=_collate, num_workers=workers)
    server = None
    try:
        if not watched:
            batches = list(itertools.islice(loader, BATCHES))
            return batches, loader.rank_state()["stream"]["partitions"]
        server = serve(loader, 0, addr="127.0.0.1")
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        collector = DataPathCollector(loader.metrics_reading, loader.data_epoch, 0)
        calls = [loader.metrics_reading, loader.data_metrics, loader.data_epoch, lambda: list(collector.collect()),
                 lambda: urllib.request.urlopen(url, timeout=30).read(), metrics.snapshot]
        with _Watchers(calls) as w:     # watching from before the first batch: the start is raced too
            batches = list(itertools.islice(loader, BATCHES))
        assert not w.errors, w.errors[:3]
        assert w.count > WATCHERS, "the watchers did not run while the batches were read"
        # the state after them is the unwatched one (a resume from it reads the same next samples)
        return batches, loader.rank_state()["stream"]["partitions"]
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        stream.close()


def _stream_run(cfg, watched: bool) -> tuple[list, dict]:
    stream = _open(cfg, 0)
    try:
        rows = iter(stream)
        if not watched:
            keys = [_key(r) for r in itertools.islice(rows, BATCHES * BATCH_SIZE)]
            return keys, stream.state_dict()["partitions"]
        calls = [stream.data_epoch, lambda: metrics.reading(None, metrics.cache_stats(stream.source)),
                 metrics.snapshot]
        with _Watchers(calls) as w:
            keys = [_key(r) for r in itertools.islice(rows, BATCHES * BATCH_SIZE)]
        assert not w.errors, w.errors[:3]
        return keys, stream.state_dict()["partitions"]
    finally:
        stream.close()


def _same(watched, unwatched) -> None:
    (got, got_state), (want, want_state) = watched, unwatched
    flat_got, flat_want = list(itertools.chain.from_iterable(got)), list(itertools.chain.from_iterable(want))
    assert len(flat_got) == len(flat_want)
    twice = len(flat_got) - len(set(flat_got))
    assert got == want, f"the watched run differs from the unwatched one ({twice} samples came out twice)"
    assert json.dumps(got_state, sort_keys=True, default=repr) == json.dumps(want_state, sort_keys=True, default=repr)


@pytest.mark.parametrize("seed", [3, pytest.param(11, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["single", "mixture"])
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_watched_loader_yields_the_unwatched_batches(data, fmt, kind, workers, seed):
    cfg = _config(data, fmt, kind, seed)
    _same(_loader_run(cfg, workers, watched=True), _loader_run(cfg, workers, watched=False))


@pytest.mark.parametrize("seed", [3, pytest.param(11, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["single", "mixture"])
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_a_watched_stream_yields_the_unwatched_samples(data, fmt, kind, seed):
    cfg = _config(data, fmt, kind, seed)
    got, want = _stream_run(cfg, watched=True), _stream_run(cfg, watched=False)
    _same(([got[0]], got[1]), ([want[0]], want[1]))


def _from_another_thread(call):
    got = []
    t = threading.Thread(target=lambda: got.append(call()))
    t.start()
    t.join()
    return got[0]


def test_data_epoch_from_another_thread_follows_the_consumed_rows(data):
    """The published position is the consumer's, exact after each batch, read from a thread that never touches
    the readers (3,000 rows in one partition: 150 batches of 10 are half an epoch)."""
    cfg = _config(data, "parquet", "single", 5)
    stream = _open(cfg, 0)
    loader = StreamLoader(stream, batch_size=BATCH_SIZE, collate_fn=_collate)
    try:
        assert _from_another_thread(loader.data_epoch) == 0.0
        for n, _ in enumerate(itertools.islice(loader, BATCHES), 1):
            assert _from_another_thread(loader.data_epoch) == pytest.approx(n * BATCH_SIZE / 3000, abs=1e-6)
    finally:
        stream.close()
    stream = _open(cfg, 0)
    try:
        assert _from_another_thread(stream.data_epoch) == 0.0
        rows = iter(stream)
        for n in range(1, 3500):
            next(rows)
            if n % 97 == 0 or n in (63, 64, 65, 3000, 3001):      # inside, at the edges of windows and epochs
                assert _from_another_thread(stream.data_epoch) == pytest.approx(n / 3000, abs=1e-6), n
    finally:
        stream.close()
