"""Virtual partitions and elastic resume at the stream / loader level (real parquet data, real workers).

``data.num_partitions`` fixes the ordered partitions; ranks x workers only decide who reads them. A
checkpoint written by W ranks resumes on W' ranks (``data.elastic: true``): every partition continues
from its own cursor, so across the change every row of an epoch is read exactly once.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections import Counter

import pytest
import torch
from helpers import parquet_config, shared_source, take_ids, through_sidecar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream import ConfigError, ResumableStream, StreamMismatchError
from resumable_stream.errors import SidecarError
from resumable_stream.loader import StreamLoader
from resumable_stream.state.checkpoint import read_state_file, write_manifest
from resumable_stream.transforms import TextProcessor, TransformConfig, collate

ROOT = REPO_ROOT
TOK_DIR = os.path.join(ROOT, "examples", "tiny", "tokenizer")
ROWS = 6000          # parquet_60: 60 shards of 100 rows
N = 12               # virtual partitions: 5 shards (500 rows) each
BATCH = 10           # divides 500: partitions end an epoch on a batch boundary


@pytest.fixture(scope="module")
def cfg(parquet_60):
    return parquet_config(parquet_60, shuffle=True, buffer_size=64, num_partitions=N)


def _stream(cfg, world, workers, rank, **changes):
    return ResumableStream(cfg.replace(**changes) if changes else cfg, rank=rank, world_size=world,
                           num_workers=workers, source=shared_source(cfg))


def _assert_each_row_once(ids, note=""):
    counts = Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(ROWS)) - set(counts))
    assert not twice and not missing, f"read twice: {twice[:10]}, never read: {missing[:10]} {note}"
    assert len(ids) == ROWS


# ------------------------------------------------------------------------------------ who reads which partition
def test_default_is_one_partition_per_consumer_as_before(cfg):
    plain = cfg.replace(num_partitions=None)
    for world, workers in [(1, 0), (2, 0), (3, 2)]:
        for rank in range(world):
            s = _stream(plain, world, workers, rank)
            slots = max(1, workers)
            assert s.layout.num_partitions == world * slots
            assert s.partitions == [rank * slots + w for w in range(slots)]
            assert s.lanes == [[rank * slots + w] for w in range(slots)]
            # setting num_partitions to its default changes nothing: same samples, same state
            explicit = _stream(plain.replace(num_partitions=world * slots), world, workers, rank)
            a, b = take_ids(s, 150), take_ids(explicit, 150)
            assert a == b
            assert s.state_dict() == explicit.state_dict()


def test_partitions_are_split_evenly_and_disjointly(cfg):
    for world, workers in [(1, 0), (2, 2), (3, 0), (4, 3), (5, 2), (12, 0)]:
        owned = []
        for rank in range(world):
            s = _stream(cfg, world, workers, rank)
            assert len(s.lanes) == max(1, workers) and all(s.lanes)
            assert sorted(p for lane in s.lanes for p in lane) == s.partitions
            owned.append(s.partitions)
        flat = [p for ps in owned for p in ps]
        assert sorted(flat) == list(range(N)), (world, workers, owned)
        sizes = [len(ps) for ps in owned]
        assert max(sizes) - min(sizes) <= 1, (world, workers, sizes)


def test_a_partition_reads_the_same_rows_in_the_same_order_on_any_topology(cfg):
    """What a virtual partition yields depends on the data, the config and N only."""
    def sequences(world, workers):
        out = {}
        for rank in range(world):
            s = _stream(cfg, world, workers, rank)
            s.set_epoch(0)
            for p in s.partitions:
                out[p] = [sample["id"] for sample, _ in s.iter_partition(p)]
        return out

    one = sequences(1, 0)
    assert sorted(one) == list(range(N)) and all(len(v) == ROWS // N for v in one.values())
    _assert_each_row_once([i for v in one.values() for i in v])
    assert sequences(3, 2) == one
    assert sequences(4, 0) == one


def test_fewer_partitions_than_consumers_is_a_config_error(cfg):
    with pytest.raises(ConfigError) as e:
        _stream(cfg.replace(num_partitions=4), 3, 2, 0)
    msg = str(e.value)
    assert "data.num_partitions" in msg and "got 4" in msg and "at least ranks x workers = 6" in msg


# ------------------------------------------------------------------------------ elastic resume, bare streams
def _run_and_save(cfg, state_dir, world, workers, stops, resume_from=None):
    """``world`` ranks each read ``stops[r]`` samples of epoch 0 (after resuming from ``resume_from``) and
    write their sidecars plus the manifest into ``state_dir``. Returns the ids read."""
    ids = []
    for rank in range(world):
        s = _stream(cfg, world, workers, rank)
        if resume_from:
            s.load_sidecar(resume_from)
        s.set_epoch(0)
        ids += take_ids(s, stops[rank])
        s.save_sidecar(state_dir)
    write_manifest(state_dir, world)
    return ids


def _finish_epoch(cfg, resume_from, world, workers):
    ids = []
    for rank in range(world):
        s = _stream(cfg, world, workers, rank)
        s.load_sidecar(resume_from)
        s.set_epoch(0)
        ids += [row["id"] for row in s]
    return ids


TOPOLOGIES = [(1, 0), (1, 2), (2, 0), (2, 2), (3, 0), (3, 2), (4, 3), (6, 0), (12, 0)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=st.lists(st.sampled_from(TOPOLOGIES), min_size=3, max_size=3), data=st.data())
def test_elastic_changes_read_every_row_of_the_epoch_exactly_once(cfg, tmp_path_factory, chain, data):
    """W -> W' -> W'': stop at random points on the first two topologies, finish the epoch on the third."""
    elastic = cfg.replace(elastic=True)
    base = tmp_path_factory.mktemp("chain")
    ids, resume_from = [], None
    left = {p: ROWS // N for p in range(N)}
    for step, (world, workers) in enumerate(chain[:2]):
        stops = []
        for rank in range(world):
            s = _stream(elastic, world, workers, rank)
            room = sum(left[p] for p in s.partitions)
            stops.append(data.draw(st.integers(0, room), label=f"stop {step} rank {rank}"))
        state_dir = str(base / f"step{step}")
        ids += _run_and_save(elastic, state_dir, world, workers, stops, resume_from)
        resume_from = state_dir
        for rank in range(world):   # rows left per partition, from the saved cursors
            for p, ps in read_state_file(os.path.join(state_dir, f"rank-{rank:05d}.safetensors"))["stream"][
                    "partitions"].items():
                left[p] = ROWS // N - ps["consumed"]
    ids += _finish_epoch(elastic, resume_from, *chain[2])
    _assert_each_row_once(ids, f"chain {chain}")


def _loader(cfg, world, workers, rank, processor_factory=None, batch=BATCH):
    s = _stream(cfg, world, workers, rank)
    return StreamLoader(s, batch_size=batch, collate_fn=None if processor_factory else list,
                        processor_factory=processor_factory, num_workers=workers,
                        prefetch_factor=4 if workers else None)


@pytest.mark.parametrize(("before", "after"), [((2, 2), (3, 0)), ((1, 0), (2, 2)), ((3, 2), (2, 1))],
                         ids=["2x2->3x0", "1x0->2x2", "3x2->2x1"])
def test_elastic_loader_with_workers_consumes_every_row_once(cfg, tmp_path, before, after):
    """Workers prefetch past what training consumed; the checkpoint holds what was consumed, and the
    new topology reads exactly the rest of the epoch. Stopped at any batch (inside a round of one batch per
    partition: data.elastic_determinism refuses that on another topology, tests/test_global_batches.py), so
    with data.elastic_determinism: false, where every partition continues from its cursor and the rounds
    start afresh."""
    elastic = cfg.replace(elastic=True, elastic_determinism=False)
    state_dir = str(tmp_path / "stream_state")
    world, workers = before
    ids = []
    for rank in range(world):
        loader = _loader(elastic, world, workers, rank)
        loader.stream.set_epoch(0)
        it = iter(loader)
        for _ in range(7 + 5 * rank):
            ids += [row["id"] for row in next(it)]
        loader.save_sidecar(state_dir)
        del it
    write_manifest(state_dir, world)
    world, workers = after
    for rank in range(world):
        loader = _loader(elastic, world, workers, rank)
        loader.load_sidecar(os.path.dirname(state_dir))     # the checkpoint directory
        loader.stream.set_epoch(0)
        ids += [row["id"] for batch in loader for row in batch]
    _assert_each_row_once(ids, f"{before} -> {after}")


# -------------------------------------------------------------- same topology, several partitions per consumer
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_partitions=st.sampled_from([3, 5, 7, 12]), world=st.integers(1, 3), data=st.data())
def test_same_topology_resume_continues_the_identical_interleaving(cfg, num_partitions, world, data):
    c = cfg.replace(num_partitions=num_partitions)
    if num_partitions < world:
        return
    rank = data.draw(st.integers(0, world - 1), label="rank")
    stop = data.draw(st.integers(0, 1500), label="stop")
    reference = take_ids(_stream(c, world, 0, rank), stop + 80)
    first = _stream(c, world, 0, rank)
    head = take_ids(first, stop)
    resumed = _stream(c, world, 0, rank)
    resumed.load_state_dict(through_sidecar(first.state_dict()))
    assert head + take_ids(resumed, 80) == reference


def _text_processor():
    tok = AutoTokenizer.from_pretrained(TOK_DIR)
    return functools.partial(TextProcessor, tok, TransformConfig(packing=True, max_seq_len=24)), tok.pad_token_id


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_with_lanes_of_several_partitions_and_packing(cfg, workers):
    """A worker (or the main process) rotates over its partitions batch by batch, each with its own packing
    carry; a resumed loader continues with exactly the batches of the uninterrupted one."""
    factory, pad = _text_processor()
    make = lambda: StreamLoader(_stream(cfg, 2, workers, 1), batch_size=4,  # noqa: E731
                                collate_fn=functools.partial(collate, pad_token_id=pad), processor_factory=factory,
                                num_workers=workers, prefetch_factor=2 if workers else None)
    loader = make()
    assert all(len(lane) == 6 // max(1, workers) for lane in loader.stream.lanes)
    it = iter(loader)
    consumed = 23
    for _ in range(consumed):
        next(it)
    state = through_sidecar(loader.rank_state())
    assert state["loader"]["lane_turns"] and sorted(int(p) for p in state["stream"]["partitions"]) == list(range(6, 12))
    carried = [p for p, carry in state["transform"].items() if carry]
    assert len(carried) >= 2, "packing leaves tokens carried over in several partitions"
    expected = [next(it)["input_ids"] for _ in range(10)]
    del it
    resumed = make()
    resumed.load_state_dict(state)
    got = [b["input_ids"] for b in itertools.islice(resumed, 10)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got)) and len(got) == 10


# ------------------------------------------------------------------------------------------------------ errors
def _checkpoint(cfg, tmp_path, world, workers=0, stop=30):
    state_dir = str(tmp_path / "ck" / "stream_state")
    _run_and_save(cfg, state_dir, world, workers, [stop] * world)
    return os.path.dirname(state_dir)


@pytest.mark.parametrize(("before", "after"), [((2, 0), (1, 0)), ((1, 0), (2, 0)), ((2, 2), (2, 1))])
def test_topology_change_without_elastic_says_how_to_enable_it(cfg, tmp_path, before, after):
    ck = _checkpoint(cfg, tmp_path, *before)
    with pytest.raises(StreamMismatchError) as e:
        _stream(cfg, after[0], after[1], 0).load_sidecar(ck)
    msg = str(e.value)
    assert "data.elastic: true" in msg and "keep data.num_partitions 12" in msg
    assert "another topology" in msg


def test_other_num_partitions_is_always_a_mismatch(cfg, tmp_path):
    ck = _checkpoint(cfg, tmp_path, 2)
    for world in (2, 3):
        with pytest.raises(StreamMismatchError) as e:
            _stream(cfg, world, 0, 0, num_partitions=6, elastic=True).load_sidecar(ck)
        assert "data.num_partitions: saved 12, now 6" in str(e.value)


def test_null_num_partitions_takes_the_checkpoints(cfg, tmp_path):
    ck = _checkpoint(cfg, tmp_path, 2)
    expected = take_ids(_stream(cfg, 3, 0, 2, elastic=True, resume_state_path=ck), 40)
    s = _stream(cfg, 3, 0, 2, num_partitions=None, elastic=True)
    assert s.layout.num_partitions == 3
    s.load_sidecar(ck)
    assert s.layout.num_partitions == N and s.partitions == [8, 9, 10, 11]
    assert take_ids(s, 40) == expected
    # a run started with the default (2 ranks -> 2 partitions) cannot grow past 2 consumers
    small = str(tmp_path / "small" / "stream_state")
    _run_and_save(cfg.replace(num_partitions=None), small, 2, 0, [10, 10])
    with pytest.raises(ConfigError) as e:
        _stream(cfg, 3, 0, 0, num_partitions=None, elastic=True).load_sidecar(small)
    assert "num_partitions" in str(e.value) and "got 2 virtual partitions for 3 consumers" in str(e.value)


def test_elastic_resume_from_one_file_needs_all_its_partitions(cfg, tmp_path):
    ck = _checkpoint(cfg, tmp_path, 2)
    one = os.path.join(ck, "stream_state", "rank-00001.safetensors")
    with pytest.raises(StreamMismatchError, match="gathered from every rank's file"):
        _stream(cfg, 1, 0, 0, elastic=True).load_sidecar(one)
    # a file that holds them is enough: rank 1 of 2 -> rank 2 of 3 reads partitions 8..11 of its 6..11
    s = _stream(cfg, 3, 0, 2, elastic=True)
    s.load_sidecar(one)
    assert s.partitions == [8, 9, 10, 11]


def test_elastic_resume_checks_every_file_it_gathers(cfg, tmp_path):
    ck = _checkpoint(cfg, tmp_path, 2)
    path = os.path.join(ck, "stream_state", "rank-00001.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(SidecarError, match="rank-00001.safetensors.*does not match its manifest"):
        _stream(cfg, 1, 0, 0, elastic=True).load_sidecar(ck)
    # another dataset or config is refused for the gathered files too
    with pytest.raises(StreamMismatchError, match="data.shuffle_seed"):
        _stream(cfg, 3, 0, 0, elastic=True, shuffle_seed=7).load_sidecar(ck)


# ----------------------------------------------------------------------------------------------- progress
def test_partition_state_reports_epoch_progress(cfg):
    s = _stream(cfg, 2, 0, 0)
    take_ids(s, 6 * 500 + 6 * 120)       # 6 partitions: one whole epoch, then 120 rows each
    for p in s.partitions:
        ps = s.partition_state(p)         # typed; state_dict() holds its to_dict()
        assert (ps.epoch, ps.epoch_rows, ps.consumed - ps.epoch_start) == (1, 500, 120)
        assert s.partition_epoch(p) == 1
    restored = through_sidecar(s.state_dict())
    assert all(ps["epoch_start"] == 500 and ps["epoch_rows"] == 500 for ps in restored["partitions"].values())


def test_inspect_shows_progress_per_partition_and_a_summary(cfg, tmp_path, capsys):
    from resumable_stream.app.cli import main

    state_dir = str(tmp_path / "ck" / "stream_state")
    # rank 0: its 6 partitions (500 rows each) through epoch 0 and 100 rows into epoch 1; rank 1: half of epoch 0
    for rank, samples in enumerate([6 * 600, 6 * 250]):
        s = _stream(cfg, 2, 0, rank)
        take_ids(s, samples)
        s.save_sidecar(state_dir)
    write_manifest(state_dir, 2)
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = json.loads(capsys.readouterr().out)
    for rank, (epoch, done) in enumerate([(1, 100), (0, 250)]):
        parts = out["ranks"][f"rank-{rank:05d}.safetensors"]["partitions"]
        assert sorted(map(int, parts)) == list(range(6 * rank, 6 * rank + 6))
        for part in parts.values():
            assert (part["epoch"], part["epoch_consumed"], part["epoch_rows"], part["epoch_fraction"]) == \
                (epoch, done, 500, done / 500)
    assert out["progress"] == {
        "partitions": 12, "epoch": {"min": 0, "max": 1}, "unknown_fraction": 0,
        "epoch_fraction": {"min": 0.2, "max": 0.5, "mean": 0.35},
        "epochs_completed": {"min": 0.5, "max": 1.2, "mean": 0.85},
    }
    # one file: the same fields for its partitions
    assert main(["inspect", os.path.join(state_dir, "rank-00001.safetensors")]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["progress"]["epoch_fraction"] == {"min": 0.5, "max": 0.5, "mean": 0.5}


def test_progress_without_row_counts_has_no_fraction(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from resumable_stream import StreamConfig
    from resumable_stream.observe.progress import partition_progress
    from resumable_stream.testing import synthetic_rows

    for f in range(4):      # csv: read by datasets, no row counts (JSON lines are indexed: they have them)
        pacsv.write_csv(pa.table(synthetic_rows(f * 50, 50)), str(tmp_path / f"part-{f}.csv"))
    c = StreamConfig(dataset_name_or_path="csv", data_files=str(tmp_path / "*.csv"), num_partitions=2)
    s = ResumableStream(c, rank=0, world_size=1)
    take_ids(s, 30)
    progress = [partition_progress(ps) for ps in s.state_dict()["partitions"].values()]
    assert sorted(p["epoch_consumed"] for p in progress) == [15, 15]
    assert all(p["epoch_rows"] is None and p["epoch_fraction"] is None for p in progress)
