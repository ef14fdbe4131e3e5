"""The first sample of a window waits for the row group that holds it, not for every row group the window spans:
on a fresh start and on a resume mid-window, with the same samples (and states) as ever."""

from __future__ import annotations

import pyarrow as pa
import pytest
from helpers import parquet_config, take_ids

from resumable_stream import ResumableStream
from resumable_stream.sources.parquet_rows import ParquetFiles
from resumable_stream.stream import partition
from resumable_stream.testing import write_parquet_dataset


@pytest.fixture
def decoded(monkeypatch):
    """Row groups decoded so far, (file, group) in order."""
    seen: list[tuple[int, int]] = []
    row_group = ParquetFiles.row_group

    def counted(self, file, group):
        seen.append((file, group))
        return row_group(self, file, group)

    monkeypatch.setattr(ParquetFiles, "row_group", counted)
    return seen


@pytest.mark.parametrize("prefetch", [0, None])
def test_the_first_sample_waits_for_one_row_group_fresh_and_resumed(tmp_path, decoded, prefetch):
    # 8 files x 2 row groups of 64 rows; a window of 256 rows spans 4 open row groups (blocks of 16)
    files = str(tmp_path / "data")
    write_parquet_dataset(files, rows=1024, files=8, row_group_size=64)
    cfg = parquet_config(files, shuffle=True, buffer_size=256, interleave_shards=4, block_rows=16,
                         prefetch_blocks=prefetch)
    whole = take_ids(ResumableStream(cfg), 1000)

    decoded.clear()
    s = ResumableStream(cfg)
    it = iter(s)
    first = next(it)["id"]
    if prefetch == 0:           # read on the consumer's thread: exactly the row group of the first sample
        assert len(decoded) == 1, decoded
    window = s._readers[0]._window
    assert len({int(k) for k in window.keys[:, 0]}) == 4        # ... of the 4 the window spans
    assert [first] + [next(it)["id"] for _ in range(299)] == whole[:300]
    path = s.save_sidecar(tmp_path / "state")           # mid-window (300 = 256 + 44): its shards reopened mid-way

    decoded.clear()
    resumed = ResumableStream(cfg)
    resumed.load_sidecar(path)
    assert take_ids(resumed, 1) == whole[300:301]
    if prefetch == 0:
        assert len(decoded) == 1, decoded
    assert take_ids(resumed, 699) == whole[301:1000]


def test_consumed_windows_leave_no_reference_cycle(tmp_path):
    """A window's parts hold its row groups: they must be freed when it is consumed, not at the next full
    garbage collection (a cycle through them kept ~60 windows' row groups: 4x the memory of an epoch)."""
    import gc

    files = str(tmp_path / "data")
    write_parquet_dataset(files, rows=1024, files=8, row_group_size=64)
    cfg = parquet_config(files, shuffle=True, buffer_size=256, interleave_shards=4, block_rows=16)
    s = ResumableStream(cfg)
    it = iter(s)
    next(it)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3 * 256):
            next(it)
        gc.set_debug(gc.DEBUG_SAVEALL)          # what a collection finds unreachable, kept to be looked at
        gc.collect()
        held = [type(o).__name__ for o in gc.garbage if isinstance(o, (pa.Table, partition._Take))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not held


def test_closing_the_stream_inside_a_window_whose_shards_are_not_read_yet(tmp_path):
    """``close()`` right after the first sample (the window's other shards planned, not read): iterating again
    gives the samples that follow, the shards reopened where the window needs them."""
    files = str(tmp_path / "data")
    write_parquet_dataset(files, rows=1024, files=8, row_group_size=64)
    cfg = parquet_config(files, shuffle=True, buffer_size=256, interleave_shards=4, block_rows=16)
    whole = take_ids(ResumableStream(cfg), 600)
    s = ResumableStream(cfg)
    assert take_ids(s, 1) == whole[:1]
    s.close()
    assert take_ids(s, 599) == whole[1:600]
