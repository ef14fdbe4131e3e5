"""How a window's rows are made and handed out (the fast paths of partition.py and stream.py)."""

import itertools

import pyarrow as pa
import pytest
from helpers import take_ids

from resumable_stream import ResumableStream
from resumable_stream.stream.partition import _row_maker


@pytest.mark.parametrize("names", [
    ("id", "text", "label"),
    ("a'b", 'c"d', "e\nf", "", "with space", "ünï", "\\", "x"),
    ("dup", "other", "dup"),                      # a name given twice keeps its last value, as dict(zip()) does
    ("only",),
    tuple(f"c{i}" for i in range(300)),           # past the literal's limit: dict(zip())
    (),
])
def test_rows_are_the_dicts_dict_zip_makes(names):
    n = 5
    columns = [[(j, i) for i in range(n)] for j in range(len(names))]
    got = _row_maker(names)(columns, n)
    want = [dict(zip(names, r)) for r in zip(*columns)] if names else [{} for _ in range(n)]
    assert got == want
    assert [list(r) for r in got] == [list(r) for r in want]      # the same keys in the same order


def test_rows_of_a_table_with_odd_column_names_come_out_whole():
    table = pa.table({"it's": [1, 2], 'say "hi"': ["a", "b"], "__import__('os')": [None, 3.5]})
    names = tuple(table.column_names)
    rows = _row_maker(names)([c.to_pylist() for c in table.columns], table.num_rows)
    assert rows == table.to_pylist()


def test_the_offset_counts_the_samples_handed_out_within_a_window(cfg, source):
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    it = iter(s)
    reader = s._readers[0]
    window = cfg.buffer_size
    for k in (1, 2, 10, window - 1, window, window + 1, 3 * window + 5):
        while reader.cursor.consumed < k:
            next(it)
        assert reader.cursor.consumed == k
        assert reader.offset == (k - 1) % window + 1    # the window of the last sample, until the next one


def test_a_resume_in_mid_window_yields_the_uninterrupted_samples(cfg, source, tmp_path):
    whole = take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), 300)
    for k in (1, 37, cfg.buffer_size, cfg.buffer_size + 9):
        first = ResumableStream(cfg, rank=0, world_size=1, source=source)
        assert take_ids(first, k) == whole[:k]
        path = first.save_sidecar(tmp_path / f"state-{k}")
        resumed = ResumableStream(cfg, rank=0, world_size=1, source=source)
        resumed.load_sidecar(path)
        assert take_ids(resumed, 300 - k) == whole[k:]
        # a state taken before any sample of the resumed stream is the saved one
        again = ResumableStream(cfg, rank=0, world_size=1, source=source)
        again.load_sidecar(path)
        assert again.state_dict()["partitions"] == resumed_state(first)


def resumed_state(stream):
    return stream.state_dict()["partitions"]


def test_iterating_again_continues_where_the_last_iterator_stopped(cfg, source):
    whole = take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), 200)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    got = [r["id"] for r in itertools.islice(iter(s), 70)]
    got += [r["id"] for r in itertools.islice(iter(s), 130)]
    assert got == whole


@pytest.fixture
def whole_windows(monkeypatch):
    """Windows made whole when built (the first part as big as any window): what the two-part windows below
    must give."""
    from resumable_stream.stream import partition

    def set_first(n):
        monkeypatch.setattr(partition, "FIRST_ROWS", n)
    return set_first


@pytest.mark.parametrize("first_rows", [1, 7, 63])
def test_a_window_made_in_two_parts_hands_out_the_samples_a_whole_one_does(cfg, source, whole_windows, first_rows,
                                                                           tmp_path):
    """A window makes at most FIRST_ROWS rows before its first sample and the rest when the consumer reaches them: the
    same samples in the same order (with their keys), and a save just before, at and after the part's end (the
    next sample's digest made from rows not yet made) resumes exactly."""
    whole_windows(10**9)
    n = 3 * cfg.buffer_size + 11
    whole = take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), n)
    pairs = [(row["id"], key) for row, key in
             itertools.islice(ResumableStream(cfg, rank=0, world_size=1, source=source).iter_partition(0), n)]
    whole_windows(first_rows)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    assert take_ids(s, 1) == whole[:1]
    win = s._readers[0]._window
    # the rest not made yet: at most FIRST_ROWS (fewer: the first part stops at the first row of a shard still
    # being read, stream/partition.py)
    assert len(win) == cfg.buffer_size and 1 <= len(win.rows) <= first_rows
    assert take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), n) == whole
    assert [(row["id"], key) for row, key in itertools.islice(
        ResumableStream(cfg, rank=0, world_size=1, source=source).iter_partition(0), n)] == pairs
    for k in (first_rows - 1, first_rows, first_rows + 1, cfg.buffer_size + first_rows):
        first = ResumableStream(cfg, rank=0, world_size=1, source=source)
        it = iter(first)
        assert [row["id"] for row in itertools.islice(it, k)] == whole[:k]
        path = first.save_sidecar(tmp_path / f"state-{first_rows}-{k}")   # the digest of sample k: made now
        assert [row["id"] for row in itertools.islice(it, 20)] == whole[k:k + 20]   # the same iterator goes on
        resumed = ResumableStream(cfg, rank=0, world_size=1, source=source)
        resumed.load_sidecar(path)
        assert take_ids(resumed, n - k) == whole[k:]


@pytest.mark.parametrize("take_rows", [10**6, 12])
@pytest.mark.parametrize("part_rows", [1, 5, 16])
def test_a_window_made_part_by_part_hands_out_the_samples_a_whole_one_does(cfg, source, whole_windows, monkeypatch,
                                                                          part_rows, take_rows, tmp_path):
    """After its first part a window makes PART_ROWS rows at a time and lets go of each part once the next is made:
    the same samples and keys as windows made whole, a save at, before and after a part's end resumes exactly, and
    the window holds no more than one part. ``take_rows``: the rows taken from the window's tables at once (parts
    sliced from them; 12: blocks that end inside a part of 5 or 16)."""
    from resumable_stream.stream import partition

    monkeypatch.setattr(partition, "TAKE_ROWS", take_rows)
    whole_windows(10**9)
    n = 2 * cfg.buffer_size + 13
    whole = take_ids(ResumableStream(cfg, rank=0, world_size=1, source=source), n)
    pairs = [(row["id"], key) for row, key in
             itertools.islice(ResumableStream(cfg, rank=0, world_size=1, source=source).iter_partition(0), n)]
    whole_windows(7)
    monkeypatch.setattr(partition, "PART_ROWS", part_rows)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    it = iter(s)
    got = []
    for _ in range(n):
        got.append(next(it)["id"])
        win = s._readers[0]._window
        assert len(win.rows) <= max(7, part_rows) and win.lo <= s._readers[0].offset <= win.lo + len(win.rows)
    assert got == whole
    assert [(row["id"], key) for row, key in itertools.islice(
        ResumableStream(cfg, rank=0, world_size=1, source=source).iter_partition(0), n)] == pairs
    for k in (6, 7, 8, 7 + part_rows, 7 + 2 * part_rows + 1, cfg.buffer_size + 7 + part_rows):
        first = ResumableStream(cfg, rank=0, world_size=1, source=source)
        it = iter(first)
        assert [row["id"] for row in itertools.islice(it, k)] == whole[:k]
        path = first.save_sidecar(tmp_path / f"state-{part_rows}-{k}")
        assert [row["id"] for row in itertools.islice(it, 20)] == whole[k:k + 20]
        resumed = ResumableStream(cfg, rank=0, world_size=1, source=source)
        resumed.load_sidecar(path)
        assert take_ids(resumed, n - k) == whole[k:]
