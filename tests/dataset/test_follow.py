"""data.growth: follow: at the end of the known data the stream waits for new files and reads only those."""

import itertools
import os
import threading

import pytest
from growing_data import FILES, ROWS, add, dataset

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import ConfigError
from resumable_stream.state.checkpoint import finish


def _cfg(d: str, **kw) -> StreamConfig:
    kw = {"shuffle": True, "buffer_size": 64, "interleave_shards": 2, "block_rows": 16, "growth": "follow",
          "poll_interval_s": 0.05, "follow_timeout_s": 0.5, "num_partitions": 3, **kw}
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(d, "*.parquet"), **kw)


def _ids(stream, n: int | None = None) -> list[int]:
    return [r["id"] for r in itertools.islice(stream, n)]


def _checkpoint(stream, ckpt: str) -> str:
    stream.save_sidecar(ckpt, manifest=False)
    finish(ckpt, 1)
    return ckpt


def _resume(cfg, ckpt: str) -> ResumableStream:
    s = ResumableStream(cfg, index_from=ckpt)
    s.load_sidecar(ckpt)
    return s


@pytest.mark.parametrize("key,value", [("poll_interval_s", 0), ("poll_interval_s", "1"), ("follow_timeout_s", -1),
                                       ("follow_timeout_s", float("nan")), ("growth", "tail")])
def test_follow_keys_are_validated(tmp_path, key, value):
    with pytest.raises(ConfigError) as e:
        _cfg(str(tmp_path), **{key: value})
    assert f"data.{key}" in str(e.value) and repr(value) in str(e.value) and "allowed" in str(e.value)


def test_follow_refuses_dataloader_workers(tmp_path):
    d = dataset(tmp_path)
    with pytest.raises(ConfigError, match="data.growth: got 'follow' with 2 DataLoader worker.*allowed: follow read "
                                          "in the main process"):
        ResumableStream(_cfg(d, num_partitions=4), rank=0, world_size=1, num_workers=2)


def test_follow_with_several_ranks_reads_through_the_loader_under_a_process_group(tmp_path):
    """Iterating a rank's stream directly cannot keep the ranks in step: refused; the StreamLoader without an
    initialized torch.distributed group cannot agree on a wait: refused when its first round ends."""
    from resumable_stream.loader import StreamLoader

    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, num_partitions=4), rank=0, world_size=2)
    with pytest.raises(ConfigError, match="through a StreamLoader"):
        next(iter(s))
    with pytest.raises(ConfigError, match="without an initialized torch.distributed group"):
        list(StreamLoader(s, batch_size=8))


def test_follow_reads_the_known_data_once_then_ends_after_the_timeout(tmp_path, caplog):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, follow_timeout_s=0.3))
    with caplog.at_level("WARNING", logger="resumable_stream.stream.follow"):
        ids = _ids(s)
    assert sorted(ids) == list(range(ROWS))      # no second epoch over the old files
    assert "follow: no new files" in caplog.text and "follow_timeout_s" in caplog.text
    assert _ids(s) == []       # iterating again waits again, and ends


def test_follow_picks_up_a_file_written_while_it_waits(tmp_path):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, follow_timeout_s=20))
    first = _ids(s, ROWS)
    writer = threading.Timer(0.3, add, (d, "late", 1000))
    writer.start()
    try:
        new = _ids(s, 100)
    finally:
        writer.join()
    assert sorted(first) == list(range(ROWS))
    assert sorted(new) == list(range(1000, 1100))
    writer2 = threading.Timer(0.3, add, (d, "later", 2000, 50))
    writer2.start()
    try:
        assert sorted(_ids(s, 50)) == list(range(2000, 2050))   # only the newest file: epoch 2
    finally:
        writer2.join()


class _Seams:
    """The stream as a Follower may use it: its public seams, any other attribute refused."""
    ALLOWED = {"round", "furthest_epoch", "layout", "source", "adopt_index", "spec", "config", "rank", "world_size"}

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        if name not in self.ALLOWED:
            raise AssertionError(f"the Follower reached past the stream's seams: {name}")
        return getattr(self._stream, name)


def test_follow_mode_is_a_wrapper_over_the_streams_public_seams(tmp_path):
    """Issue 50: follow mode is a Follower over the stream (stream/follow.py), not methods of it: driven through
    a proxy that refuses anything but the seams, it reads the known files, waits, takes in a file written while it
    waits, and ends after the timeout."""
    from resumable_stream.stream.base import StreamBase
    from resumable_stream.stream.follow import Follower

    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, follow_timeout_s=1.0))
    follower = Follower(_Seams(s))
    writer = threading.Timer(0.3, add, (d, "late", 1000, 40))
    writer.start()
    try:
        ids = [r["id"] for r in follower.samples(lambda: StreamBase.__iter__(s))]
    finally:
        writer.join()
    assert sorted(ids[:ROWS]) == list(range(ROWS)) and sorted(ids[ROWS:]) == list(range(1000, 1040))
    assert follower.ended and s.round() == 2


def test_exact_resume_in_the_middle_of_a_wait(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20)
    a = ResumableStream(cfg)
    assert sorted(_ids(a, ROWS)) == list(range(ROWS))
    ckpt = _checkpoint(a, str(tmp_path / "ckpt"))      # saved at the end of the data: waiting
    add(d, "late", 1000)
    want = _ids(a, 100)
    b = _resume(cfg, ckpt)
    assert _ids(b, 100) == want
    assert sorted(want) == list(range(1000, 1100))


def test_exact_resume_in_the_middle_of_a_new_file(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20)
    a = ResumableStream(cfg)
    _ids(a, ROWS)
    add(d, "late", 1000, 200)
    head = _ids(a, 70)
    ckpt = _checkpoint(a, str(tmp_path / "ckpt"))
    tail = _ids(a, 130)
    assert sorted(head + tail) == list(range(1000, 1200))
    b = _resume(cfg, ckpt)
    assert _ids(b, 130) == tail


def test_append_layout_is_unchanged_by_the_follow_field(tmp_path):
    d = dataset(tmp_path)
    s = ResumableStream(_cfg(d, growth="append"))
    assert s.layout.follow is False
    s.set_epoch(1)
    assert sorted(_ids(s)) == list(range(ROWS))     # append: epoch 1 reads the old files again


def test_follow_is_refused_in_a_mixture(tmp_path):
    d = dataset(tmp_path)
    src = {"dataset_name_or_path": "parquet", "data_files": os.path.join(d, "*.parquet"), "streaming": True}
    with pytest.raises(ConfigError, match=r"data.growth: got 'follow' with data.sources; allowed: off or append"):
        StreamConfig.from_dict({"growth": "follow", "sources": [{**src, "weight": 1}, {**src, "weight": 2}]})


def _loader_ids(it, batches: int) -> list[int]:
    return [row["id"] for batch in itertools.islice(it, batches) for row in batch]


@pytest.mark.parametrize("partitions", [1, 3])
def test_loader_follows_and_resumes_exactly_in_a_wait_and_in_a_new_file(tmp_path, partitions):
    """The StreamLoader (what the Trainer reads) waits between rounds too: a file written while it waits is
    read; a loader state saved at the end of the data and one saved inside the new file both resume exactly."""
    from resumable_stream.loader import StreamLoader

    d = dataset(tmp_path)
    cfg = _cfg(d, follow_timeout_s=20, num_partitions=partitions)
    loader = StreamLoader(ResumableStream(cfg), batch_size=8)
    it = iter(loader)
    first = []
    while len(first) < ROWS:
        first += _loader_ids(it, 1)
    assert sorted(first) == list(range(ROWS))

    def checkpoint(name):
        path = str(tmp_path / name)
        loader.save_sidecar(path, manifest=False)
        finish(path, 1)
        return path

    def resumed(path):
        s = ResumableStream(cfg, index_from=path)
        other = StreamLoader(s, batch_size=8)
        other.load_state_dict(s.read_sidecar(path)[0], where=path)
        return iter(other)

    in_wait = checkpoint("wait")
    writer = threading.Timer(0.3, add, (d, "late", 1000, 200))
    writer.start()
    try:
        head = _loader_ids(it, 5)
    finally:
        writer.join()
    in_file = checkpoint("file")
    tail = _loader_ids(it, 5)
    assert set(head + tail) <= set(range(1000, 1200)) and len(set(head + tail)) == 80
    assert _loader_ids(resumed(in_wait), 10) == head + tail
    assert _loader_ids(resumed(in_file), 5) == tail


_RANK_SCRIPT = """
import json, os, sys, threading, time
import torch.distributed as dist
from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.state.checkpoint import finish
from resumable_stream.loader import StreamLoader

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                   buffer_size=64, interleave_shards=2, block_rows=16, growth="follow", num_partitions=4,
                   poll_interval_s=0.05, follow_timeout_s=3)
ckpt = os.path.join(out, phase, "stream_state")
import resumable_stream.dataset.growth as growth
polls, recheck = [0], growth.recheck


def counted(*args, **kwargs):     # a listing of the files (growth.refresh calls it on rank 0 only)
    polls[0] += 1
    return recheck(*args, **kwargs)


growth.recheck = counted
if phase == "live":
    stream = ResumableStream(cfg, rank=rank, world_size=world)
    loader = StreamLoader(stream, batch_size=8)
else:
    before = os.path.join(out, "live" if phase == "resumed" else "resumed", "stream_state")
    stream = ResumableStream(cfg, rank=rank, world_size=world, index_from=before)
    loader = StreamLoader(stream, batch_size=8)
    loader.load_state_dict(stream.read_sidecar(before)[0], where=before)
if phase == "rest":     # what the checkpoint has not read yet, epoch by epoch (set_epoch: no waits)
    batches = []
    for epoch in range(8):
        stream.set_epoch(epoch)
        batches += [[row["id"] for row in batch] for batch in loader]
    with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
        json.dump({"batches": batches}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
staging = os.path.join(out, "staging")
writer = None
if rank == 0 and phase == "live":     # a file appears while the job waits (0.3 s into its first wait)
    waiting, wait = threading.Event(), stream.follower.wait_in_step

    def follow_wait(holding):
        waiting.set()
        return wait(holding)

    def write():
        waiting.wait(60)
        time.sleep(0.3)
        for n in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, n), os.path.join(data, n))

    stream.follower.wait_in_step = follow_wait
    writer = threading.Thread(target=write)
    writer.start()
batches = [[row["id"] for row in batch] for batch in loader]     # ends on every rank after follow_timeout_s
if writer is not None:
    writer.join()
loader.save_sidecar(ckpt, manifest=False)
dist.barrier()
if rank == 0:
    finish(ckpt, world)
result = {"batches": batches, "ended": stream.follow_ended, "polls": polls[0],
          "generations": stream.source.index["growth"]["generations"]}
with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_follow_in_step_every_row_once_and_resume_after_the_timeout(tmp_path):
    """2 processes over gloo, StreamLoader in the main process: the ranks read round 0, a file written while
    the job runs becomes round 1 for both (rank 0 lists, the index is broadcast: the same generations), the
    ranks hand out the same number of batches (in step) and all end after follow_timeout_s with a checkpoint;
    the resumed job reads the rows left of the round and a file added since: every row once across all."""
    import collections
    import json
    import subprocess
    import sys

    from training_helpers import free_port

    d = dataset(tmp_path)
    (tmp_path / "rank.py").write_text(_RANK_SCRIPT)
    staging = tmp_path / "staging"
    staging.mkdir()
    live_new = add(str(staging), "part-00009", 1000, 150)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(phase: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                               str(tmp_path / "rank.py"), d, str(tmp_path), phase],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads((tmp_path / f"{phase}-{r}.json").read_text()) for r in range(2)]

    live = run("live")
    assert all(r["ended"] for r in live)
    assert len(live[0]["batches"]) == len(live[1]["batches"]) > 0           # in step: the same steps
    assert live[0]["generations"] == live[1]["generations"]
    # one listing per poll for the job, by rank 0; backing off: two waits of 3 s at 0.05 s doubling to 0.8 s
    assert live[1]["polls"] == 0 and 2 <= live[0]["polls"] <= 24
    assert len(live[0]["generations"]) == 2 and live[0]["generations"][1]["files"] == FILES + 1
    seen = collections.Counter(i for r in live for b in r["batches"] for i in b)
    assert set(seen.values()) == {1}                                          # nothing read twice
    assert set(range(ROWS)) <= set(seen) and set(seen) <= set(range(ROWS)) | set(live_new)
    later = add(d, "part-00010", 2000, 120)
    resumed = run("resumed")
    assert all(r["ended"] for r in resumed)
    assert len(resumed[0]["batches"]) == len(resumed[1]["batches"])
    assert resumed[0]["generations"] == resumed[1]["generations"]
    seen.update(i for r in resumed for b in r["batches"] for i in b)
    assert set(seen.values()) == {1} and set(seen) <= set(range(ROWS)) | set(live_new) | set(later)
    # a rank still holding a batch of its round when the wait timed out has not handed it out: the checkpoint
    # has it; read to its end, every row of every round is read exactly once across the ranks and runs
    seen.update(i for r in run("rest") for b in r["batches"] for i in b)
    assert sorted(seen) == sorted(list(range(ROWS)) + live_new + later) and set(seen.values()) == {1}


_EXACT_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.state.checkpoint import finish
from resumable_stream.loader import StreamLoader

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data, out, phase, mid_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                   buffer_size=64, interleave_shards=2, block_rows=16, growth="follow", num_partitions=4,
                   poll_interval_s=0.05, follow_timeout_s=1)
ckpt = {"a": "wait", "b": "mid"}
start = {"b": "wait", "c": "mid"}.get(phase)


def checkpoint(name):
    path = os.path.join(out, name, "stream_state")
    loader.save_sidecar(path, manifest=False)
    dist.barrier()
    if rank == 0:
        finish(path, world)
    dist.barrier()


if start is None:
    stream = ResumableStream(cfg, rank=rank, world_size=world)
    loader = StreamLoader(stream, batch_size=8)
else:
    path = os.path.join(out, start, "stream_state")
    stream = ResumableStream(cfg, rank=rank, world_size=world, index_from=path)
    loader = StreamLoader(stream, batch_size=8)
    loader.load_state_dict(stream.read_sidecar(path)[0], where=path)
batches = []
for batch in loader:     # ends on every rank at the same step, after follow_timeout_s without new files
    batches.append([row["id"] for row in batch])
    if len(batches) == mid_at:
        checkpoint("mid")
if phase == "a":
    checkpoint("wait")
with open(os.path.join(out, f"{phase}-{mid_at}-{rank}.json"), "w") as f:
    json.dump({"batches": batches, "ended": stream.follow_ended}, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_follow_resumes_exactly_from_a_wait_and_from_inside_a_new_file(tmp_path):
    """2 processes over gloo: a job reads the data and times out in a wait (checkpoint on every rank); a file is
    added; the job resumed from the wait reads the same batches on every rank each time it is run, and a
    checkpoint saved inside that file resumes with exactly the batches the run had after it."""
    import json
    import subprocess
    import sys

    from training_helpers import free_port

    d = dataset(tmp_path)
    (tmp_path / "rank.py").write_text(_EXACT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(phase: str, mid_at: int = -1) -> list[list[list[int]]]:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                               str(tmp_path / "rank.py"), d, str(tmp_path), phase, str(mid_at)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [json.loads((tmp_path / f"{phase}-{mid_at}-{r}.json").read_text()) for r in range(2)]
        assert all(r["ended"] for r in results) and len(results[0]["batches"]) == len(results[1]["batches"])
        return [r["batches"] for r in results]

    first = run("a")
    new = add(d, "late", 1000, 200)
    full = run("b")
    assert set(new) <= {i for rank in full for b in rank for i in b}
    mid = len(full[0]) // 2
    ids = [{i for rank in full for b in rank[part] for i in b} for part in (slice(None, mid), slice(mid, None))]
    assert ids[0] & set(new) and ids[1] & set(new)     # the save at `mid` is inside the new file
    assert run("b", mid) == full                       # the wait's state resumes the same way every time
    assert run("c") == [rank[mid:] for rank in full]   # inside the new file: exactly the rest
    seen = [i for phase in (first, full) for rank in phase for b in rank for i in b]
    assert len(seen) == len(set(seen))
