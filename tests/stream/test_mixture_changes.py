"""Mixtures whose weights change: schedules (data.sources[i].weight), changes on resume (data.mixture_change:
allow) and from code (set_weights), every one exact on resume.

Source b's ids start at 100000 and c's at 200000, so a sample's id tells its source. The sources are read
without shuffling, so a source's own order is its ids ascending: "a source keeps its cursor" is "its ids, over
every run, are 0, 1, 2, ... of that source". Expected picks are derived here from the documented rule (the
draw's uniform against the cumulative normalised weights at position d * num_partitions), not taken from
the stream.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import through_sidecar

from resumable_stream import ConfigError, MixtureStream, StreamConfig, StreamMismatchError
from resumable_stream.loader import StreamLoader
from resumable_stream.sources import open_source
from resumable_stream.stream.mixture import describe_state
from resumable_stream.stream.weights import uniforms
from resumable_stream.testing import synthetic_rows

B, C = 100_000, 200_000


def _write(directory, start: int, rows: int, files: int) -> str:
    os.makedirs(directory, exist_ok=True)
    per = rows // files
    for f in range(files):
        pq.write_table(pa.table(synthetic_rows(start + f * per, per)), os.path.join(directory, f"p{f}.parquet"),
                       row_group_size=50)
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixchange")
    return {"a": _write(root / "a", 0, 2000, 4), "b": _write(root / "b", B, 2000, 4), "c": _write(root / "c", C, 400, 2)}


_OPENED: dict = {}


def mix(dirs, weights, labels=("a", "b"), **shared):
    return StreamConfig.from_dict({"shuffle": False, **shared, "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": os.path.join(dirs[label], "*.parquet"),
         "weight": w} for label, w in zip(labels, weights)]})


def make(cfg, rank=0, world_size=1, num_workers=0) -> MixtureStream:
    opened = []
    for s in cfg.sources:
        key = str(s.data_files)
        if key not in _OPENED:
            _OPENED[key] = open_source(s.source_spec)
        opened.append(_OPENED[key])
    return MixtureStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers, sources=opened)


def ids(stream, n) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


def reload(stream) -> dict:
    return through_sidecar(stream.state_dict())     # through the sidecar bytes


def src(i: int) -> int:
    return i // B


def own_order(seq: list[int], s: int) -> bool:
    """The ids of source s in seq are that source's rows from its first, none twice, none skipped."""
    got = [x for x in seq if src(x) == s]
    return got == list(range(s * B, s * B + len(got)))


def constant(points, unit="samples"):
    return {"schedule": "constant", "unit": unit, "points": points}


def linear(points, unit="samples"):
    return {"schedule": "linear", "unit": unit, "points": points}


# ------------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("weight, match", [
    (linear([[0, 1], [10, 0.5], [10, 0.2]]), r"data\.sources\[0\]\.weight\.points\[2\]: position 10 after 10; "
                                             r"allowed: positions strictly increasing"),
    (linear([[0, 1], [5, 0.2], [3, 0.2]]), r"points\[2\]: position 3 after 5;"),
    (linear([[0, -1]]), r"data\.sources\[0\]\.weight\.points\[0\]: got \[0, -1\]; allowed: \[position, weight\]"),
    (-0.5, r"data\.sources\[0\]\.weight: got -0\.5; allowed: a finite number > 0, or a schedule"),
    ({"schedule": "cosine", "points": [[0, 1]]}, r"data\.sources\[0\]\.weight\.schedule: got 'cosine'; allowed: "
                                                 r"linear or constant"),
    ({"points": [[0, 1]], "unit": "epochs"}, r"\.unit: got 'epochs'; allowed: steps or samples"),
    ({"points": [[0, 1]], "warmup": 3}, r"\.weight\.warmup: unknown key; allowed: schedule, unit, points"),
    ({"points": []}, r"\.points: got \[\]; allowed: a list of 1 to"),
])
def test_bad_schedules_name_the_key_value_and_what_is_allowed(dirs, weight, match):
    with pytest.raises(ConfigError, match=match):
        mix(dirs, [weight, 1.0])


def test_all_zero_weights_at_some_position_and_mixed_units_are_refused(dirs):
    with pytest.raises(ConfigError, match=r"data\.sources: every source's weight is 0 at sample 100 \(a, b\); "
                                          r"allowed: some source with a weight > 0 at every position"):
        mix(dirs, [constant([[0, 1], [100, 0]]), constant([[0, 0], [200, 1]])])
    with pytest.raises(ConfigError, match=r"data\.sources: schedules in samples and steps; allowed: one unit"):
        mix(dirs, [linear([[0, 1]], "steps"), linear([[0, 1]], "samples")])
    with pytest.raises(ConfigError, match=r"data\.mixture_change: got 'yes'; allowed: refuse .* or allow"):
        mix(dirs, [1, 1], mixture_change="yes")
    with pytest.raises(ConfigError, match=r"data\.mixture_change: got 'allow' without data\.sources"):
        StreamConfig.from_dict({"dataset_name_or_path": "parquet", "data_files": "x", "mixture_change": "allow"})


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_constant_schedule_switches_source_at_its_breakpoint_in_every_partition(dirs, world_size):
    """a until sample 60 of the job, b after: partition p's draw d is at sample d * num_partitions."""
    cfg = mix(dirs, [constant([[0, 1], [60, 0]]), constant([[0, 0], [60, 1]])])
    for rank in range(world_size):
        got = ids(make(cfg, rank, world_size), 100)
        switch = 60 // world_size
        assert [src(x) for x in got] == [0] * switch + [1] * (100 - switch)
        assert len(set(got)) == len(got)


def test_a_linear_ramp_picks_by_the_interpolated_weight_and_steps_map_through_samples_per_step(dirs):
    """weight_a goes 1 -> 0 over steps 0..50 (8 samples a step, one partition: draw d is step d / 8), b stays 1:
    draw d picks a when its uniform is below w_a / (w_a + 1)."""
    cfg = mix(dirs, [linear([[0, 1], [50, 0]], "steps"), 1.0], shuffle_seed=5)
    stream = make(cfg)
    with pytest.raises(ConfigError, match=r"a schedule in steps needs the samples per optimizer step"):
        ids(stream, 1)
    stream = make(cfg)
    stream.set_samples_per_step(8)
    got = ids(stream, 600)
    step = np.arange(600) / 8
    w_a = np.clip(1 - step / 50, 0, None)
    expected = np.where(uniforms(5, 0, 0, 0, 600) < w_a / (w_a + 1), 0, 1)
    assert [src(x) for x in got] == expected.tolist()
    assert stream.current_weights() == {"a": 0.0, "b": 1.0}


@pytest.mark.parametrize("stop", [0, 37, 59, 60, 61, 130])
def test_a_schedule_resumes_exactly_anywhere_on_two_ranks(dirs, stop):
    """Inside a ramp (37, 130), just before, at and after a breakpoint (60: partition draw 30 of 2 partitions
    is sample 60): each rank continues with the very samples an uninterrupted run reads."""
    cfg = mix(dirs, [linear([[0, 1], [60, 0.2], [400, 1]]), constant([[0, 0.5], [60, 2]])], stopping="all_exhausted")
    for rank in (0, 1):
        reference = ids(make(cfg, rank, 2), 200)
        first = make(cfg, rank, 2)
        head = ids(first, stop)
        resumed = make(cfg, rank, 2)
        resumed.load_state_dict(reload(first))
        assert head + ids(resumed, 200 - stop) == reference


def test_samples_per_step_is_fixed_at_start_and_kept_by_the_resume(dirs):
    cfg = mix(dirs, [constant([[0, 1], [5, 0]], "steps"), constant([[0, 0], [5, 1]], "steps")])
    first = make(cfg)
    first.set_samples_per_step(4)          # switch at draw 20
    head = ids(first, 10)
    resumed = make(cfg)
    resumed.set_samples_per_step(16)       # another batch size on resume: the saved mapping wins
    resumed.load_state_dict(reload(first))
    assert [src(x) for x in head + ids(resumed, 20)] == [0] * 20 + [1] * 10


def test_loader_with_workers_resumes_a_schedule_exactly_and_elastic_reads_each_row_once(dirs):
    """2 DataLoader workers over a ramp; the consumed state after 5 batches resumes exactly with workers, and
    elastically on 1 rank without workers across the breakpoint: no row of a source is read twice."""
    cfg = mix(dirs, [constant([[0, 1], [48, 0.1]]), constant([[0, 0.1], [48, 1]])], elastic=True)
    reference = _batches(StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2), 12)
    loader = StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2)
    head = _batches(loader, 5)
    state = through_sidecar(loader.rank_state())
    # after what training consumed (partition 0 drew 10: sample 20 of the job), not where the workers are
    assert loader.current_weights() == pytest.approx({"a": 1 / 1.1, "b": 0.1 / 1.1})
    again = StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2)
    again.load_state_dict(state)
    assert head + _batches(again, 7) == reference
    elastic = make(cfg)
    elastic.load_state_dict(state)
    rows = [x for batch in head for x in batch] + ids(elastic, 200)
    assert len(rows) == len(set(rows))
    assert sum(src(x) == 1 for x in rows[20:]) > 150       # b's weight 10x a's after the breakpoint


def _collate(samples):
    return {"id": [s["id"] for s in samples]}


def _take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def _batches(loader, n) -> list[list[int]]:
    return [b["id"] for b in _take(loader, n)]


# ------------------------------------------------------------------------------------------------ changes on resume
def test_other_weights_on_resume_are_refused_without_mixture_change_allow(dirs):
    first = make(mix(dirs, [0.7, 0.3]))
    ids(first, 50)
    with pytest.raises(StreamMismatchError, match=r"(?s)sources\.a\.weight: saved 0\.7, now 0\.5.*set "
                                                  r"data\.mixture_change: allow"):
        make(mix(dirs, [0.5, 0.5])).load_state_dict(reload(first))
    with pytest.raises(StreamMismatchError, match=r"mixture\.labels"):
        make(mix(dirs, [1, 1, 1], labels=("a", "b", "c"))).load_state_dict(reload(first))


def test_allowed_weight_change_applies_from_the_resume_point_and_sources_keep_their_cursors(dirs, tmp_path):
    first = make(mix(dirs, [0.5, 0.5]))
    head = ids(first, 80)
    first.save_sidecar(str(tmp_path / "before"))          # a stream_state directory, read as a checkpoint's
    # a paused from here on (a schedule of weight 0), b alone
    changed = make(mix(dirs, [constant([[0, 0]]), 1.0], mixture_change="allow"))
    changed.load_sidecar(str(tmp_path / "before"))
    tail = ids(changed, 60)
    assert [src(x) for x in tail] == [1] * 60
    assert own_order(head + tail, 0) and own_order(head + tail, 1)
    assert changed.current_weights() == {"a": 0.0, "b": 1.0}
    # resumed again with the same yaml (no allow needed): the history is replayed, not the config alone
    state = reload(changed)
    changed.save_sidecar(str(tmp_path / "after"))
    again = make(mix(dirs, [constant([[0, 0]]), 1.0]))
    again.load_sidecar(str(tmp_path / "after"))
    assert [src(x) for x in ids(again, 20)] == [1] * 20
    history = describe_state(state)["mixture"]["weight_history"]
    assert [(h["from"], h["starts"]) for h in history] == [("config", {"0": 0}), ("resume", {"0": 80})]
    assert history[0]["weights"] == {"a": 0.5, "b": 0.5}
    assert changed.pop_weight_events() == [{"from": "resume", "weights": {"a": constant([[0.0, 0.0]]), "b": 1.0},
                                            "added": [], "removed": []}]


def test_a_weight_history_resumes_its_draws_whatever_the_order_of_the_labels(dirs):
    """A saved state's JSON has its keys sorted: the history's labels keep their own order (the order of the
    cumulative weights a draw's uniform picks against), so a second resume draws as the run it continues
    (labels b, a: not their sorted order)."""
    labels = ("b", "a")
    first = make(mix(dirs, [0.3, 0.7], labels=labels))
    ids(first, 40)
    first.set_weights({"b": 0.6, "a": 0.4})
    head = ids(first, 30)
    state = reload(first)
    expected = ids(first, 60)
    again = make(mix(dirs, [0.3, 0.7], labels=labels))
    again.load_state_dict(state)
    assert head and ids(again, 60) == expected
    assert describe_state(state)["mixture"]["weight_history"][1]["labels"] == ["b", "a"]


def test_added_source_starts_at_its_beginning_and_a_removed_one_continues_when_added_back(dirs):
    first = make(mix(dirs, [1, 1]))
    seen = ids(first, 50)
    added = make(mix(dirs, [1, 1, 2], labels=("a", "b", "c"), mixture_change="allow"))
    added.load_state_dict(reload(first))
    seen += ids(added, 60)
    assert [x for x in seen if src(x) == 2][:3] == [C, C + 1, C + 2]
    without_b = make(mix(dirs, [1, 1], labels=("a", "c"), mixture_change="allow"))
    without_b.load_state_dict(reload(added))
    tail = ids(without_b, 50)
    assert all(src(x) != 1 for x in tail)
    state = reload(without_b)
    assert describe_state(state)["mixture"]["retired"] == ["b"]
    back = make(mix(dirs, [1, 1, 1], labels=("b", "a", "c"), mixture_change="allow"))
    back.load_state_dict(state)
    seen += tail + ids(back, 90)
    for s in (0, 1, 2):
        assert own_order(seen, s), s
    # a kept source whose data changed is still refused
    other = _write(os.path.join(os.path.dirname(dirs["b"]), "b2"), B, 1000, 2)
    changed_b = {**dirs, "b": other}
    with pytest.raises(StreamMismatchError, match=r"file"):
        make(mix(changed_b, [1, 1, 1], labels=("b", "a", "c"), mixture_change="allow")).load_state_dict(state)


def test_fixed_weights_keep_the_fingerprint_of_before_histories(dirs):
    fp = make(mix(dirs, [0.7, 0.3])).fingerprint()
    assert fp["mixture"] == {"labels": ["a", "b"], "stopping": "first_exhausted", "seed": 42}
    assert [fp["sources"][label]["weight"] for label in "ab"] == [0.7, 0.3]


# ------------------------------------------------------------------------------------------------ set_weights
def test_set_weights_through_a_loader_with_workers_applies_from_the_next_batch_and_resumes_exactly(dirs, tmp_path):
    cfg = mix(dirs, [1, 1])

    def run(n_before, n_after, state=None):
        loader = StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        head = [next(it)["id"] for _ in range(n_before)]
        if state is None:
            assert loader.current_weights() == {"a": 0.5, "b": 0.5}
            loader.set_weights({"a": 0, "b": 1}, step=n_before)
            assert loader.current_weights() == {"a": 0.0, "b": 1.0}
        tail = [next(it)["id"] for _ in range(n_after)]
        return head, tail, loader

    head, tail, loader = run(3, 6)
    assert all(src(x) == 1 for batch in tail for x in batch)
    assert any(src(x) == 0 for batch in head for x in batch)
    rows = [x for batch in head + tail for x in batch]
    assert len(set(rows)) == len(rows)        # 2 partitions: each reads its own rows of every source, once
    # a checkpoint after the change: the resumed run reads what the continued one reads
    first = StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2)
    it = iter(first)
    [next(it) for _ in range(3)]
    first.set_weights({"a": 0, "b": 1}, step=3)
    [next(it) for _ in range(2)]
    state = through_sidecar(first.rank_state())["stream"]
    assert state["fingerprint"]["mixture"]["history"][1] == {"from": "set_weights", "step": 3,
                                                            "weights": {"a": 0.0, "b": 1.0}, "labels": ["a", "b"]}
    first.save_sidecar(str(tmp_path / "state"))
    resumed = StreamLoader(make(cfg, num_workers=2), 4, _collate, num_workers=2)
    resumed.load_sidecar(str(tmp_path / "state"))
    assert _batches(resumed, 4) == tail[2:6]
    with pytest.raises(ConfigError, match=r"set_weights: got weights for \['a'\]; allowed: a mapping with a weight "
                                          r"for every source: a, b"):
        first.set_weights({"a": 1})
    with pytest.raises(ConfigError, match=r"every source's weight is 0"):
        first.set_weights({"a": 0, "b": 0})


def test_datasets_draw_sequences_take_fixed_weights_only(dirs):
    """LLaMA-Factory's buffer_size 1 draws datasets in datasets.interleave_datasets' own sequence (draws
    "datasets_choice"), a function of fixed probabilities: a schedule or a change of weights there is refused by
    name instead of being silently ignored."""
    ramp = {"schedule": "linear", "unit": "samples", "points": [[0, 0.2], [100, 0.8]]}
    with pytest.raises(ConfigError, match="datasets_choice.*fixed weights"):
        MixtureStream(mix(dirs, (ramp, 0.5)), rank=0, world_size=1, draws="datasets_choice")
    stream = MixtureStream(mix(dirs, (0.5, 0.5)), rank=0, world_size=1, draws="datasets_choice")
    with pytest.raises(ConfigError, match="datasets_choice.*change of weights"):
        stream.set_weights({"a": 0.1, "b": 0.9})
    assert len(stream.weight_history) == 1       # refused before anything changed
    stream.close()
