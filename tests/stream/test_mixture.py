"""Weighted mixtures of datasets (``data.sources``): exact resume, the stopping modes, proportions, mismatch
and config errors, elastic resume, and the loader / CLI / trainer integration.

Source b's ids start at 100000 and c's at 200000, so a sample's id tells which source it came from. The
per-source references are plain ``ResumableStream``s over one source, read epoch by epoch with ``set_epoch``.
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import through_sidecar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT
from training_helpers import (
    Procs,
    assert_data_parallel,
    checkpoint_path,
    complete_checkpoints,
    consumed,
    count_lines,
    printed_steps,
    train_losses,
    write_config,
)

from resumable_stream import (
    ConfigError,
    MixtureConfig,
    MixtureStream,
    ResumableStream,
    StreamConfig,
    StreamMismatchError,
    open_stream,
)
from resumable_stream.config.stream_config import STOPPING
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.errors import SourceError
from resumable_stream.loader import StreamLoader
from resumable_stream.sources import Source, open_source
from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.stream.mixture import source_counts
from resumable_stream.stream.weights import draw_sources
from resumable_stream.testing import synthetic_rows

B_START, C_START = 100_000, 200_000
TINY = os.path.join(REPO_ROOT, "examples", "tiny")


def _write(directory, start: int, rows: int, files: int, row_group_size: int) -> str:
    os.makedirs(directory, exist_ok=True)
    per = rows // files
    for f in range(files):
        table = pa.table(synthetic_rows(start + f * per, per))
        pq.write_table(table, os.path.join(directory, f"part-{f:05d}.parquet"), row_group_size=row_group_size)
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    return {"a": _write(root / "a", 0, 1000, 4, 50),          # 20 shards
            "b": _write(root / "b", B_START, 300, 2, 50),     # 6 shards
            "c": _write(root / "c", C_START, 120, 1, 40)}     # 3 shards


def mix(dirs, weights=(0.7, 0.3), labels=("a", "b"), stopping="first_exhausted", **shared) -> MixtureConfig:
    return StreamConfig.from_dict({**shared, "stopping": stopping, "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": os.path.join(dirs[label], "*.parquet"),
         "weight": w} for label, w in zip(labels, weights)]})


_OPENED: dict = {}


def sources_of(cfg: MixtureConfig) -> list:
    """One opened source per dataset for the whole module (opening reads the parquet footers)."""
    out = []
    for s in cfg.sources:
        key = (str(s.data_files), s.streaming)
        if key not in _OPENED:
            _OPENED[key] = open_source(s.source_spec)
        out.append(_OPENED[key])
    return out


def make(cfg, rank=0, world_size=1, num_workers=0) -> MixtureStream:
    return MixtureStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers, sources=sources_of(cfg))


def ids(stream, n=10**9) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


def source_of(i: int) -> int:
    return i // B_START


def by_source(seq: list[int], n: int = 2) -> list[list[int]]:
    return [[x for x in seq if source_of(x) == s] for s in range(n)]


def source_epochs(cfg: MixtureConfig, i: int, epochs: int) -> list[list[int]]:
    """Source i read alone (one rank), epoch by epoch: what the mixture must take from it, in order."""
    s = ResumableStream(cfg.sources[i], rank=0, world_size=1, source=sources_of(cfg)[i])
    out = []
    for e in range(epochs):
        s.set_epoch(e)
        out.append(ids(s))
    return out


# ------------------------------------------------------------------------------------------------ exact resume
def check_resume(cfg, world_size, rank, num_workers, stop, more):
    reference = ids(make(cfg, rank, world_size, num_workers), stop + more)
    first = make(cfg, rank, world_size, num_workers)
    head = ids(first, stop)
    state = through_sidecar(first.state_dict())     # through the sidecar bytes
    resumed = make(cfg, rank, world_size, num_workers)
    resumed.load_state_dict(state)
    tail = ids(resumed, more)
    assert head + tail == reference, \
        f"diverged at {next(i for i, (a, b) in enumerate(zip(head + tail, reference)) if a != b)}"
    assert ids(first, more) == tail       # the saved stream itself continues the same way


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 3), num_workers=st.sampled_from([0, 2]), shuffle=st.booleans(),
       buffer_size=st.sampled_from([7, 50, 64]), stopping=st.sampled_from(STOPPING),
       weights=st.sampled_from([(0.7, 0.3), (0.2, 0.8), (1, 1)]), data=st.data())
def test_resume_at_any_stop_point(dirs, world_size, num_workers, shuffle, buffer_size, stopping, weights, data):
    cfg = mix(dirs, weights=weights, stopping=stopping, shuffle=shuffle, buffer_size=buffer_size, block_rows=16)
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    stop = data.draw(st.integers(0, int(1300 // world_size * 2.3)), label="stop")   # past several source epochs
    check_resume(cfg, world_size, rank, num_workers, stop, more=120)


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_resume_in_finite_epoch_mode(dirs, stopping):
    cfg = mix(dirs, stopping=stopping, shuffle=True, buffer_size=64)
    ref = make(cfg)
    ref.set_epoch(0)
    epoch0 = ids(ref)
    ref.set_epoch(1)
    epoch1 = ids(ref)
    assert epoch0 and epoch1
    for stop in (0, 1, len(epoch0) // 2, len(epoch0) - 1, len(epoch0)):
        s = make(cfg)
        s.set_epoch(0)
        head = ids(s, stop)
        resumed = make(cfg)
        resumed.load_state_dict(through_sidecar(s.state_dict()))
        resumed.set_epoch(0)
        assert head + ids(resumed) == epoch0, f"stop {stop}"
        resumed.set_epoch(1)
        assert ids(resumed) == epoch1, f"stop {stop}"


class CountingSource(Source):
    """Wraps a source and counts the rows it reads (a shard's skipped prefix included)."""

    def __init__(self, inner):
        self.inner, self.rows_read = inner, 0
        self.shards, self.fingerprint, self.column_names = inner.shards, inner.fingerprint, inner.column_names

    def read(self, shard, start_row=0):
        self.rows_read += start_row
        for table in self.inner.read(shard, start_row):
            self.rows_read += table.num_rows
            yield table


@pytest.mark.parametrize("stop", [500, 5000])
def test_resume_reads_one_window_per_source_not_the_past(dirs, parquet_60, stop):
    """Resume cost: per source one window plus the prefix of each open shard, however far the run went."""
    cfg = mix({**dirs, "big": parquet_60}, labels=("big", "b"), shuffle=True, buffer_size=256, stopping="never")
    s = make(cfg)
    ids(s, stop)
    state = s.state_dict()
    counting = [CountingSource(src) for src in sources_of(cfg)]
    resumed = MixtureStream(cfg, rank=0, world_size=1, sources=counting)
    resumed.load_state_dict(state)
    assert len(ids(resumed, 50)) == 50
    for src, row_group in zip(counting, (100, 50)):     # window + per open shard its prefix and one read
        assert 0 < src.rows_read <= 256 + 4 * row_group + 4 * row_group, (stop, src.rows_read)


# ------------------------------------------------------------------------------------------ stopping semantics
def test_draws_follow_the_counter_based_sampler(dirs):
    """The k-th sample of partition 0 comes from the source draw_sources names for (seed, epoch, 0, k)."""
    cfg = mix(dirs, weights=(0.6, 0.4), stopping="never", shuffle=True, buffer_size=64, shuffle_seed=7)
    got = [source_of(i) for i in ids(make(cfg), 3000)]
    assert got == draw_sources(cfg.probabilities, 7, 0, 0, 0, 3000).tolist()


def test_first_exhausted_ends_the_epoch_at_the_first_ended_source_and_the_others_continue(dirs):
    cfg = mix(dirs, weights=(0.5, 0.5), stopping="first_exhausted", shuffle=True, buffer_size=64)
    a_epochs, b_epochs = source_epochs(cfg, 0, 3), source_epochs(cfg, 1, 4)
    s = make(cfg)
    mixture_epochs = []
    for e in range(3):
        s.set_epoch(e)
        mixture_epochs.append(ids(s))
        assert ids(s) == [], "set_epoch(e) yields epoch e only"
    a_taken, b_taken = 0, 0
    a_all, b_all = sum(a_epochs, []), sum(b_epochs, [])
    for e, seq in enumerate(mixture_epochs):
        a, b = by_source(seq)
        # every source continues exactly where it stopped: nothing skipped, nothing repeated
        assert a == a_all[a_taken:a_taken + len(a)] and b == b_all[b_taken:b_taken + len(b)], f"mixture epoch {e}"
        a_taken, b_taken = a_taken + len(a), b_taken + len(b)
        # b (300 rows) ends first at equal weights: each mixture epoch is exactly one epoch of b ...
        assert b == b_epochs[e], f"mixture epoch {e}"
        # ... and ends at the draw that picks b after it ended (that draw yields nothing)
        draws = draw_sources(cfg.probabilities, cfg.shuffle_seed, e, 0, 0, len(seq) + 1).tolist()
        assert [source_of(i) for i in seq] == draws[:-1] and draws[-1] == 1, f"mixture epoch {e}"
    assert a_taken < 3 * 1000


def test_all_exhausted_restarts_ended_sources_until_every_source_ended(dirs):
    cfg = mix(dirs, weights=(0.5, 0.5), stopping="all_exhausted", shuffle=True, buffer_size=64)
    a_epochs, b_epochs = source_epochs(cfg, 0, 2), source_epochs(cfg, 1, 12)
    b_all = sum(b_epochs, [])
    s = make(cfg)
    s.set_epoch(0)
    a0, b0 = by_source(ids(s))
    s.set_epoch(1)
    a1, b1 = by_source(ids(s))
    # a (1000 rows) ends last: epoch 0 holds all of a's epoch 0 and nothing of its next one ...
    assert a0 == a_epochs[0] and a1 == a_epochs[1]
    # ... while b (300 rows) restarted with its next (reshuffled) epochs: oversampled, in order, continued in epoch 1
    assert len(b0) > 2 * 300 and b0 == b_all[:len(b0)] and b1 == b_all[len(b0):len(b0) + len(b1)]


def test_never_is_endless_and_restarts_every_source(dirs):
    cfg = mix(dirs, weights=(0.5, 0.5), stopping="never", shuffle=True, buffer_size=64)
    with pytest.raises(ConfigError, match="never"):
        make(cfg).set_epoch(0)
    a, b = by_source(ids(make(cfg), 3500))
    assert a == sum(source_epochs(cfg, 0, 3), [])[:len(a)] and len(a) > 1000
    assert b == sum(source_epochs(cfg, 1, 8), [])[:len(b)] and len(b) > 3 * 300


def test_a_source_without_rows_for_a_partition_is_an_error(dirs, tmp_path):
    dirs = {**dirs, "t": _write(tmp_path / "t", C_START, 2, 1, 2)}   # 2 rows: partition 3 of 4 gets none
    cfg = mix(dirs, labels=("a", "t"), weights=(0.5, 0.5), shuffle=True, buffer_size=16)
    with pytest.raises(SourceError, match=r"data.sources\[1\] \('t'\): partition 3 of 4 got no rows"):
        ids(make(cfg, rank=3, world_size=4), 10_000)


# ------------------------------------------------------------------------------------------------ proportions
@pytest.mark.parametrize("stopping", ["never", "first_exhausted"])
@pytest.mark.slow
def test_proportions_over_100k_samples_match_the_weights(dirs, stopping):
    weights = (0.5, 0.3, 0.2)
    cfg = mix(dirs, weights=weights, labels=("a", "b", "c"), stopping=stopping, shuffle=True, buffer_size=256)
    n = 100_000
    counts = collections.Counter(source_of(i) for i in ids(make(cfg, num_workers=2), n))
    measured = [counts[s] / n for s in range(3)]
    assert sum(counts.values()) == n
    assert all(abs(m - w) <= 0.01 for m, w in zip(measured, weights)), f"measured {measured}, weights {weights}"


def test_block_cache_serves_every_source_without_changing_the_samples(dirs, tmp_path):
    plain = ids(make(mix(dirs, shuffle=True, buffer_size=64)), 1500)
    cfg = mix(dirs, shuffle=True, buffer_size=64, cache_dir=str(tmp_path / "cache"))
    cold = MixtureStream(cfg, rank=0, world_size=1)       # opens its own sources, wrapped in the cache
    assert ids(cold, 1500) == plain
    for s in cold.source.sources:
        s.flush()
    warm = MixtureStream(cfg, rank=0, world_size=1)
    assert ids(warm, 1500) == plain
    cold_stats, warm_stats = cold.source.stats(), warm.source.stats()
    assert cold_stats["misses"] == sum(s.stats()["misses"] for s in cold.source.sources) > 0
    assert warm_stats["misses"] == 0 and warm_stats["hits"] > 0 and warm_stats["hit_rate"] == 1.0


# --------------------------------------------------------------------------------------------------- mismatch
def test_resuming_with_other_sources_weights_or_stopping_is_refused(dirs, tmp_path):
    cfg = mix(dirs, shuffle=True, buffer_size=64)
    s = make(cfg)
    ids(s, 200)
    state = through_sidecar(s.state_dict())
    moved = {**dirs, "b": shutil.copytree(dirs["b"], tmp_path / "b")}
    os.remove(sorted(glob.glob(os.path.join(moved["b"], "*.parquet")))[-1])   # a copy with a file less
    cases = {
        "sources.b.weight": mix(dirs, weights=(0.5, 0.5), shuffle=True, buffer_size=64),
        "mixture.stopping": mix(dirs, stopping="all_exhausted", shuffle=True, buffer_size=64),
        "mixture.labels": mix(dirs, labels=("b", "a"), weights=(0.3, 0.7), shuffle=True, buffer_size=64),
        "sources.c": mix(dirs, labels=("a", "b", "c"), weights=(0.7, 0.3, 0.1), shuffle=True, buffer_size=64),
        "sources.a.order.buffer_size": mix(dirs, shuffle=True, buffer_size=32),
        "file added": mix(moved, shuffle=True, buffer_size=64),
    }
    for name, other in cases.items():
        with pytest.raises(StreamMismatchError) as e:
            make(other).load_state_dict(state, where="ckpt")
        assert any(d[0].startswith(name) for d in e.value.differences), (name, e.value.differences)
        assert name in str(e.value) and str(e.value).startswith("ckpt:"), str(e.value)
    # a whole copy of a source elsewhere is the same data (docs/relocating-data.md): it resumes
    copied = {**dirs, "b": shutil.copytree(dirs["b"], tmp_path / "b_copy")}
    make(mix(copied, shuffle=True, buffer_size=64)).load_state_dict(state, where="ckpt")


def test_single_dataset_and_mixture_states_do_not_mix(dirs):
    cfg = mix(dirs, shuffle=True, buffer_size=64)
    single = ResumableStream(cfg.sources[0], rank=0, world_size=1, source=sources_of(cfg)[0])
    ids(single, 10)
    with pytest.raises(StreamMismatchError, match="single dataset's; this stream is a mixture of a, b"):
        make(cfg).load_state_dict(single.state_dict())
    m = make(cfg)
    ids(m, 10)
    with pytest.raises(StreamMismatchError, match="a mixture's \\(data.sources\\); this stream is a single dataset"):
        ResumableStream(cfg.sources[0], rank=0, world_size=1, source=sources_of(cfg)[0]).load_state_dict(m.state_dict())


def test_other_topology_without_elastic_is_refused(dirs):
    cfg = mix(dirs, shuffle=True, buffer_size=64)
    s = make(cfg)
    ids(s, 50)
    with pytest.raises(StreamMismatchError, match="data.elastic: true"):
        make(cfg, rank=0, world_size=2).load_state_dict(s.state_dict())


# ------------------------------------------------------------------------------------------------ elastic
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_elastic_resume_continues_every_virtual_partition(dirs, tmp_path, before, after):
    """A mixture checkpoint of `before` ranks resumes on `after` ranks: each of the 6 virtual partitions
    continues from its own position, sources and sampler included."""
    cfg = mix(dirs, stopping="all_exhausted", shuffle=True, buffer_size=32, num_partitions=6, elastic=True)
    length = 160
    reference = {p: [r["id"] for r, _ in itertools.islice(make(cfg, rank=p, world_size=6).iter_partition(p), length)]
                 for p in range(6)}
    stops = {p: (37 * p + 11) % length for p in range(6)}
    state_dir = tmp_path / "stream_state"
    got: dict[int, list[int]] = {}
    for r in range(before):
        s = make(cfg, rank=r, world_size=before)
        for p in s.partitions:
            got[p] = [row["id"] for row, _ in itertools.islice(s.iter_partition(p), stops[p])]
        s.save_sidecar(state_dir)
    write_manifest(str(state_dir), before)
    seen = []
    for r in range(after):
        s = make(cfg, rank=r, world_size=after)
        s.load_sidecar(state_dir)
        for p in s.partitions:
            seen.append(p)
            got[p] += [row["id"] for row, _ in itertools.islice(s.iter_partition(p), length - stops[p])]
    assert sorted(seen) == list(range(6))
    assert got == reference
    if before != after:
        with pytest.raises(StreamMismatchError, match="data.elastic: true"):
            make(mix(dirs, stopping="all_exhausted", shuffle=True, buffer_size=32, num_partitions=6),
                 rank=0, world_size=after).load_sidecar(state_dir)


# --------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("data", "message"), [
    ({"sources": []}, "data.sources: got []"),
    ({"sources": {"a": 1}}, "data.sources: got {'a': 1}"),
    ({"sources": ["x"]}, "data.sources[0]: got 'x'"),
    ({"sources": [{"data_files": "x"}]}, "data.sources[0].dataset_name_or_path: missing"),
    ({"sources": [{"dataset_name_or_path": "p"}, {"dataset_name_or_path": "p", "buffer_size": 0}]},
     "data.sources[1].buffer_size: got 0"),
    ({"sources": [{"dataset_name_or_path": "p", "weight": 0}]}, "data.sources[0].weight: got 0"),
    ({"sources": [{"dataset_name_or_path": "p", "weight": "x"}]}, "data.sources[0].weight: got 'x'"),
    ({"sources": [{"dataset_name_or_path": "p", "weight": float("inf")}]}, "data.sources[0].weight: got inf"),
    ({"sources": [{"dataset_name_or_path": "p", "wieght": 1}]}, "data.sources[0].wieght: unknown key; did you mean 'weight'"),
    ({"sources": [{"dataset_name_or_path": "p", "shuffle_seed": 1}]}, "data.sources[0].shuffle_seed: not a per-source key"),
    ({"sources": [{"dataset_name_or_path": "p", "max_seq_len": 8}]}, "data.sources[0].max_seq_len: not a per-source"),
    ({"sources": [{"dataset_name_or_path": "p", "label": "a/b"}]}, "data.sources[0].label: got 'a/b'"),
    ({"sources": [{"dataset_name_or_path": "p", "label": "x"}, {"dataset_name_or_path": "q", "label": "x"}]},
     "data.sources[1].label: got 'x', the label of data.sources[0] too"),
    ({"sources": [{"dataset_name_or_path": "p", "label": "source1"}, {"dataset_name_or_path": "q"}]},
     "data.sources[0].label: got 'source1', which is the default label of data.sources[1]"),
    ({"sources": [{"dataset_name_or_path": "p", "backend": "local", "streaming": True}]},
     "data.sources[0].streaming: got true with data.sources[0].backend 'local'"),
    ({"sources": [{"dataset_name_or_path": "p"}], "stopping": "longest"}, "data.stopping: got 'longest'; allowed: one of"),
    ({"sources": [{"dataset_name_or_path": "p"}], "data_files": "x"}, "data.data_files: got 'x' next to data.sources"),
    ({"sources": [{"dataset_name_or_path": "p"}], "buffer_size": -1}, "data.buffer_size: got -1"),
    ({"sources": [{"dataset_name_or_path": "p"}], "sorce": 1}, "data.sorce: unknown key"),
    ({"dataset_name_or_path": "p", "stopping": "never"}, "data.stopping: got 'never' without data.sources"),
    ({"dataset_name_or_path": "p", "source": []}, "did you mean 'sources'"),
])
def test_bad_mixture_config_names_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        StreamConfig.from_dict(data)
    assert str(e.value).startswith(message) or message in str(e.value), str(e.value)


def test_mixture_config_from_trainer_yaml_inherits_the_data_section():
    cfg = TrainerConfig.from_yaml(os.path.join(TINY, "train_mix.yaml"))
    mixture = cfg.stream
    assert isinstance(mixture, MixtureConfig) and mixture.labels == ("lm", "notes")
    assert mixture.probabilities == pytest.approx((0.7, 0.3)) and mixture.stopping == "all_exhausted"
    for s, files in zip(mixture.sources, ("data", "data_notes")):   # relative to the yaml, shared keys inherited
        assert s.data_files == os.path.join(TINY, files, "*.parquet")
        assert (s.shuffle, s.shuffle_seed, s.buffer_size, s.resume_state_path) == (True, 42, 256, None)
    assert cfg.transform.text_column == "text"
    assert StreamConfig.from_yaml(os.path.join(TINY, "train_mix.yaml")) == mixture
    replaced = mixture.replace(resume_state_path="x", cache_dir="/tmp/c")
    assert replaced.resume_state_path == "x" and all(s.cache_dir == "/tmp/c" for s in replaced.sources)
    assert all(s.resume_state_path is None for s in replaced.sources)


def test_open_stream_picks_the_stream_kind(dirs):
    cfg = mix(dirs)
    assert isinstance(open_stream(cfg, rank=0, world_size=1), MixtureStream)
    assert isinstance(open_stream(cfg.sources[0], rank=0, world_size=1), ResumableStream)


# ----------------------------------------------------------------------------------- loader with DataLoader workers
def _batches(loader, n):
    return [[row["id"] for row in batch] for batch in itertools.islice(loader, n)]


@pytest.mark.timeout(180)
def test_loader_with_workers_resumes_exactly_and_counts_what_was_consumed(dirs):
    cfg = mix(dirs, stopping="all_exhausted", shuffle=True, buffer_size=64)

    def loader():
        return StreamLoader(make(cfg, num_workers=2), batch_size=8, num_workers=2, prefetch_factor=4)

    reference = _batches(loader(), 70)
    first = loader()
    it = iter(first)
    head = [[row["id"] for row in next(it)] for _ in range(33)]    # workers have prefetched further
    state = through_sidecar(first.rank_state())
    del it
    flat = [i for batch in head for i in batch]
    assert source_counts(state["stream"]) == {"a": sum(source_of(i) == 0 for i in flat), "b": sum(source_of(i) == 1 for i in flat)}
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + _batches(resumed, 37) == reference


# ---------------------------------------------------------------------------------------------------------- CLI
def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "resumable_stream.app.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_peek_resumes_in_a_new_process_and_inspect_shows_per_source_progress(dirs, tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump({"data": {"shuffle": True, "buffer_size": 64, "stopping": "all_exhausted",
                                               "sources": [{"label": s, "dataset_name_or_path": "parquet", "weight": w,
                                                            "data_files": os.path.join(dirs[s], "*.parquet")}
                                                           for s, w in (("a", 2), ("b", 1))]}}))
    state = tmp_path / "state"
    full, head = (_cli("peek", str(config), "--num", "900", "--fields", "id"),
                  _cli("peek", str(config), "--num", "400", "--fields", "id", "--save-state", str(state)))
    full, head = _done(full), _done(head)
    tail, inspect = (_cli("peek", str(config), "--num", "500", "--fields", "id", "--resume-from", str(state)),
                     _cli("inspect", str(state)))
    tail, inspect = _done(tail), json.loads(_done(inspect))
    as_ids = lambda text: [json.loads(line)["id"] for line in text.splitlines()]   # noqa: E731
    assert as_ids(head) + as_ids(tail) == as_ids(full) and len(as_ids(full)) == 900
    summary = inspect["ranks"]["rank-00000.safetensors"]
    a, b = by_source(as_ids(head))
    assert summary["mixture"]["stopping"] == "all_exhausted"
    assert summary["partitions"]["0"]["consumed_samples"] == 400
    assert summary["sources"]["a"]["consumed_samples"] == len(a) and summary["sources"]["b"]["consumed_samples"] == len(b)
    assert summary["sources"]["a"]["weight"] == pytest.approx(2 / 3)
    b0 = summary["sources"]["b"]["partitions"]["0"]
    assert b0["epoch"] == len(b) // 300 and b0["epoch_fraction"] == pytest.approx((len(b) % 300) / 300, abs=1e-6)
    progress = inspect["progress"]["sources"]
    assert progress["a"]["consumed_samples"] == len(a) and progress["b"]["consumed_samples"] == len(b)
    assert progress["b"]["epochs_completed"]["min"] == pytest.approx(len(b) / 300, abs=1e-6)


# ------------------------------------------------------------------------------------------------------ trainer
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_logs_source_counts_and_resumes_exactly_after_sigkill(tmp_path, rng):
    """examples/tiny/train_mix.yaml (2 sources): train_log.jsonl's source_samples equal the consumed log's keys
    per source at every step, and a run SIGKILLed after a checkpoint and restarted matches an uninterrupted one."""
    max_steps, save_steps = 40, 10
    procs = Procs(str(tmp_path))
    try:
        ref_config, ref_out = write_config(str(tmp_path), "ref", max_steps=max_steps, save_steps=save_steps,
                                           template="train_mix.yaml")
        config, out = write_config(str(tmp_path), "run", max_steps=max_steps, save_steps=save_steps,
                                   template="train_mix.yaml")
        ref = procs.start(ref_config, "ref")
        run = procs.start(config, "run")
        target = rng.randint(save_steps + 1, max_steps - 8)       # the seed is printed on failure
        log = os.path.join(out, "train_log.jsonl")
        run.wait_until(lambda: count_lines(log) >= target and complete_checkpoints(out),
                       f"step {target} and a complete checkpoint")
        run.kill()
        assert run.proc.returncode == -signal.SIGKILL and count_lines(log) < max_steps, run.describe()
        resume_step = complete_checkpoints(out)[-1]
        restart = procs.start(config, "restart").wait_ok()
        ref.wait_ok()
        note = f"(killed after step {count_lines(log)}, resumed from checkpoint-{resume_step})"
        assert f"resuming from {checkpoint_path(out, resume_step)}" in restart.stderr, restart.describe()
        assert printed_steps(restart) == max_steps - resume_step, note

        ref_losses, losses = train_losses(ref_out), train_losses(out)
        assert sorted(losses) == list(range(1, max_steps + 1)), note
        assert all(abs(ref_losses[s] - losses[s]) <= 1e-6 for s in ref_losses), note
        ref_keys, keys = consumed(ref_out), consumed(out)
        assert keys == ref_keys, note

        def source_samples(directory):
            with open(os.path.join(directory, "train_log.jsonl"), encoding="utf-8") as f:
                return {rec["step"]: rec["source_samples"] for rec in map(json.loads, f)}

        counts = source_samples(out)
        assert counts == source_samples(ref_out), note
        running = collections.Counter()
        for step in range(1, max_steps + 1):       # no packing: one consumed key per sample
            running.update(k.split("/")[0] for k in keys[step])
            assert counts[step] == {"lm": running["lm"], "notes": running["notes"]}, f"step {step} {note}"
        assert 0.2 < running["notes"] / sum(running.values()) < 0.4

        def interval_samples(directory):       # the realized mixture: each line's own step, counted once
            with open(os.path.join(directory, "train_log.jsonl"), encoding="utf-8") as f:
                return {rec["step"]: rec["source_interval_samples"] for rec in map(json.loads, f)}

        per_step = interval_samples(out)
        assert per_step == interval_samples(ref_out), note
        for step in range(1, max_steps + 1):
            labels = collections.Counter(k.split("/")[0] for k in keys[step])
            assert per_step[step] == {"lm": labels["lm"], "notes": labels["notes"]}, f"step {step} {note}"
    finally:
        procs.cleanup()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_sum_source_counts_over_ranks(tmp_path):
    """2 gloo ranks with a DataLoader worker each: source_samples counts both ranks' consumed samples."""
    procs = Procs(str(tmp_path))
    try:
        config, out = write_config(str(tmp_path), "ddp", max_steps=12, save_steps=12, template="train_mix.yaml",
                                   workers=1)
        procs.start(config, "ddp", nproc=2).wait_ok()
        with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
            counts = {rec["step"]: rec["source_samples"] for rec in map(json.loads, f)}
        ranks = [consumed(out, r) for r in (0, 1)]
        running = collections.Counter()
        for step in range(1, 13):
            for keys in ranks:
                running.update(k.split("/")[0] for k in keys[step])
            assert counts[step] == {"lm": running["lm"], "notes": running["notes"]}, f"step {step}"
        assert sum(running.values()) == 2 * 12 * 8
        assert_data_parallel(out, 2)
    finally:
        procs.cleanup()


def test_a_source_without_rows_is_named_when_the_state_is_taken(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from resumable_stream.errors import SourceError
    from resumable_stream.testing import write_parquet_dataset

    write_parquet_dataset(str(tmp_path / "a"), rows=100, files=2, row_group_size=25)
    (tmp_path / "z").mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "text": pa.array([], pa.string()),
                             "label": pa.array([], pa.int64())}), str(tmp_path / "z" / "empty.parquet"))
    cfg = StreamConfig.from_dict({"sources": [
        {"label": "a", "dataset_name_or_path": "parquet", "data_files": str(tmp_path / "a" / "*.parquet")},
        {"label": "z", "dataset_name_or_path": "parquet", "data_files": str(tmp_path / "z" / "*.parquet")}]})
    stream = open_stream(cfg, 0, 1)
    list(itertools.islice(iter(stream), 3))
    with pytest.raises(SourceError, match=r"^data\.sources\[1\] \('z'\): "):
        stream.state_dict()
