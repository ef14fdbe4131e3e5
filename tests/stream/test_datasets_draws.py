"""A mixture drawing in ``datasets.interleave_datasets``' sequence (draws ``datasets_cycle`` / ``datasets_choice``:
LLaMA-Factory's ``interleave_*`` with ``buffer_size: 1``) has datasets' epochs too: an epoch ends right after the
last row of the source that ends it (first_exhausted) or of the last one to run out (all_exhausted), and the next
starts every source from its first row. Compared here with the real ``datasets`` (one file per source, read in
file order as LLaMA-Factory reads it: ``interleave_datasets(...).shuffle(seed, buffer_size=1)``, one epoch per
``set_epoch``); the later epochs with probabilities, whose draws datasets 5 seeds otherwise than LLaMA-Factory's
datasets 4.0, against LLaMA-Factory itself: tests/against_llamafactory/test_llamafactory_epochs.py."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers import through_sidecar

from resumable_stream import MixtureStream, StreamConfig
from resumable_stream.sources import open_source

SEED = 42
ROWS = {"a": range(0, 7), "b": range(100, 104)}     # a sample's id tells its source and its row


@pytest.fixture(scope="module")
def files(tmp_path_factory, hub_offline):
    root = tmp_path_factory.mktemp("datasets_draws")
    out = {}
    for label, ids in ROWS.items():      # json lines, as LLaMA-Factory's datasets mostly are
        out[label] = str(root / f"{label}.jsonl")
        with open(out[label], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": i}) + "\n" for i in ids)
    return out


_OPENED: dict = {}


def ours(files, stopping: str, probabilities=None) -> MixtureStream:
    cfg = StreamConfig.from_dict({"shuffle": False, "stopping": stopping, "shuffle_seed": SEED, "sources": [
        {"label": label, "dataset_name_or_path": "json", "data_files": path, "weight": w}
        for (label, path), w in zip(files.items(), probabilities or (1, 1))]})
    for s in cfg.sources:       # each file opened once for the module
        if s.data_files not in _OPENED:
            _OPENED[s.data_files] = open_source(s.source_spec)
    sources = [_OPENED[s.data_files] for s in cfg.sources]
    return MixtureStream(cfg, rank=0, world_size=1, sources=sources,
                         draws="datasets_choice" if probabilities else "datasets_cycle")


def theirs(files, stopping: str, epochs: int, probabilities=None) -> list[list[int]]:
    import datasets

    parts = [datasets.load_dataset("json", data_files=path, split="train", streaming=True) for path in files.values()]
    mixed = datasets.interleave_datasets(parts, probabilities=probabilities, seed=SEED, stopping_strategy=stopping)
    mixed = mixed.shuffle(seed=SEED, buffer_size=1)
    out = []
    for epoch in range(epochs):
        mixed.set_epoch(epoch)
        out.append([row["id"] for row in mixed])
    return out


def epochs_of(stream: MixtureStream, epochs: int) -> list[list[int]]:
    out = []
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        out.append([row["id"] for row in stream])
    return out


def ids(stream, n: int) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_in_turn_epochs_are_those_of_datasets_interleave(files, stopping):
    reference = theirs(files, stopping, 4)
    # each epoch restarts both sources: it starts with a's first row, then b's
    assert all(epoch[:2] == [0, 100] for epoch in reference) and len(set(map(tuple, reference))) == 1
    assert epochs_of(ours(files, stopping), 4) == reference
    assert ids(ours(files, stopping), sum(map(len, reference))) == sum(reference, [])     # endless: the same


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_first_epoch_with_probabilities_is_that_of_datasets_interleave(files, stopping):
    reference = theirs(files, stopping, 1, [0.6, 0.4])[0]
    last = 103 if reference[-1] >= 100 else 6      # it ends with the last row of a source
    assert reference[-1] == last
    assert epochs_of(ours(files, stopping, [0.6, 0.4]), 1) == [reference]


@pytest.mark.parametrize("probabilities", [None, [0.6, 0.4]], ids=["in-turn", "probabilities"])
@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_resume_after_every_sample_across_epoch_ends(files, stopping, probabilities):
    """From the state after any sample (right after an epoch's last row included), the same samples follow."""
    stream = ours(files, stopping, probabilities)
    reference = epochs_of(ours(files, stopping, probabilities), 3)
    total = sum(map(len, reference))
    states = []
    for row in itertools.islice(stream, total):
        states.append((row["id"], through_sidecar(stream.state_dict())))
    assert [i for i, _ in states] == sum(reference, [])
    following = [i for i, _ in states] + ids(stream, 5)
    for k, (_, state) in enumerate(states):
        resumed = ours(files, stopping, probabilities)
        resumed.load_state_dict(state)
        assert ids(resumed, 5) == following[k + 1:k + 6], f"resumed after sample {k}"
