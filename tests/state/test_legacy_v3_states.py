"""Checkpoints of format version 3 written before the compact fingerprint (tests/data/legacy_v3: a
``fingerprint.json`` listing every file, the JSON ``index.json`` / ``index-<label>.json``) still load and continue
exactly as that version continued them, read over a copy of their data elsewhere (compared by content)."""

import json
import os

import pytest
from legacy_states import (
    LEGACY_V3,
    SAVED_WORLD,
    batch_ids,
    copy_data,
    loader,
    mixture_config,
    sample_ids,
    stream_config,
)

from resumable_stream.stream.mixture import open_stream

with open(os.path.join(LEGACY_V3, "expected.json")) as _f:
    EXPECTED = json.load(_f)
CONFIGS = {"stream": stream_config, "mixture": mixture_config}
kinds = pytest.mark.parametrize("kind", ["stream", "mixture"])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("legacy_v3")))


def test_the_checkpoints_are_the_json_forms(data):
    state = os.path.join(LEGACY_V3, "stream", "stream_state")
    assert isinstance(json.load(open(os.path.join(state, "fingerprint.json")))["dataset"]["files"], list)
    assert os.path.isfile(os.path.join(state, "index.json"))
    assert os.path.isfile(os.path.join(LEGACY_V3, "mixture", "stream_state", "index-a.json"))


@kinds
def test_a_json_index_checkpoint_continues_every_rank_as_it_did(kind, data):
    for rank in range(SAVED_WORLD):
        ld = loader(CONFIGS[kind](data), rank, SAVED_WORLD)
        ld.load_sidecar(os.path.join(LEGACY_V3, kind))
        assert batch_ids(iter(ld), 6) == EXPECTED[kind][f"rank{rank}"]


@kinds
def test_a_json_index_checkpoint_resumes_on_one_rank_with_elastic(kind, data):
    ld = loader(CONFIGS[kind](data, elastic=True), 0, 1)
    ld.load_sidecar(os.path.join(LEGACY_V3, kind))
    assert batch_ids(iter(ld), 6) == EXPECTED[kind]["elastic_one_rank"]


@kinds
def test_a_sidecar_file_listing_every_file_continues_the_bare_stream(kind, data):
    stream = open_stream(CONFIGS[kind](data), rank=0, world_size=1)
    stream.load_sidecar(os.path.join(LEGACY_V3, f"{kind}.safetensors"))
    assert sample_ids(stream, 10) == EXPECTED[f"{kind}_file"]
