"""A mixture's sidecar has its own schema (format version 2, kind "mixture"): the mixture's positions and each
source's cursors under their own names, one row per virtual partition, every field checked on load."""

import json

import numpy as np
import pytest
from helpers import resealed
from safetensors import safe_open
from small_mixture import copy_data, mixture_config, stream_config

from resumable_stream import MixtureStream, ResumableStream, SidecarError, StreamMismatchError
from resumable_stream.state.partition_state import Cursor


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("mixture_state")))   # a: ids 0..119, b: ids 1000..1049


def _read(stream, n):
    it = iter(stream)
    return [int(next(it)["id"]) for _ in range(n)]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A 2-source mixture of 4 partitions on one rank, saved after 37 samples; and the next 20."""
    m = MixtureStream(mixture_config(data), rank=0, world_size=1)
    head = _read(m, 37)
    path = str(tmp_path_factory.mktemp("saved") / "mixture.safetensors")
    m.save_sidecar(path)
    return path, head, _read(m, 20)


def test_the_sidecar_names_the_mixture_and_its_sources_state_separately(saved):
    path, head, _ = saved
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["format_version"], meta["kind"]) == ("1", "mixture")
    per_source = {"cursors", "slots", "chains"}
    assert set(tensors) == {"partition_ids", "mixture/positions", "mixture/source_epochs", "mixture/ended"} | {
        f"sources/{i}/{t}" for i in (0, 1) for t in per_source}
    assert tensors["partition_ids"].tolist() == [0, 1, 2, 3]     # one row per virtual partition, no entry ids
    positions = tensors["mixture/positions"]
    assert positions.shape == (4, 3) and positions[:, 2].sum() == len(head) == 37   # consumed per partition
    consumed = {i: tensors[f"sources/{i}/cursors"][:, Cursor.FIELDS.index("offset")].sum()
                + tensors[f"sources/{i}/cursors"][:, Cursor.FIELDS.index("consumed_before")].sum() for i in (0, 1)}
    assert consumed == {0: sum(x < 1000 for x in head), 1: sum(x >= 1000 for x in head)}   # what came from each
    assert tensors["mixture/source_epochs"].shape == tensors["mixture/ended"].shape == (4, 2)
    for i in (0, 1):
        digests = json.loads(meta[f"sources/{i}/digests"])
        assert sorted(digests) == ["0", "1", "2", "3"]
        assert all(len(d["next_sample"]) == 16 for d in digests.values())   # every source cursor is a real one


def test_a_mixture_sidecar_continues_exactly(data, saved):
    path, _, rest = saved
    m = MixtureStream(mixture_config(data), rank=0, world_size=1)
    m.load_sidecar(path)
    assert _read(m, 20) == rest


def test_a_single_stream_and_a_mixture_refuse_each_others_sidecars(data, saved, tmp_path):
    path, _, _ = saved
    with pytest.raises(StreamMismatchError, match="a mixture's .*this stream is a single dataset"):
        ResumableStream(stream_config(data), rank=0, world_size=1).load_sidecar(path)
    single = ResumableStream(stream_config(data), rank=0, world_size=1)
    _read(single, 5)
    single.save_sidecar(str(tmp_path / "single.safetensors"))
    with pytest.raises(StreamMismatchError, match="a single dataset's; this stream is a mixture of a, b"):
        MixtureStream(mixture_config(data), rank=0, world_size=1).load_sidecar(str(tmp_path / "single.safetensors"))


def _set(name, row, value):
    def edit(tensors, meta):
        tensors[name][row] = value
    return edit


def _replace(name, make):
    def edit(tensors, meta):
        tensors[name] = make(tensors[name])
    return edit


def _drop(name):
    def edit(tensors, meta):
        del tensors[name]
    return edit


def _meta(key, value):
    def edit(tensors, meta):
        meta[key] = value
    return edit


@pytest.mark.parametrize(("edit", "field"), [
    (_set("mixture/ended", 0, [2, 0]), "mixture/ended[0]"),
    (_set("mixture/positions", 1, [0, -1, 3]), "mixture/positions[1]"),
    (_set("mixture/positions", 2, [0, 9, 3]), "mixture/positions[2]"),          # more draws than samples
    (_set("mixture/source_epochs", 3, [-1, 0]), "mixture/source_epochs[3]"),
    (_set("mixture/source_epochs", 0, [2**62, 0]), "mixture/source_epochs[0]"),   # no jump to any epoch
    (_set("mixture/positions", 0, [2**40, 0, 3]), "mixture/positions[0]"),
    (_replace("mixture/source_epochs", lambda t: t[:, :1].copy()), "tensor mixture/source_epochs"),
    (_replace("mixture/ended", lambda t: t.astype(np.int64)), "tensor mixture/ended"),
    (_drop("sources/1/cursors"), "sources/1/cursors"),
    (_replace("sources/0/chains", lambda t: t[:3].copy()), "tensor sources/0/chains"),
    (_meta("kind", "mixtures"), "kind"),
    (_meta("sources/1/digests", "{}"), "sources/1/digests[0]"),
    (_meta("fingerprint", json.dumps({"mixture": {"labels": "a"}})), "fingerprint.mixture.labels"),
])
def test_a_malformed_mixture_state_is_a_sidecar_error_naming_the_field(data, saved, tmp_path, edit, field):
    path, _, _ = saved
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(resealed(open(path, "rb").read(), edit))
    with pytest.raises(SidecarError) as e:
        MixtureStream(mixture_config(data), rank=0, world_size=1).load_sidecar(str(bad))
    assert str(bad) in str(e.value) and field in str(e.value)
