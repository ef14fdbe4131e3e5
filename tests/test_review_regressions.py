"""Regressions found in review: set_epoch after resume, empty files, 0-row row groups, peek state dirs."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import parquet_config, take_ids

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.app.cli import main
from resumable_stream.loader import StreamLoader
from resumable_stream.testing import write_jsonl_dataset
from resumable_stream.transforms.errors import TransformError


def test_set_epoch_after_resuming_at_the_end_of_that_epoch(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    ref = ResumableStream(cfg, rank=0, world_size=1)
    ref.set_epoch(0)
    epoch0 = [r["id"] for r in ref]
    ref.set_epoch(1)
    epoch1 = [r["id"] for r in ref]

    s = ResumableStream(cfg, rank=0, world_size=1)
    s.set_epoch(0)
    assert [r["id"] for r in s] == epoch0
    state = s.state_dict()                       # saved after finishing epoch 0
    r = ResumableStream(cfg, rank=0, world_size=1)
    r.load_state_dict(state)
    r.set_epoch(0)
    assert list(r) == [], "epoch 0 is finished: nothing is replayed"
    r.set_epoch(1)
    assert [x["id"] for x in r] == epoch1


def test_set_epoch_continues_a_resumed_epoch_without_false_mismatch(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    s = ResumableStream(cfg, rank=0, world_size=1)
    s.set_epoch(1)
    head = take_ids(s, 300)
    rest_expected = take_ids(s, 700)
    s2 = ResumableStream(cfg, rank=0, world_size=1)
    s2.set_epoch(1)
    take_ids(s2, 300)
    r = ResumableStream(cfg, rank=0, world_size=1)
    r.load_state_dict(s2.state_dict())
    r.set_epoch(1)
    assert [x["id"] for x in r] == rest_expected
    assert sorted(head + rest_expected) == list(range(1000)), "epoch 1 is every row once"


def test_an_empty_file_does_not_kill_a_multi_rank_run(tmp_path):
    write_jsonl_dataset(str(tmp_path), rows=300, files=3)
    (tmp_path / "part-00003.jsonl").write_text("")
    cfg = StreamConfig(dataset_name_or_path="json", data_files=str(tmp_path / "*.jsonl"), shuffle=True,
                       buffer_size=16)
    for rank in range(3):
        s = ResumableStream(cfg, rank=rank, world_size=3)
        ids = take_ids(s, 600)          # several epochs, some of which give this rank only the empty file
        assert len(ids) == 600


def test_zero_row_row_groups_are_left_out(tmp_path):
    table = pa.table({"id": list(range(10))})
    with pq.ParquetWriter(tmp_path / "a.parquet", table.schema) as w:
        w.write_table(table)
        w.write_table(table.slice(0, 0))
        w.write_table(pa.table({"id": list(range(10, 20))}))
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=str(tmp_path / "a.parquet"), shuffle=True,
                       buffer_size=4)
    s = ResumableStream(cfg, rank=0, world_size=1)
    s.set_epoch(0)
    assert sorted(r["id"] for r in s) == list(range(20))


class _SkipAll:
    """A transform that never makes an example (like a wrong column name with empty: skip)."""

    def __init__(self):
        self.n = 0

    def feed(self, sample, key):
        self.n += 1

    def ready(self):
        return 0

    def stats(self):
        return {"skipped_empty": self.n}

    def state(self):
        return {"tensors": {}, "meta": {}}

    def load_state(self, state):
        pass

    def fingerprint(self):
        return {"skip": "all"}


def test_a_transform_that_skips_everything_fails_instead_of_spinning(parquet_small):
    cfg = parquet_config(parquet_small, buffer_size=64)
    loader = StreamLoader(ResumableStream(cfg, rank=0, world_size=1), batch_size=4, processor_factory=_SkipAll)
    with pytest.raises(TransformError, match="produced no training example"):
        next(iter(loader))


def test_peek_state_directory_for_one_rank_of_several(parquet_small, tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"dataset_name_or_path: parquet\ndata_files: {parquet_small}/*.parquet\nshuffle: true\n"
                        "buffer_size: 32\n")
    assert main(["peek", str(cfg_path), "--world-size", "2", "--rank", "1", "--num", "6", "--fields", "id",
                 "--save-state", str(tmp_path / "st")]) == 0
    first = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
    assert main(["peek", str(cfg_path), "--world-size", "2", "--rank", "1", "--num", "6", "--fields", "id",
                 "--resume-from", str(tmp_path / "st")]) == 0
    second = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
    whole = take_ids(ResumableStream(StreamConfig.from_yaml(str(cfg_path)), rank=1, world_size=2), 12)
    assert first + second == whole
    assert not os.path.exists(tmp_path / "st" / "manifest.json")
