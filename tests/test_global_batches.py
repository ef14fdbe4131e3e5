"""The same global batches on any number of ranks and DataLoader workers (``data.elastic_determinism``).

With ``data.num_partitions`` P each rank hands out its micro-batches in rounds, one from each of its partitions;
an optimizer step of ``P / ranks`` micro-batches per rank (one round) takes the next micro-batch of every
partition. So the multiset of every step's samples (their keys and their packed tokens) is the same on 1, 2, 3,
4, 6 and 12 ranks with 0-2 workers, and a run saved between steps continues that identical sequence on another
topology (1 -> 2, 2 -> 1, 2 -> 3, 3 -> 4, 4 -> 2 ranks, with and without workers), inside packed blocks and across
epoch ends; for packing, neat packing of chat (SFT) rows, and a mixture whose weights follow a schedule in steps
and change on a resume (``data.mixture_change: allow``). Ranks are loaders of their rank in this process (no
collective is needed to read or save); tests/trainings/test_elastic_training.py trains for real.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections import Counter

import pytest
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream import ConfigError, ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.loader import StreamLoader
from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.stream.mixture import open_stream
from resumable_stream.testing import write_parquet_dataset
from resumable_stream.transforms import TextProcessor, TransformConfig, collate

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
P = 12                 # virtual partitions: 1, 2, 3, 4, 6 and 12 ranks
BATCH = 2              # per-device (micro-)batch


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """480 rows, 48 shards of 10: 40 rows (4 shards) per partition and epoch."""
    d = tmp_path_factory.mktemp("global_batches")
    write_parquet_dataset(str(d), rows=480, files=12, row_group_size=10)
    return str(d)


def _text(data: str, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                        buffer_size=16, num_partitions=P, **kw)


def _sft(**kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(TINY, "data_sft", "*.parquet"),
                        shuffle=True, buffer_size=32, num_partitions=P, **kw)


def _mixture(data: str, **kw):
    """Two sources, the first's weight a ramp over steps (so the draws depend on samples_per_step)."""
    return StreamConfig.from_dict({
        "sources": [{"label": "synthetic", "dataset_name_or_path": "parquet",
                     "data_files": os.path.join(data, "*.parquet"),
                     "weight": {"schedule": "linear", "unit": "steps", "points": [[0, 0.8], [12, 0.2]]}},
                    {"label": "notes", "dataset_name_or_path": "parquet",
                     "data_files": os.path.join(TINY, "data_notes", "*.parquet"), "weight": 0.4}],
        "shuffle": True, "buffer_size": 16, "num_partitions": P, **kw})


def _factory(tok, transform: TransformConfig):
    return functools.partial(TextProcessor, tok, transform)


PACKING = TransformConfig(packing=True, max_seq_len=16)
NEAT_SFT = TransformConfig(format="messages", messages_column="messages", packing=True, packing_mode="neat",
                           max_seq_len=48)


class Job:
    """The loaders of every rank of one topology (each rank's loader in this process)."""

    def __init__(self, cfg, tok, transform, world: int, workers: int, resume_from: str | None = None):
        self.loaders = []
        for rank in range(world):
            stream = open_stream(cfg, rank=rank, world_size=world, num_workers=workers)
            if hasattr(stream, "set_samples_per_step"):     # what the trainers set: batch x accumulation x ranks
                stream.set_samples_per_step(BATCH * P)
            loader = StreamLoader(stream, BATCH, collate_fn=functools.partial(collate, pad_token_id=tok.pad_token_id),
                                  processor_factory=_factory(tok, transform), num_workers=workers,
                                  prefetch_factor=2 if workers else None, keep_keys=True)
            if resume_from:
                loader.load_sidecar(resume_from)
            self.loaders.append(loader)
        self.iters = [iter(loader) for loader in self.loaders]

    def steps(self, n: int) -> list[tuple[list, list]]:
        """``n`` optimizer steps, each ``micro_batches_per_step`` micro-batches of every rank: per step the
        sorted sample keys and the sorted token rows of its micro-batches (the step's multiset)."""
        out = []
        for _ in range(n):
            keys, rows = [], []
            for loader, it in zip(self.loaders, self.iters):
                assert loader.micro_batches_per_step == P // len(self.loaders)
                for _ in range(loader.micro_batches_per_step):
                    batch = next(it)
                    rows += [tuple(r) for r in batch["input_ids"].tolist()]
                keys += loader.pop_consumed_keys()
            out.append((sorted(keys), sorted(rows)))
        return out

    def save(self, state_dir: str) -> dict:
        """Every rank's state into ``state_dir`` (the manifest last); returns rank 0's nested state."""
        for loader in self.loaders:
            loader.save_sidecar(state_dir, manifest=False)
        write_manifest(state_dir, len(self.loaders))
        return self.loaders[0].rank_state()

    def close(self) -> None:
        self.iters = []       # the DataLoader workers end with their iterators


def _steps_on(cfg, tok, transform, world, workers, n):
    job = Job(cfg, tok, transform, world, workers)
    try:
        return job.steps(n)
    finally:
        job.close()


# -------------------------------------------------------------------------------- the same steps on any shape
@pytest.mark.parametrize(("world", "workers"), [(2, 0), (3, 0), (4, 0), (6, 0), (12, 0), (1, 2), (4, 2), (6, 1)],
                         ids=lambda v: str(v))
def test_every_step_takes_the_same_samples_on_any_ranks_and_workers(text_data, tok, world, workers):
    """Shuffled and packed, over an epoch end (12 steps of 12 micro-batches pass each partition's 40 rows):
    the same multiset per step as one rank without workers. 4 ranks x 2 workers: 3 partitions per rank over 2
    workers (a lane of 2 and one of 1, whose missing batch each round is a skip)."""
    n = 15
    reference = _steps_on(_text(text_data), tok, PACKING, 1, 0, n)
    assert _steps_on(_text(text_data), tok, PACKING, world, workers, n) == reference


def test_neat_packed_chat_rows_take_the_same_samples_on_any_shape(tok):
    reference = _steps_on(_sft(), tok, NEAT_SFT, 1, 0, 8)
    for world, workers in [(3, 0), (2, 2)]:
        assert _steps_on(_sft(), tok, NEAT_SFT, world, workers, 8) == reference, (world, workers)


def test_a_mixture_with_a_weight_schedule_takes_the_same_samples_on_any_shape(text_data, tok):
    reference = _steps_on(_mixture(text_data), tok, PACKING, 1, 0, 10)
    for world, workers in [(4, 0), (2, 1)]:
        assert _steps_on(_mixture(text_data), tok, PACKING, world, workers, 10) == reference, (world, workers)


# ------------------------------------------------------------------------ elastic resume: the identical sequence
CHAIN = [((1, 0), 3), ((2, 2), 7), ((1, 1), 10), ((2, 0), 12), ((3, 1), 14), ((4, 0), 16), ((4, 2), 18),
         ((2, 1), 21)]    # (ranks, workers) and the step it is saved (killed) at: 1->2->1->2->3->4->4->2


def _chain(cfg, tok, transform, tmp_path, chain, change=None):
    """Train ``chain`` (each topology up to its step, saved there, the next resumed from it); ``change``:
    (step, config) to resume that step's run with (a mixture's new weights). Returns every step's multiset
    and what the saves held."""
    steps, saves, resume_from, done = [], [], None, 0
    for i, ((world, workers), until) in enumerate(chain):
        if change is not None and change[0] == done:
            cfg = change[1]
        job = Job(cfg, tok, transform, world, workers, resume_from)
        try:
            steps += job.steps(until - done)
            resume_from = str(tmp_path / f"save-{i}" / "stream_state")
            saves.append(job.save(resume_from))
        finally:
            job.close()
        done = until
    return steps, saves


def test_an_elastic_resume_continues_the_identical_sequence(text_data, tok, tmp_path):
    """Saved at steps 3 ... 18 and resumed on another topology each time (1 -> 2, 2 -> 1, 1 -> 2, 2 -> 3,
    3 -> 4, 4 -> 4 with workers, 4 -> 2), inside packed blocks and across the epoch end: every step equals the
    uninterrupted run's."""
    cfg = _text(text_data, elastic=True)
    reference = _steps_on(cfg, tok, PACKING, 1, 0, CHAIN[-1][1])
    got, saves = _chain(cfg, tok, PACKING, tmp_path, CHAIN)
    assert len(got) == len(reference)
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        assert a == b, f"step {step} differs from the uninterrupted run's"
    # what the saves stood inside: packed tokens carried over, and partitions in their second epoch
    assert all(any(carry for carry in save["transform"].values()) for save in saves)
    epochs = {ps["epoch"] for save in saves for ps in save["stream"]["partitions"].values()}
    assert epochs == {0, 1}


def test_an_elastic_resume_of_a_mixture_continues_its_schedule_and_a_change_of_weights(text_data, tok, tmp_path):
    """A weight schedule in steps and, at the resume of step 7 (2 ranks with workers -> 1 rank), new weights
    (data.mixture_change: allow): the same steps as one run on one rank that takes the same change there."""
    cfg = _mixture(text_data, elastic=True, mixture_change="allow")
    changed = cfg.replace(weights=(0.5, 0.5))
    chain = [((1, 0), 3), ((2, 2), 7), ((1, 1), 9), ((4, 0), 11)]
    reference, _ = _chain(cfg, tok, PACKING, tmp_path / "reference", [((1, 0), 7), ((1, 0), 11)], (7, changed))
    got, _ = _chain(cfg, tok, PACKING, tmp_path / "elastic", chain, (7, changed))
    assert got == reference


# ------------------------------------------------------------------------------------- what is refused, and why
def test_a_state_saved_inside_a_step_resumes_on_its_own_topology_only(text_data, tok, tmp_path):
    cfg = _text(text_data, elastic=True)
    job = Job(cfg, tok, PACKING, 2, 0)
    job.steps(2)
    next(job.iters[0]), next(job.iters[1])      # one micro-batch of step 3 on each rank
    state_dir = str(tmp_path / "inside" / "stream_state")
    job.save(state_dir)
    expected = [next(it)["input_ids"].tolist() for it in job.iters]
    with pytest.raises(StreamMismatchError) as e:
        Job(cfg, tok, PACKING, 1, 0, state_dir)
    msg = str(e.value)
    assert "saved inside a round of micro-batches" in msg and "rank 0 of the 2" in msg
    assert "handed out 1 of the 6 micro-batches" in msg and "Resume it on 2 ranks x 0 DataLoader workers" in msg
    assert "data.elastic_determinism: false" in msg
    same = Job(cfg, tok, PACKING, 2, 0, state_dir)          # the same topology continues it exactly
    assert [next(it)["input_ids"].tolist() for it in same.iters] == expected
    loose = Job(cfg.replace(elastic_determinism=False), tok, PACKING, 1, 0, state_dir)   # allowed, rounds afresh
    assert next(loose.iters[0]) is not None


def test_num_partitions_must_split_evenly_over_the_ranks(text_data):
    stream = ResumableStream(_text(text_data), rank=0, world_size=5)
    with pytest.raises(ConfigError) as e:
        StreamLoader(stream, BATCH)
    msg = str(e.value)
    assert "data.num_partitions: got 12 virtual partitions on 5 ranks" in msg
    assert "1, 2, 3, 4, 6, 12 ranks" in msg and "data.elastic_determinism: false" in msg
    loose = ResumableStream(_text(text_data, elastic_determinism=False), rank=0, world_size=5)
    assert StreamLoader(loose, BATCH).micro_batches_per_step == 3      # rank 0 of 5: partitions 0-2


def test_the_accumulation_must_take_whole_rounds(text_data):
    loader = StreamLoader(ResumableStream(_text(text_data), rank=0, world_size=2, num_workers=2), BATCH,
                          num_workers=2)
    assert loader.micro_batches_per_step == 6
    loader.check_accumulation(6)
    loader.check_accumulation(12)
    with pytest.raises(ConfigError) as e:
        loader.check_accumulation(4, {"accumulation": "train.gradient_accumulation_steps",
                                      "batch": "train.per_device_train_batch_size",
                                      "workers": "train.dataloader_num_workers"})
    msg = str(e.value)
    assert msg.startswith("train.gradient_accumulation_steps: got 4 on 2 rank(s) x train.dataloader_num_workers 2 "
                          "with data.num_partitions 12")
    assert "train.per_device_train_batch_size 2" in msg and "a multiple of num_partitions / ranks = 6" in msg
    assert "data.elastic_determinism: false" in msg
    StreamLoader(ResumableStream(_text(text_data, elastic_determinism=False), rank=0, world_size=2),
                 BATCH).check_accumulation(4)      # off: any accumulation


def test_the_default_follows_num_partitions(text_data):
    assert _text(text_data).same_global_batches
    assert not _text(text_data).replace(num_partitions=None).same_global_batches
    assert _text(text_data).replace(num_partitions=None, elastic_determinism=True).same_global_batches
    assert not _text(text_data, elastic_determinism=False).same_global_batches
    with pytest.raises(ConfigError) as e:
        StreamConfig(dataset_name_or_path="x/y", elastic_determinism="yes")
    assert "data.elastic_determinism: got 'yes'" in str(e.value)


def test_keys_count_every_sample_of_a_step_once(text_data, tok):
    """The step multisets compared above are not vacuous: a step of 12 micro-batches of 2 packed blocks holds
    the keys of many samples, and consecutive steps differ."""
    steps = _steps_on(_text(text_data), tok, PACKING, 1, 0, 2)
    assert all(len(rows) == P * BATCH for _, rows in steps)
    assert len(Counter(steps[0][0])) > P and steps[0] != steps[1]
    assert not set(itertools.chain(steps[0][1])) & set(steps[1][1])
