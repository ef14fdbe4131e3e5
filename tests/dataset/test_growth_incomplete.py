"""A growing dataset and files still being written (issue 35, item 3): a new file that is not complete (a tar
without its end-of-archive blocks or cut inside a member or a header, a parquet file without its footer) does
not join; it is listed again at the next refresh or resume and joins once complete, and no resume is stuck on a
file it saw half-written."""

from __future__ import annotations

import itertools
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from growing_data import ROWS, dataset
from wds_data import text_samples, write_tar, write_tars

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import IncompleteFileError, SourceError
from resumable_stream.sources import open_source, tar_index
from resumable_stream.state.checkpoint import finish
from resumable_stream.testing import synthetic_rows

pytestmark = pytest.mark.timeout(180)


def _save(stream, ckpt: str) -> str:
    stream.save_sidecar(ckpt, manifest=False)
    finish(ckpt, 1)
    return ckpt


def _resume(cfg, ckpt: str) -> ResumableStream:
    s = ResumableStream(cfg, index_from=ckpt)
    s.load_sidecar(ckpt)
    return s


def _keys(stream, n: int | None = None) -> list[str]:
    return [r["__key__"] for r in itertools.islice(stream, n)]


def _epoch(stream, epoch: int) -> list[str]:
    stream.set_epoch(epoch)
    return _keys(stream)


def _tar_bytes(tmp_path, file: int, n: int = 10) -> bytes:
    path = write_tar(str(tmp_path / f"whole-{file}.tar"), text_samples(file, n))
    with open(path, "rb") as f:
        return f.read()


def _cut(data: bytes, where: str) -> bytes:
    """``data`` (a whole tar) as a writer has it half-way: ``where`` it stops."""
    samples = tar_index.scan_tar("t.tar", len(data), lambda a, b: data[a:b])
    _, offset, size = samples[-1][1][-1]
    end = offset + size + (-size % tar_index.BLOCK)         # the end of the last member: the end blocks follow
    return {"no end blocks": data[:end], "one end block": data[:end + tar_index.BLOCK],
            "inside a member": data[:offset + 3], "inside a header": data[:offset - 200], "empty": b""}[where]


def _wds_cfg(d, **kw) -> StreamConfig:
    kw = {"growth": "append", "shuffle": False, **kw}
    return StreamConfig(dataset_name_or_path="webdataset", data_files=str(d / "*.tar"), **kw)


@pytest.mark.parametrize("where", ["no end blocks", "one end block", "inside a member", "inside a header"])
def test_a_tar_half_written_at_a_resume_joins_once_complete_and_the_resume_after_is_not_stuck(tmp_path, caplog,
                                                                                              where):
    """The issue's case: the half-written tar was indexed as a short one (a 'cut short' bad sample, the rest
    missing; cut inside a header: refused); once the writer finished it every resume failed with a
    StreamMismatchError (size / mtime changed)."""
    d = tmp_path / "d"
    write_tars(d, 2, 10)
    cfg = _wds_cfg(d)
    first = ResumableStream(cfg)
    head = _keys(first, 5)
    ckpt = _save(first, str(tmp_path / "ckpt"))
    whole = _tar_bytes(tmp_path, 9)
    new = str(d / "z9.tar")
    with open(new, "wb") as f:
        f.write(_cut(whole, where))
    with caplog.at_level("WARNING", logger="resumable_stream"):
        resumed = _resume(cfg, ckpt)
    assert len(head) + len(_epoch(resumed, 0)) == 20
    resumed.set_epoch(1)
    mid = _keys(resumed, 7)
    assert all(not k.startswith("f9/") for k in mid)
    ckpt2 = _save(resumed, str(tmp_path / "ckpt2"))       # its index has not seen z9.tar
    rest = _keys(resumed)
    assert len(mid + rest) == 20
    with open(new, "wb") as f:                             # the writer finishes it (in place)
        f.write(whole)
    again = _resume(cfg, ckpt2)                            # not a StreamMismatchError
    assert _epoch(again, 1) == rest                        # epoch 1 keeps its files
    keys = _epoch(again, 2)
    assert sorted(keys) == sorted([k for i in (0, 1, 9) for k, _ in text_samples(i, 10)])
    assert f"data file {new!r}: not a complete tar" in caplog.text and "left out until it is complete" in caplog.text


def test_a_parquet_file_being_written_joins_a_running_job_once_its_footer_is_there(tmp_path, caplog):
    d = dataset(tmp_path)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(d, "*.parquet"), shuffle=True,
                       buffer_size=64, growth="append")
    s = ResumableStream(cfg)
    head = [r["id"] for r in itertools.islice(s, 50)]
    path = os.path.join(d, "part-00009.parquet")
    table = pa.table(synthetic_rows(1000, 100))
    writer = pq.ParquetWriter(path, table.schema)
    writer.write_table(table, row_group_size=25)            # row groups written, the footer not yet
    with caplog.at_level("WARNING", logger="resumable_stream"):
        assert s.refresh_files() is None
    assert f"data file {path!r}: not a complete parquet file" in caplog.text
    writer.close()
    assert s.refresh_files() == 1
    s.set_epoch(0)
    assert len(head) + len([r["id"] for r in s]) == ROWS
    s.set_epoch(1)
    assert sorted(r["id"] for r in s) == list(range(ROWS)) + list(range(1000, 1100))
    # without growth a parquet file without its footer is the SourceError it was
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(IncompleteFileError, match="part-00009.parquet.*not a complete parquet file"):
        open_source(StreamConfig(dataset_name_or_path="parquet", data_files=path).source_spec)
    with open(path, "wb") as f:
        f.write(b"not parquet at all")
    with pytest.raises(SourceError, match="not a parquet file") as e:
        open_source(StreamConfig(dataset_name_or_path="parquet", data_files=path).source_spec)
    assert not isinstance(e.value, IncompleteFileError)


def test_follow_waits_for_a_file_being_written_and_reads_it_once_complete(tmp_path):
    d = tmp_path / "d"
    write_tars(d, 1, 10)
    cfg = _wds_cfg(d, growth="follow", poll_interval_s=0.05, follow_timeout_s=20)
    s = ResumableStream(cfg)
    assert len(_keys(s, 10)) == 10
    whole = _tar_bytes(tmp_path, 9)
    new = d / "z9.tar"
    new.write_bytes(_cut(whole, "inside a member"))

    def finish_writing():
        new.write_bytes(whole)

    writer = threading.Timer(0.5, finish_writing)
    writer.start()
    try:
        got = list(itertools.islice(s, 10))
    finally:
        writer.join()
    # all of it, whole: not the half seen at the first polls (its last sample cut short)
    assert [(r["__key__"], r["txt"], r["__bad_sample__"]) for r in got] == [
        (k, m["txt"].decode(), None) for k, m in text_samples(9, 10)]


def test_growth_leaves_out_an_incomplete_file_at_the_first_start_and_a_static_dataset_keeps_it(tmp_path, caplog):
    """At a growing job's very first start a tar still being written is left out like a new one (indexed, it
    would stop the first resume after the writer finished). Without growth a tar cut short is the data
    error it was: its last sample a bad sample, the file indexed as it stands."""
    d = tmp_path / "d"
    write_tars(d, 1, 10)
    whole = _tar_bytes(tmp_path, 9)
    new = d / "z9.tar"
    new.write_bytes(_cut(whole, "inside a member"))
    with caplog.at_level("WARNING", logger="resumable_stream"):
        s = ResumableStream(_wds_cfg(d))
    assert "not a complete tar" in caplog.text
    assert [f["path"] for f in s.source.index["files"]] == [str(d / "shard-000.tar")]
    assert len(_keys(s, 10)) == 10
    static = open_source(StreamConfig(dataset_name_or_path="webdataset", data_files=str(d / "*.tar")).source_spec)
    rows = [r for i in range(len(static.shards)) for t in static.read(i) for r in t.to_pylist()]
    assert len(rows) == 20 and "is cut short by the end of the tar" in rows[-1]["__bad_sample__"]
    new.write_bytes(whole)
    assert s.refresh_files() == 1
    assert len(_epoch(s, 1)) == 20
    only = tmp_path / "only"
    only.mkdir()
    (only / "a.tar").write_bytes(_cut(whole, "no end blocks"))
    with pytest.raises(SourceError, match="none of the 1 data file"):
        ResumableStream(_wds_cfg(only))
