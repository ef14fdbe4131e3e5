"""Large parquet row groups (sources/parquet_rows.py, GroupReading): decoded batch by batch, each batch checked
against the footer's bounds and the group exactly at its end; the samples, cursors and digests are the ones a
whole-group decode gives; a first sample decodes the first batches only; a remote group is fetched in concurrent
ranged reads."""

from __future__ import annotations

import itertools
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import SourceError
from resumable_stream.io import ranged
from resumable_stream.sources import parquet_checks, parquet_rows

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("hub_offline")]


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    for f in range(3):
        rows = [{"id": f * 1000 + i, "text": f"doc {f}/{i} " + "w" * (i % 97), "score": None if i % 7 else i / 3}
                for i in range(1000)]
        pq.write_table(pa.Table.from_pylist(rows), str(d / f"part-{f}.parquet"), row_group_size=500)
    return str(d)


def _run(data: str, large: int, monkeypatch, n: int = 1400, resume_at: int | None = 700, **kw):
    monkeypatch.setattr(parquet_rows, "LARGE_GROUP_BYTES", large)
    monkeypatch.setattr(parquet_rows, "GROUP_BATCH_ROWS", 64)
    from resumable_stream.sources import parquet

    monkeypatch.setattr(parquet, "LARGE_GROUP_BYTES", large)
    monkeypatch.setattr(parquet, "GROUP_BATCH_ROWS", 64)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                       buffer_size=300, **kw)
    s = ResumableStream(cfg)
    rows = list(itertools.islice(s, n))
    state = s.state_dict()
    s.close()
    again = ResumableStream(cfg)
    again.load_state_dict(state)
    more = list(itertools.islice(again, 400))
    again.close()
    return rows, state, more


def test_batch_by_batch_gives_the_samples_cursors_and_digests_of_a_whole_decode(data, monkeypatch):
    whole = _run(data, 1 << 30, monkeypatch)
    batched = _run(data, 1000, monkeypatch)
    assert batched[0] == whole[0] and batched[2] == whole[2]
    assert batched[1]["partitions"] == whole[1]["partitions"]


def test_a_first_sample_decodes_the_first_batches_only(data, monkeypatch):
    decoded = []
    real = parquet_rows.GroupReading._decode_one
    monkeypatch.setattr(parquet_rows.GroupReading, "_decode_one",
                        lambda self: decoded.append(self.group) or real(self))
    monkeypatch.setattr(parquet_rows, "LARGE_GROUP_BYTES", 1000)
    monkeypatch.setattr(parquet_rows, "GROUP_BATCH_ROWS", 64)
    from resumable_stream.sources import parquet

    monkeypatch.setattr(parquet, "LARGE_GROUP_BYTES", 1000)
    monkeypatch.setattr(parquet, "GROUP_BATCH_ROWS", 64)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                       buffer_size=64, interleave_shards=1, prefetch_blocks=0)
    s = ResumableStream(cfg)
    next(iter(s))
    s.close()
    assert 1 <= len(decoded) <= 3        # a 500-row group is 8 batches of 64: the first window needs one or two


def test_a_batch_outside_the_footers_bounds_is_refused(tmp_path):
    path = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"x": list(range(100))}), path, row_group_size=100)
    md = pq.read_metadata(path)
    check = parquet_checks.RunningCheck(md, 0)
    assert check.add(pa.table({"x": list(range(50))})) is None
    assert "outside the footer's 0 .. 99" in check.add(pa.table({"x": [5, 500]}))
    check = parquet_checks.RunningCheck(md, 0)
    assert check.add(pa.table({"x": list(range(1, 100))})) is None
    assert "99 rows decoded, the footer says 100" in check.finish()
    check = parquet_checks.RunningCheck(md, 0)
    assert check.add(pa.table({"x": [1] * 99 + [99]})) is None
    assert "decoded values span 1 .. 99, the footer says 0 .. 99" in check.finish()


def test_wrong_bytes_in_a_large_group_are_an_error_naming_it(data, monkeypatch):
    monkeypatch.setattr(parquet_rows, "LARGE_GROUP_BYTES", 1000)
    from resumable_stream.sources import parquet

    monkeypatch.setattr(parquet, "LARGE_GROUP_BYTES", 1000)
    path = os.path.join(data, "part-0.parquet")
    md = pq.read_metadata(path)
    other = pq.read_metadata(os.path.join(data, "part-1.parquet"))
    assert md.row_group(0).total_byte_size > 0 and other.num_rows == md.num_rows
    real = ranged.read_range

    def lying(p, a, b, options, *x):    # part-0's bytes answered with part-1's at the same range
        return real(p.replace("part-0", "part-1"), a, b, options) if "part-0" in p else real(p, a, b, options, *x)

    monkeypatch.setattr(parquet_rows, "read_range_parallel", lambda p, a, b, *x, **k: lying(p, a, b, *x))
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[path], prefetch_blocks=0)
    s = ResumableStream(cfg)
    with pytest.raises(SourceError, match="part-0.parquet.*row group 0.*(contradict the file's footer|do not decode)"):
        list(itertools.islice(s, 1000))
    s.close()


def test_a_remote_large_group_is_fetched_in_concurrent_ranges(data, monkeypatch):
    from http_server import FileServer

    monkeypatch.setattr(parquet_rows, "LARGE_GROUP_BYTES", 1000)
    from resumable_stream.sources import parquet

    monkeypatch.setattr(parquet, "LARGE_GROUP_BYTES", 1000)
    real = ranged.read_range_parallel
    monkeypatch.setattr(parquet_rows, "read_range_parallel", lambda *a, **k: real(*a, **{**k, "part_bytes": 4096}))
    with FileServer(data) as srv:
        srv.latency_s = 0.05
        urls = [srv.url(f) for f in sorted(os.listdir(data))]
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=urls, shuffle=True, buffer_size=300,
                           prefetch_blocks=0, retries=2, timeout_s=10)
        local = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                             buffer_size=300)
        s = ResumableStream(cfg)
        rows = list(itertools.islice(s, 900))
        s.close()
        assert srv.stats()["max_in_flight"] > 1
    ref = ResumableStream(local)
    assert rows == list(itertools.islice(ref, 900))
    ref.close()


# ------------------------------------------------------------------ wide columns decoded in chunks (read_row_group)
def _chunked(monkeypatch, whole: int = 1000, chunk: int = 400) -> list[int]:
    """Row groups whose widest column chunk holds more than ``whole`` bytes decode in batches of ~``chunk`` bytes of
    it; returns the list the chunk counts of each decoded table are appended to."""
    monkeypatch.setattr(parquet_rows, "WHOLE_DECODE_BYTES", whole)
    monkeypatch.setattr(parquet_rows, "DECODE_CHUNK_BYTES", chunk)
    chunks: list[int] = []
    real = parquet_rows.read_row_group

    def spy(*a):
        table = real(*a)
        chunks.append(max(c.num_chunks for c in table.columns))
        return table

    monkeypatch.setattr(parquet_rows, "read_row_group", spy)
    return chunks


def test_wide_columns_decoded_in_chunks_give_the_samples_cursors_and_digests_of_a_whole_decode(data, monkeypatch):
    whole = _run(data, 1 << 30, monkeypatch)
    with monkeypatch.context() as m:
        chunks = _chunked(m)
        chunked = _run(data, 1 << 30, m)
    assert chunks and min(chunks) > 1          # every row group was decoded in several batches
    assert chunked[0] == whole[0] and chunked[2] == whole[2]
    assert chunked[1]["partitions"] == whole[1]["partitions"]


def test_batch_rows_keep_the_widest_column_near_the_chunk_size(tmp_path, monkeypatch):
    path = str(tmp_path / "w.parquet")
    pq.write_table(pa.table({"id": list(range(4000)), "text": ["x" * 1000] * 4000}), path, row_group_size=4000,
                   compression="none", use_dictionary=False)
    md = pq.read_metadata(path)
    assert parquet_rows.batch_rows(md, 0) is None             # 4 MB: below WHOLE_DECODE_BYTES
    monkeypatch.setattr(parquet_rows, "WHOLE_DECODE_BYTES", 1 << 20)
    rows = parquet_rows.batch_rows(md, 0)                     # 2 MiB of ~4 MB of text: about half the rows
    assert 1800 <= rows <= 2200
    table = parquet_rows.read_row_group(pa.BufferReader(open(path, "rb").read()), md, 0)
    assert table.column("text").num_chunks == 2 and table.equals(pq.read_table(path))
    assert parquet_checks.problem(table, md, 0) is None


def test_a_chunked_table_is_checked_chunk_by_chunk_as_strictly_as_a_whole_one(tmp_path):
    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"x": list(range(100))}), path, row_group_size=100)
    md = pq.read_metadata(path)
    good = pa.Table.from_batches([pa.record_batch({"x": list(range(50))}), pa.record_batch({"x": list(range(50, 100))})])
    assert good.column("x").num_chunks == 2 and parquet_checks.problem(good, md, 0) is None
    outside = pa.Table.from_batches([pa.record_batch({"x": list(range(50))}),
                                     pa.record_batch({"x": list(range(50, 99)) + [500]})])
    assert "outside the footer's 0 .. 99" in parquet_checks.problem(outside, md, 0)
    narrower = pa.Table.from_batches([pa.record_batch({"x": [1] * 50}), pa.record_batch({"x": list(range(50, 100))})])
    assert "decoded values span 1 .. 99, the footer says 0 .. 99" in parquet_checks.problem(narrower, md, 0)
    nulls = pa.Table.from_batches([pa.record_batch({"x": list(range(50))}),
                                   pa.record_batch({"x": [None] + list(range(51, 100))})])
    assert "1 nulls decoded" in parquet_checks.problem(nulls, md, 0)


def test_decoded_chunks_that_contradict_the_footer_are_an_error_naming_the_row_group(data, monkeypatch):
    monkeypatch.setattr(parquet_rows, "WHOLE_DECODE_BYTES", 1000)
    monkeypatch.setattr(parquet_rows, "DECODE_CHUNK_BYTES", 400)
    real = parquet_rows.read_row_group
    chunks = []

    def wrong(source, md, group):    # the last chunk's ids moved past the footer's max (bytes that decode, wrongly)
        table = real(source, md, group)
        batches = table.to_batches()
        chunks.append(len(batches))
        last = batches[-1]
        ids = pa.array([v + 10**6 for v in last.column(0).to_pylist()], last.schema.field(0).type)
        batches[-1] = pa.RecordBatch.from_arrays([ids, *last.columns[1:]], schema=last.schema)
        return pa.Table.from_batches(batches)

    monkeypatch.setattr(parquet_rows, "read_row_group", wrong)
    path = os.path.join(data, "part-0.parquet")
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[path], prefetch_blocks=0)
    s = ResumableStream(cfg)
    with pytest.raises(SourceError, match="part-0.parquet.*row group 0.*contradict the file's footer.*'id'"):
        list(itertools.islice(s, 1000))
    s.close()
    assert chunks == [chunks[0]] * 2 and chunks[0] > 1     # read twice (a retry), several chunks each time
