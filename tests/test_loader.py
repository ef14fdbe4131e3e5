"""StreamLoader: batches through DataLoader workers, state = what was consumed, exact resume."""

import itertools
import os

import pytest
from helpers import parquet_config, through_sidecar
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, ResumableStream
from resumable_stream.loader import StreamLoader
from resumable_stream.sources import open_source


def _ids(batch):
    return [row["id"] for row in batch]


def _make(cfg, source, num_workers, world_size=1, rank=0, batch_size=8, keep_keys=False):
    stream = ResumableStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers, source=source)
    return StreamLoader(stream, batch_size=batch_size, num_workers=num_workers, prefetch_factor=4 if num_workers else None,
                        keep_keys=keep_keys)


@pytest.fixture(scope="module")
def setup(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=40)
    return cfg, open_source(cfg.source_spec)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed", [1, 2, 7, 30, 140])
def test_state_counts_consumed_not_prefetched_batches(setup, num_workers, consumed):
    cfg, source = setup
    loader = _make(cfg, source, num_workers)
    it = iter(loader)
    head = [_ids(next(it)) for _ in range(consumed)]
    state, state_dict = loader.rank_state(), loader.state_dict()
    # workers have prefetched ahead; the state must only count what was handed out
    total = sum(ps["consumed"] for ps in state["stream"]["partitions"].values())
    assert total == consumed * 8
    if num_workers == 2:
        counts = sorted(ps["consumed"] for ps in state["stream"]["partitions"].values())
        assert counts == sorted([((consumed + 1) // 2) * 8, (consumed // 2) * 8])
    # an uninterrupted run continues with exactly what a run resumed from this state yields
    more = [_ids(next(it)) for _ in range(12)]
    del it
    resumed = _make(cfg, source, num_workers)
    resumed.load_state_dict(through_sidecar(state))
    assert [_ids(b) for b in itertools.islice(resumed, 12)] == more
    # and the state is the same as that of another run stopped at the same batch
    other = _make(cfg, source, num_workers)
    assert [_ids(b) for b in itertools.islice(other, consumed)] == head
    assert other.rank_state() == state and other.state_dict() == state_dict     # the same bytes too
    # 1000 rows, in 1 or 2 partitions of hundreds of rows read in turn: none wraps within 400 samples
    early = [i for b in head + more for i in b][:400]
    assert len(set(early)) == len(early), "a sample was handed out twice within the first epoch"


def test_keys_of_consumed_batches(setup):
    cfg, source = setup
    loader = _make(cfg, source, 2, batch_size=4, keep_keys=True)
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    keys = loader.pop_consumed_keys()
    assert len(keys) == 12 and loader.pop_consumed_keys() == []
    shards = {s.index: s for s in source.shards}
    for key, row in zip(keys, [r for b in batches for r in b]):
        shard, r = map(int, key.split(":"))
        # rows of file f are ids [250 f, 250 f + 250); row groups of 50
        assert row["id"] == 250 * (shards[shard].index // 5) + 50 * shards[shard].part + r


def test_two_ranks_with_workers_never_share_a_sample(setup):
    cfg, source = setup
    seen = []
    for rank in range(2):
        loader = _make(cfg, source, 2, world_size=2, rank=rank, batch_size=10)
        seen.append({i for b in itertools.islice(loader, 50) for i in _ids(b)})   # one epoch: 500 per rank
    assert not (seen[0] & seen[1]) and len(seen[0] | seen[1]) == 1000


# ------------------------------------------------------------------------------ review regressions
@pytest.fixture(scope="module")
def dataset_600(tmp_path_factory):
    from resumable_stream.testing import write_parquet_dataset

    d = tmp_path_factory.mktemp("d600")
    write_parquet_dataset(str(d), rows=600, files=12, row_group_size=25)
    return str(d)


def _packing_loader(directory, num_workers):
    import functools

    from transformers import AutoTokenizer

    from resumable_stream import StreamConfig
    from resumable_stream.transforms import TextProcessor, TransformConfig, collate

    tok = AutoTokenizer.from_pretrained(os.path.join(REPO_ROOT, "examples", "tiny",
                                                     "tokenizer"))
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(directory, "*.parquet"),
                       shuffle=True, buffer_size=16, num_partitions=2)
    return StreamLoader(ResumableStream(cfg, 0, 1, num_workers), batch_size=2,
                        collate_fn=functools.partial(collate, pad_token_id=tok.pad_token_id),
                        processor_factory=functools.partial(TextProcessor, tok, TransformConfig(packing=True,
                                                                                                 max_seq_len=16)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_second_pass_over_a_loader_continues_after_the_last_batch_handed_out(dataset_600, num_workers):
    """Workers (and the main process's readers and packing processors) run ahead of what the loop took;
    iterating the loader again continues exactly after the last batch handed out."""
    import torch

    ref = [b["input_ids"] for b in itertools.islice(iter(_packing_loader(dataset_600, num_workers)), 10)]
    loader = _packing_loader(dataset_600, num_workers)
    got = [b["input_ids"] for b in itertools.islice(iter(loader), 5)]
    got += [b["input_ids"] for b in itertools.islice(iter(loader), 5)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_finite_epoch_through_the_loader_hands_out_every_row_including_short_last_batches(dataset_600,
                                                                                          num_workers):
    from resumable_stream import StreamConfig

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(dataset_600, "*.parquet"),
                       shuffle=True, buffer_size=16, num_partitions=4)
    s = ResumableStream(cfg, 0, 1, num_workers)
    s.set_epoch(0)
    got = [row["id"] for batch in StreamLoader(s, batch_size=7) for row in batch]
    assert sorted(got) == list(range(600))


def test_set_epoch_before_loading_a_sidecar_is_applied_to_the_loaded_cursors(dataset_600, tmp_path):
    from resumable_stream import StreamConfig

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(dataset_600, "*.parquet"),
                       shuffle=True, buffer_size=16)
    s = ResumableStream(cfg, 0, 1)
    list(itertools.islice(iter(s), 100))             # 100 rows into epoch 0
    s.save_sidecar(str(tmp_path / "st"))
    load_first = ResumableStream(cfg, 0, 1)
    load_first.load_sidecar(str(tmp_path / "st"))
    load_first.set_epoch(1)
    epoch_first = ResumableStream(cfg, 0, 1)
    epoch_first.set_epoch(1)
    epoch_first.load_sidecar(str(tmp_path / "st"))
    a, b = [r["id"] for r in load_first], [r["id"] for r in epoch_first]
    assert a == b and sorted(a) == list(range(600))


def test_plain_dataloader_with_workers_refuses_to_report_a_state(setup, tmp_path):
    """A plain DataLoader's workers read copies of the stream: its own state would say nothing was consumed
    and a resume would replay from the start. state_dict / save_sidecar raise, naming StreamLoader."""
    import torch.utils.data

    from resumable_stream import ConfigError

    cfg, source = setup
    stream = ResumableStream(cfg, rank=0, world_size=1, num_workers=2, source=source)
    fresh = stream.state_dict()        # nothing read yet: the start is the true position
    assert sum(ps["consumed"] for ps in fresh["partitions"].values()) == 0
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2, collate_fn=list)
    batches = list(itertools.islice(loader, 5))
    assert len(batches) == 5
    with pytest.raises(ConfigError, match="StreamLoader"):
        stream.state_dict()
    with pytest.raises(ConfigError, match="StreamLoader"):
        stream.save_sidecar(str(tmp_path / "state"))
    assert not (tmp_path / "state").exists()
    # without workers the stream itself is what was read: its state is exact
    plain = ResumableStream(cfg, rank=0, world_size=1, source=source)
    head = [row["id"] for b in itertools.islice(torch.utils.data.DataLoader(plain, batch_size=4, collate_fn=list), 3)
            for row in b]
    assert sum(ps["consumed"] for ps in plain.state_dict()["partitions"].values()) == len(head) == 12


def test_stream_loader_save_sidecar_writes_the_manifest_of_one_rank(setup, tmp_path):
    """StreamLoader.save_sidecar(dir) completes a one-rank dir like ResumableStream.save_sidecar, so it loads
    back (load_sidecar refuses a dir without manifest)."""
    cfg, source = setup
    loader = _make(cfg, source, 2)
    it = iter(loader)
    for _ in range(6):
        next(it)
    expected = [_ids(next(it)) for _ in range(4)]
    # the state after the 6 batches, written by a second loader resumed to the same point
    loader = _make(cfg, source, 2)
    it = iter(loader)
    for _ in range(6):
        next(it)
    state_dir = tmp_path / "stream_state"
    loader.save_sidecar(str(state_dir))
    assert sorted(os.listdir(state_dir)) == ["fingerprint.json", "index.bin", "manifest.json", "rank-00000.safetensors"]
    resumed = _make(cfg, source, 2)
    resumed.load_sidecar(str(state_dir))
    assert [_ids(b) for b in itertools.islice(resumed, 4)] == expected


@pytest.mark.slow
def test_readme_torch_loop_resumes_in_a_new_process(tmp_path):
    """examples/torch_loop.py (shown verbatim in docs/python-api.md): 5 steps, then on to 12 in a new process,
    equal the first 12 steps of one run, batches and losses; the prefetching workers never make the second run
    skip or repeat a batch. Its Checkpoints keep the newest 2 complete checkpoints."""
    import subprocess
    import sys

    root = REPO_ROOT
    script = os.path.join(root, "examples", "torch_loop.py")
    with open(script, encoding="utf-8") as f:
        code = f.read()
    with open(os.path.join(root, "docs", "python-api.md"), encoding="utf-8") as f:
        assert code.split('"""', 2)[2].strip() in f.read(), "docs/python-api.md shows examples/torch_loop.py verbatim"

    def run(out, steps):
        r = subprocess.run([sys.executable, script, str(out), str(steps)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": root})
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()          # "step [ids] loss" per step

    first, second, whole = run(tmp_path / "a", 5), run(tmp_path / "a", 12), run(tmp_path / "b", 12)
    assert len(whole) == 12 and [line.split()[0] for line in first + second] == [str(s) for s in range(1, 13)]
    assert first + second == whole
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-10", "checkpoint-12"]


def test_checkpoints_of_a_plain_loop(setup, tmp_path):
    """Checkpoints (resumable_stream.Checkpoints): a checkpoint is complete once the loader's state is written
    after the block of the user's own files; one cut short (an exception in the block, or a kill) is passed over
    and removed by the next resume; ``keep`` rotates; a step is saved once."""
    from resumable_stream import Checkpoints

    cfg, source = setup
    reference = [_ids(b) for b in itertools.islice(_make(cfg, source, 0), 9)]
    checkpoints = Checkpoints(tmp_path / "run", keep=2)
    loader = _make(cfg, source, 0)
    assert checkpoints.resume(loader) == 0 and checkpoints.latest() is None
    for step, batch in enumerate(loader, start=1):
        assert _ids(batch) == reference[step - 1]
        if step in (2, 4, 6):
            with checkpoints.save(step, loader) as path:
                (tmp_path / "run" / f"checkpoint-{step}" / "model.bin").write_bytes(b"weights")
                assert path == checkpoints.path(step)
        if step == 7:
            with pytest.raises(RuntimeError), checkpoints.save(step, loader):
                raise RuntimeError("the disk filled while the model was written")
            break
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-4", "checkpoint-6", "checkpoint-7"]
    with pytest.raises(ConfigError, match="already a complete checkpoint"):
        with checkpoints.save(6, loader):
            pass
    resumed = _make(cfg, source, 0)
    again = Checkpoints(tmp_path / "run", required=("model.bin",))
    assert again.resume(resumed) == 6 and sorted(os.listdir(tmp_path / "run")) == ["checkpoint-4", "checkpoint-6"]
    assert [_ids(b) for b in itertools.islice(resumed, 3)] == reference[6:9]
    with pytest.raises(ConfigError, match="keep: got 0"):
        Checkpoints(tmp_path, keep=0)
