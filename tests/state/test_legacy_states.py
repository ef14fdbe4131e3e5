"""Sidecars written by earlier format versions still load and continue exactly as that version continued
them (tests/data/legacy_v1 and legacy_v2: written by format versions 1 and 2; legacy_v3: format version 3 as
written before the compact fingerprint, a ``fingerprint.json`` listing every file and JSON indexes; see
tests/_support/legacy_states.py)."""

import json
import os

import pytest
from legacy_states import (
    LEGACY_V1,
    LEGACY_V2,
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

DIRS = {1: LEGACY_V1, 2: LEGACY_V2, 3: LEGACY_V3}
EXPECTED = {}
for _version, _dir in DIRS.items():
    with open(os.path.join(_dir, "expected.json")) as f:
        EXPECTED[_version] = json.load(f)
CONFIGS = {"stream": stream_config, "mixture": mixture_config}
versions = pytest.mark.parametrize("version", sorted(DIRS))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("legacy")))


def test_the_version_3_checkpoints_are_the_json_forms():
    state = os.path.join(LEGACY_V3, "stream", "stream_state")
    assert isinstance(json.load(open(os.path.join(state, "fingerprint.json")))["dataset"]["files"], list)
    assert os.path.isfile(os.path.join(state, "index.json"))
    assert os.path.isfile(os.path.join(LEGACY_V3, "mixture", "stream_state", "index-a.json"))


@versions
@pytest.mark.parametrize("kind", ["stream", "mixture"])
def test_an_old_version_checkpoint_continues_every_rank_as_that_version_did(version, kind, data):
    for rank in range(SAVED_WORLD):
        ld = loader(CONFIGS[kind](data), rank, SAVED_WORLD)
        ld.load_sidecar(os.path.join(DIRS[version], kind))
        assert batch_ids(iter(ld), 6) == EXPECTED[version][kind][f"rank{rank}"]


@versions
@pytest.mark.parametrize("kind", ["stream", "mixture"])
def test_an_old_version_checkpoint_resumes_on_one_rank_with_elastic(version, kind, data):
    ld = loader(CONFIGS[kind](data, elastic=True), 0, 1)
    ld.load_sidecar(os.path.join(DIRS[version], kind))
    assert batch_ids(iter(ld), 6) == EXPECTED[version][kind]["elastic_one_rank"]


@versions
@pytest.mark.parametrize("kind", ["stream", "mixture"])
def test_an_old_version_sidecar_file_continues_the_bare_stream(version, kind, data):
    stream = open_stream(CONFIGS[kind](data), rank=0, world_size=1)
    stream.load_sidecar(os.path.join(DIRS[version], f"{kind}.safetensors"))
    assert sample_ids(stream, 10) == EXPECTED[version][f"{kind}_file"]


@versions
@pytest.mark.parametrize("kind", ["stream", "mixture"])
def test_an_old_version_checkpoint_saved_again_continues_the_same(version, kind, data, tmp_path):
    """Loaded, written in the current format, loaded again: the same continuation."""
    ld = loader(CONFIGS[kind](data), 1, SAVED_WORLD)
    ld.load_sidecar(os.path.join(DIRS[version], kind))
    ld.save_sidecar(str(tmp_path / "rank1.safetensors"))
    again = loader(CONFIGS[kind](data), 1, SAVED_WORLD)
    again.load_sidecar(str(tmp_path / "rank1.safetensors"))
    assert batch_ids(iter(again), 6) == EXPECTED[version][kind]["rank1"]


@versions
@pytest.mark.parametrize("kind", ["stream", "mixture"])
def test_inspect_reads_an_old_version_checkpoint(version, kind, capsys):
    """7 batches of 3 examples of 3 samples each were consumed per rank before the save."""
    from resumable_stream.app.cli import main

    assert main(["inspect", os.path.join(DIRS[version], kind)]) == 0
    out = json.loads(capsys.readouterr().out)
    per_rank = EXPECTED[version]["saved_after_batches"] * 3 * 3
    for rank in range(SAVED_WORLD):
        summary = out["ranks"][f"rank-{rank:05d}.safetensors"]
        assert summary["format_version"] == version
        assert sum(p["consumed_samples"] for p in summary["partitions"].values()) == per_rank
        if kind == "mixture":
            assert sum(s["consumed_samples"] for s in summary["sources"].values()) == per_rank
