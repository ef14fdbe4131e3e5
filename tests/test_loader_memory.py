"""StreamLoader's memory is bounded: it keeps what the next state save or consumed-log write needs, nothing
that grows with the batches consumed (sample keys are kept only for a consumer that asked for them)."""

import gc
import subprocess
import sys
import time

import psutil
import pytest
from helpers import parquet_config

from resumable_stream import ConfigError, ResumableStream
from resumable_stream.loader import StreamLoader
from resumable_stream.testing import write_parquet_dataset

MiB = 2**20


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    """2000 rows of a few bytes in 20 row groups of 100: an epoch is 2000 batches of one row."""
    d = tmp_path_factory.mktemp("tiny_rows")
    write_parquet_dataset(str(d), rows=2000, files=4, row_group_size=100, words=1)
    return parquet_config(str(d), shuffle=True, buffer_size=64)


def _loader(cfg, **kw) -> StreamLoader:
    stream = ResumableStream(cfg, rank=0, world_size=1, num_workers=0)
    return StreamLoader(stream, batch_size=1, num_workers=0, **kw)


# Run in a process of its own: CPython 3.11's tracemalloc.start() / stop() race with any thread allocating at
# that moment (python/cpython#128679, fixed in 3.12.9 / 3.13.2 only) and crash the interpreter later. There
# tracing starts before the stream starts a thread and stops only once close() joined them all.
_TRACED_LOADER = """
import gc, sys, tracemalloc
from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader

tracemalloc.start()
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=sys.argv[1], shuffle=True, buffer_size=64)
stream = ResumableStream(cfg, rank=0, world_size=1, num_workers=0)
it = iter(StreamLoader(stream, batch_size=1, num_workers=0))
for _ in range(2500):    # past the first epoch: every shard, footer and pool thread opened once
    next(it)
gc.collect()
before = tracemalloc.get_traced_memory()[0]
for _ in range(3000):
    next(it)
gc.collect()
growth = tracemalloc.get_traced_memory()[0] - before
stream.close()
tracemalloc.stop()
print("growth", growth)
"""


@pytest.mark.slow     # a process of its own
def test_loader_keeps_nothing_per_batch_without_a_key_consumer(tiny_rows):
    r = subprocess.run([sys.executable, "-c", _TRACED_LOADER, str(tiny_rows.data_files)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = int(r.stdout.split("growth")[-1])
    # what stays is the current window, open shards, prefetch futures and torch's profiler records (< 100 kB
    # however long it runs); keeping each batch's keys costs ~120 B a batch (~500 kB here)
    assert growth < 192 * 1024, f"{growth} bytes more after 3000 batches: something accumulates per batch"


def test_consumed_keys_are_kept_only_when_asked_for(tiny_rows):
    loader = _loader(tiny_rows)
    it = iter(loader)
    next(it)
    with pytest.raises(ConfigError, match="keep_keys=True"):
        loader.pop_consumed_keys()

    keeping = _loader(tiny_rows, keep_keys=True)
    it = iter(keeping)
    batches = [next(it) for _ in range(3)]
    assert len(keeping.pop_consumed_keys()) == 3 and keeping.pop_consumed_keys() == []
    assert batches and keeping.batches_consumed == 3


@pytest.mark.slow
def test_rss_stays_flat_over_a_million_batches(tiny_rows):
    """The requirement's figure: over 1M consumed batches RSS grows < 30 MiB after the first 50k."""
    loader = _loader(tiny_rows)
    it = iter(loader)
    proc = psutil.Process()
    t0 = time.perf_counter()
    for _ in range(50_000):
        next(it)
    gc.collect()
    after_50k = proc.memory_info().rss
    for _ in range(950_000):
        next(it)
    gc.collect()
    end = proc.memory_info().rss
    seconds = time.perf_counter() - t0
    print(f"RSS after 50k batches {after_50k / MiB:.1f} MiB, after 1M {end / MiB:.1f} MiB "
          f"({(end - after_50k) / MiB:+.1f} MiB), {seconds:.1f} s, {seconds:.0f} us a batch")
    assert loader.batches_consumed == 1_000_000
    assert end - after_50k < 30 * MiB, (f"RSS grew {(end - after_50k) / MiB:.1f} MiB from 50k to 1M batches "
                                        f"({after_50k / MiB:.1f} -> {end / MiB:.1f} MiB)")
