"""Exact resume: for any stop point, save + resume continues with what an uninterrupted run yields."""

import itertools
import json
import os
import subprocess
import sys

import pytest
from helpers import parquet_config, take_ids, through_sidecar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable_stream import ResumableStream
from resumable_stream.sources import Source, open_source

_SOURCES = {}


def _source(cfg):
    key = (cfg.data_files, cfg.streaming)
    if key not in _SOURCES:
        _SOURCES[key] = open_source(cfg.source_spec)
    return _SOURCES[key]


def _check_resume(cfg, world_size, rank, num_workers, stop, more):
    source = _source(cfg)
    make = lambda: ResumableStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers,  # noqa: E731
                                   source=source)
    reference = take_ids(make(), stop + more)
    first = make()
    head = take_ids(first, stop)
    state = through_sidecar(first.state_dict())   # through the sidecar bytes
    resumed = make()
    resumed.load_state_dict(state)
    tail = take_ids(resumed, more)
    assert head + tail == reference, f"diverged at {next(i for i, (a, b) in enumerate(zip(head + tail, reference)) if a != b)}"
    # the first stream itself also continues correctly after a save
    assert take_ids(first, more) == tail


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_size=st.integers(1, 3),
    num_workers=st.sampled_from([0, 2]),
    buffer_size=st.sampled_from([1, 7, 50, 64, 333]),
    interleave=st.sampled_from([1, 2, 4]),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_resume_at_any_stop_point(parquet_small, world_size, num_workers, buffer_size, interleave, shuffle, data):
    cfg = parquet_config(parquet_small, shuffle=shuffle, buffer_size=buffer_size, interleave_shards=interleave,
                         block_rows=16)
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    per_rank = 1000 // world_size
    stop = data.draw(st.integers(0, int(per_rank * 2.3)), label="stop")
    _check_resume(cfg, world_size, rank, num_workers, stop, more=120)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(3, 5), buffer_size=st.sampled_from([5, 40]), data=st.data())
def test_resume_with_row_striding(parquet_two_shards, world_size, buffer_size, data):
    cfg = parquet_config(parquet_two_shards, shuffle=True, buffer_size=buffer_size)
    rank = data.draw(st.integers(0, world_size - 1))
    stop = data.draw(st.integers(0, 2 * 300 // world_size + 5))
    _check_resume(cfg, world_size, rank, 0, stop, more=60)


def _epoch_length(cfg, world_size, rank):
    s = ResumableStream(cfg, rank=rank, world_size=world_size, source=_source(cfg))
    s.set_epoch(0)
    return sum(1 for _ in s)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_at_window_shard_and_epoch_boundaries(parquet_small, shuffle, world_size):
    buffer = 50   # = row group size: window and shard boundaries coincide without shuffle
    cfg = parquet_config(parquet_small, shuffle=shuffle, buffer_size=buffer)
    epoch = _epoch_length(cfg, world_size, 0)
    stops = {0, 1, buffer - 1, buffer, buffer + 1, 3 * buffer, epoch - 1, epoch, epoch + 1, 2 * epoch,
             2 * epoch + buffer}
    for stop in sorted(stops):
        _check_resume(cfg, world_size, 0, 0, stop, more=buffer + 20)


def test_resume_in_finite_epoch_mode(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    source = _source(cfg)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    s.set_epoch(0)
    full = [r["id"] for r in s]
    s2 = ResumableStream(cfg, rank=0, world_size=1, source=source)
    s2.set_epoch(0)
    head = [r["id"] for r in itertools.islice(s2, 333)]
    state = s2.state_dict()
    s3 = ResumableStream(cfg, rank=0, world_size=1, source=source)
    s3.load_state_dict(state)
    s3.set_epoch(0)
    assert head + [r["id"] for r in s3] == full


def test_streaming_false_resumes_exactly(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64, streaming=False)
    for stop in (0, 63, 64, 500, 1000, 1700):
        _check_resume(cfg, 2, 1, 0, stop, more=100)


class CountingSource(Source):
    """Wraps a source and counts the rows it hands out."""

    def __init__(self, inner):
        self.inner, self.rows_read = inner, 0
        self.shards, self.fingerprint, self.column_names = inner.shards, inner.fingerprint, inner.column_names

    def read(self, shard, start_row=0):
        # the streaming source re-reads a shard's prefix to reach start_row: count it too
        self.rows_read += start_row if start_row else 0
        for table in self.inner.read(shard, start_row):
            self.rows_read += table.num_rows
            yield table


@pytest.mark.parametrize("stop", [1_000, 2_950, 5_900])
def test_resume_reads_one_window_not_the_past(parquet_60, stop):
    """Resume cost is one window plus the prefix of each open shard, however far the run went."""
    cfg = parquet_config(parquet_60, shuffle=True, buffer_size=256, interleave_shards=4)
    s = ResumableStream(cfg, rank=0, world_size=1)
    take_ids(s, stop)
    state = s.state_dict()
    counting = CountingSource(s.source)
    resumed = ResumableStream(cfg, rank=0, world_size=1, source=counting)
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    row_group = 100
    bound = 256 + 4 * row_group + 4 * row_group   # window + per open shard: its prefix and one read batch
    assert counting.rows_read <= bound, f"resume read {counting.rows_read} rows, bound {bound}"
    # ... and those rows (read through the counting source) continue the run where it stopped
    assert counting.rows_read > 0 and [first["id"]] + take_ids(resumed, 49) == take_ids(s, 50)


def _cli(*args, cwd=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "resumable_stream.app.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_resume_in_a_new_process_via_cli(parquet_60, tmp_path):
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(
        "model: {name_or_path: tiny}\n"
        f"data:\n  dataset_name_or_path: parquet\n  data_files: {parquet_60}/*.parquet\n"
        "  shuffle: true\n  shuffle_seed: 3\n  buffer_size: 300\n"
    )
    full = _cli("peek", str(yaml_path), "--rank", "1", "--world-size", "2", "--num", "1500", "--fields", "id")
    assert full.returncode == 0, full.stderr
    reference = [json.loads(line)["id"] for line in full.stdout.splitlines()]
    state = tmp_path / "state.safetensors"
    head = _cli("peek", str(yaml_path), "--rank", "1", "--world-size", "2", "--num", "777", "--fields", "id",
                "--save-state", str(state))
    assert head.returncode == 0, head.stderr
    tail = _cli("peek", str(yaml_path), "--rank", "1", "--world-size", "2", "--num", "723", "--fields", "id",
                "--resume-from", str(state))
    assert tail.returncode == 0, tail.stderr
    got = [json.loads(line)["id"] for line in head.stdout.splitlines() + tail.stdout.splitlines()]
    assert len(reference) == 1500 and got == reference


def test_a_state_dict_is_plain_values_that_torch_loads_with_weights_only(parquet_small, tmp_path):
    """state_dict() holds ints, strings and lists (the typed states' to_dict()), so a user's torch.save of it
    loads with torch.load(weights_only=True), the default since torch 2.6, and resumes exactly."""
    import torch

    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64, num_partitions=3)
    source = _source(cfg)
    first = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(first, 77)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = ResumableStream(cfg, rank=0, world_size=1, source=source)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert take_ids(resumed, 50) == take_ids(first, 50)


def test_samples_changed_by_the_consumer_change_nothing_that_follows(parquet_small):
    """A window's rows are handed out as they are (made once per window): a consumer that changes or empties
    the samples it got changes neither the samples after them nor the saved state."""
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    source = _source(cfg)
    reference = take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), 200)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    it = iter(s)
    got = []
    for _ in range(100):
        sample = next(it)
        got.append(sample["id"])
        sample.clear()
        sample["id"] = -1
    state = through_sidecar(s.state_dict())
    got += [next(it)["id"] for _ in range(100)]
    assert got == reference
    resumed = ResumableStream(cfg, rank=0, world_size=1, source=source)
    resumed.load_state_dict(state)
    assert take_ids(resumed, 100) == reference[100:]
