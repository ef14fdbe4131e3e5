"""data.growth: follow: at the end of the known data the stream waits for new files and reads only those."""

import itertools
import os
import threading

import pytest
from growing_data import ROWS, add, dataset

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.checkpoint import finish, load, save
from resumable_stream.errors import ConfigError


def _cfg(d: str, **kw) -> StreamConfig:
    kw = {"shuffle": True, "buffer_size": 64, "interleave_shards": 2, "block_rows": 16, "growth": "follow",
          "poll_interval_s": 0.05, "follow_timeout_s": 0.5, "num_partitions": 3, **kw}
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(d, "*.parquet"), **kw)


def _ids(stream, n: int | None = None) -> list[int]:
    return [r["id"] for r in itertools.islice(stream, n)]


def _checkpoint(stream, ckpt: str) -> str:
    save(stream, ckpt, stream.state_dict(), manifest=False)
    finish(ckpt, 1)
    return ckpt


def _resume(cfg, ckpt: str) -> ResumableStream:
    s = ResumableStream(cfg, index_from=ckpt)
    load(s, ckpt)
    return s


@pytest.mark.parametrize("key,value", [("poll_interval_s", 0), ("poll_interval_s", "1"), ("follow_timeout_s", -1),
                                       ("follow_timeout_s", float("nan")), ("growth", "tail")])
def test_follow_keys_are_validated(tmp_path, key, value):
    with pytest.raises(ConfigError) as e:
        _cfg(str(tmp_path), **{key: value})
    assert f"data.{key}" in str(e.value) and repr(value) in str(e.value) and "allowed" in str(e.value)


@pytest.mark.parametrize("world_size,workers", [(2, 0), (1, 2)])
def test_follow_refuses_more_than_one_consumer_process(tmp_path, world_size, workers):
    d = dataset(tmp_path)
    with pytest.raises(ConfigError, match="data.growth: got 'follow'.*allowed: follow with one rank"):
        ResumableStream(_cfg(d, num_partitions=4), rank=0, world_size=world_size, num_workers=workers)


def test_follow_reads_the_known_data_once_then_ends_after_the_timeout(tmp_path, caplog):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, follow_timeout_s=0.3))
    with caplog.at_level("WARNING", logger="resumable_stream.stream"):
        ids = _ids(s)
    assert sorted(ids) == list(range(ROWS))      # no second epoch over the old files
    assert "follow: no new files" in caplog.text and "follow_timeout_s" in caplog.text
    assert _ids(s) == []       # iterating again waits again, and ends


def test_follow_picks_up_a_file_written_while_it_waits(tmp_path):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, follow_timeout_s=20))
    first = _ids(s, ROWS)
    writer = threading.Timer(0.3, add, (d, "late", 1000))
    writer.start()
    try:
        new = _ids(s, 100)
    finally:
        writer.join()
    assert sorted(first) == list(range(ROWS))
    assert sorted(new) == list(range(1000, 1100))
    writer2 = threading.Timer(0.3, add, (d, "later", 2000, 50))
    writer2.start()
    try:
        assert sorted(_ids(s, 50)) == list(range(2000, 2050))   # only the newest file: epoch 2
    finally:
        writer2.join()


def test_exact_resume_in_the_middle_of_a_wait(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20)
    a = ResumableStream(cfg)
    assert sorted(_ids(a, ROWS)) == list(range(ROWS))
    ckpt = _checkpoint(a, str(tmp_path / "ckpt"))      # saved at the end of the data: waiting
    add(d, "late", 1000)
    want = _ids(a, 100)
    b = _resume(cfg, ckpt)
    assert _ids(b, 100) == want
    assert sorted(want) == list(range(1000, 1100))


def test_exact_resume_in_the_middle_of_a_new_file(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20)
    a = ResumableStream(cfg)
    _ids(a, ROWS)
    add(d, "late", 1000, 200)
    head = _ids(a, 70)
    ckpt = _checkpoint(a, str(tmp_path / "ckpt"))
    tail = _ids(a, 130)
    assert sorted(head + tail) == list(range(1000, 1200))
    b = _resume(cfg, ckpt)
    assert _ids(b, 130) == tail


def test_append_layout_is_unchanged_by_the_follow_field(tmp_path):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, growth="append"))
    assert s.layout.follow is False
    s.set_epoch(1)
    assert sorted(_ids(s)) == list(range(ROWS))     # append: epoch 1 reads the old files again


def test_follow_is_refused_in_a_mixture(tmp_path):
    d = dataset(tmp_path)
    src = {"dataset_name_or_path": "parquet", "data_files": os.path.join(d, "*.parquet"), "streaming": True}
    with pytest.raises(ConfigError, match=r"data.growth: got 'follow' with data.sources; allowed: off or append"):
        StreamConfig.from_dict({"growth": "follow", "sources": [{**src, "weight": 1}, {**src, "weight": 2}]})


def _loader_ids(it, batches: int) -> list[int]:
    return [row["id"] for batch in itertools.islice(it, batches) for row in batch]


@pytest.mark.parametrize("partitions", [1, 3])
def test_loader_follows_and_resumes_exactly_in_a_wait_and_in_a_new_file(tmp_path, partitions):
    """The StreamLoader (what the Trainer reads) waits between rounds too: a file written while it waits is
    read; a loader state saved at the end of the data and one saved inside the new file both resume exactly."""
    from resumable_stream.checkpoint import read
    from resumable_stream.loader import StreamLoader

    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20, num_partitions=partitions)
    loader = StreamLoader(ResumableStream(cfg), batch_size=8)
    it = iter(loader)
    first = []
    while len(first) < ROWS:
        first += _loader_ids(it, 1)
    assert sorted(first) == list(range(ROWS))

    def checkpoint(name):
        path = str(tmp_path / name)
        save(loader.stream, path, loader.state_dict(), manifest=False)
        finish(path, 1)
        return path

    def resumed(path):
        s = ResumableStream(cfg, index_from=path)
        other = StreamLoader(s, batch_size=8)
        other.load_state_dict(read(s, path)[0], where=path)
        return iter(other)

    in_wait = checkpoint("wait")
    writer = threading.Timer(0.3, add, (d, "late", 1000, 200))
    writer.start()
    try:
        head = _loader_ids(it, 5)
    finally:
        writer.join()
    in_file = checkpoint("file")
    tail = _loader_ids(it, 5)
    assert set(head + tail) <= set(range(1000, 1200)) and len(set(head + tail)) == 80
    assert _loader_ids(resumed(in_wait), 10) == head + tail
    assert _loader_ids(resumed(in_file), 5) == tail
