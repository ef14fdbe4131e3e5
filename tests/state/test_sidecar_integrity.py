"""Sidecars verify themselves: every bit flip is refused, malformed states are named errors, manifests are
confined to their directory, files follow the umask, and `inspect` reports a corrupt checkpoint."""

import json
import os
import random

import numpy as np
import pytest
from helpers import resealed, take_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import SUPPORT_DIR
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from resumable_stream import ResumableStream, SidecarError
from resumable_stream.app.cli import main
from resumable_stream.state import checkpoint as ckpt
from resumable_stream.state import sidecar as sc
from resumable_stream.state.partition_state import Cursor


@pytest.fixture(scope="module")
def saved(cfg, source, tmp_path_factory):
    """A sidecar after 150 samples, the next 20 ids, and a yaml for the CLI."""
    d = tmp_path_factory.mktemp("saved")
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 150)
    path = s.save_sidecar(str(d / "x.safetensors"))
    yaml = d / "cfg.yaml"
    yaml.write_text(f"data:\n  dataset_name_or_path: parquet\n  data_files: {cfg.data_files}\n"
                    "  shuffle: true\n  buffer_size: 64\n")
    return path, take_ids(s, 20), str(yaml)


def _stream(cfg, source):
    return ResumableStream(cfg, rank=0, world_size=1, source=source)


def _header_span(data: bytes) -> range:
    return range(8, 8 + int.from_bytes(data[:8], "little"))


# ------------------------------------------------------------------ self-digest
def test_every_single_bit_flip_of_a_sidecar_is_refused(saved):
    path, _, _ = saved
    data = bytearray(open(path, "rb").read())
    header = _header_span(data)
    flips = 0
    for byte in range(len(data)):      # header (metadata) and tensor region alike
        for bit in range(8):
            data[byte] ^= 1 << bit
            with pytest.raises(SidecarError) as e:
                sc.decode_state(bytes(data), path)
            data[byte] ^= 1 << bit
            assert path in str(e.value)
            flips += 1
    assert flips == 8 * len(data) and len(data) > header.stop   # both regions were covered


def test_a_flipped_bit_is_refused_on_every_way_a_file_is_loaded(cfg, source, saved, tmp_path, capsys):
    path, expected, yaml = saved
    data = open(path, "rb").read()
    rng = random.Random(12)
    tensor_bytes = range(_header_span(data).stop, len(data))
    for i, byte in enumerate([rng.choice(tensor_bytes) for _ in range(4)] + [rng.choice(_header_span(data))]):
        bad = bytearray(data)
        bad[byte] ^= 1 << rng.randrange(8)
        file = str(tmp_path / f"flip{i}.safetensors")
        open(file, "wb").write(bytes(bad))
        # a flip in the header may hit the format field, which is read before the self-digest: refused as
        # another format (which bytes the random pick hits depends on the header's length, i.e. on tmp paths)
        with pytest.raises(SidecarError, match="corrupt|format"):
            _stream(cfg, source).load_sidecar(file)
        with pytest.raises(SidecarError, match="corrupt|format"):
            ResumableStream(cfg.replace(resume_state_path=file), rank=0, world_size=1, source=source)
        assert main(["peek", yaml, "--num", "3", "--resume-from", file]) == 2
        assert main(["inspect", file]) == 2
        err = capsys.readouterr().err
        assert err.count(file) == 2 and "unexpected" not in err
    resumed = _stream(cfg, source)
    resumed.load_sidecar(path)      # the intact file resumes exactly
    assert take_ids(resumed, 20) == expected


def _unsealed(data: bytes) -> bytes:
    """The same state without its self-digest."""
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n])["__metadata__"]
    del meta[sc.SEAL_KEY]
    return st_save(st_load(data), metadata=meta)


def test_a_sidecar_without_self_digest_is_refused_even_under_a_manifest(cfg, source, saved, tmp_path):
    path, _, _ = saved
    state_dir = tmp_path / "stream_state"
    state_dir.mkdir()
    old = state_dir / "rank-00000.safetensors"
    old.write_bytes(_unsealed(open(path, "rb").read()))
    with pytest.raises(SidecarError, match=f"corrupt \\(field {sc.SEAL_KEY}: 'None' is not its digest\\)"):
        _stream(cfg, source).load_sidecar(str(old))
    ckpt.write_manifest(str(state_dir), 1)   # a manifest's digest covers the file: still not one of ours
    with pytest.raises(SidecarError, match=sc.SEAL_KEY):
        _stream(cfg, source).load_sidecar(str(tmp_path))


# ------------------------------------------------------------------ malformed but well-sealed states
def _set_meta(key, value):
    def edit(tensors, meta):
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    return edit


def _set_cursor(field, value):
    def edit(tensors, meta):
        tensors["cursors"][0, Cursor.FIELDS.index(field)] = value
    return edit


def _drop_meta(key):
    def edit(tensors, meta):
        del meta[key]
    return edit


def _set_tensor(name, make):
    def edit(tensors, meta):
        tensors[name] = make(tensors[name])
    return edit


def _digests(change):
    def edit(tensors, meta):
        d = json.loads(meta["digests"])
        change(d["0"])
        meta["digests"] = json.dumps(d)
    return edit


def _slots(value):
    def edit(tensors, meta):
        tensors["slots"][0, 0] = value
    return edit


@pytest.mark.parametrize(("edit", "field"), [
    (_drop_meta("digests"), "digests"),
    (_drop_meta("topology"), "topology"),
    (_set_meta("digests", []), "digests"),
    (_set_meta("digests", {"0": "abc"}), "digests[0]"),
    (_digests(lambda d: d.pop("next_sample")), "digests[0].next_sample"),
    (_digests(lambda d: d.update(consumed_samples="150")), "digests[0].consumed_samples"),
    (_digests(lambda d: d.update(consumed_samples=-1)), "digests[0].consumed_samples"),
    (_set_meta("topology", {"rank": 0, "world_size": "1", "num_workers": 0, "num_partitions": 1}),
     "topology.world_size"),
    (_set_meta("topology", {"rank": 5, "world_size": 1, "num_workers": 0, "num_partitions": 1}), "topology.rank"),
    (_set_meta("turn", "-3"), "turn"),
    (_set_meta("turn", "x"), "turn"),
    (_set_meta("progress", {"0": {"epoch_start": "0"}}), "progress[0].epoch_start"),
    (_set_meta("transform", {"0": {"meta": {}, "tensors": "ids"}}), "transform[0]"),
    (_set_meta("loader", {"turns": {"0": 0}, "lane_turns": {"0": [0, -1]}}), "loader.lane_turns[0]"),
    (_set_meta("fingerprint", ["x"]), "fingerprint"),
    (_set_meta("cursor_fields", ["epoch"]), "cursor_fields"),
    (_set_cursor("offset", -1), "cursors[0].offset"),
    (_set_tensor("cursors", lambda t: t.astype(np.float64)), "tensor cursors"),
    (_set_tensor("chains", lambda t: t[:, :8].copy()), "tensor chains"),
    (_set_tensor("slots", lambda t: t[:, :, :1].copy()), "tensor slots"),
    (_set_tensor("partition_ids", lambda t: t + 7), "tensor partition_ids"),
    (_drop_meta("cursor_fields"), "cursor_fields"),
    (_slots([3, -2]), "slots[0]"),
])
def test_a_malformed_state_is_a_sidecar_error_naming_the_file_and_field(cfg, source, saved, tmp_path, capsys,
                                                                        edit, field):
    path, _, yaml = saved
    file = str(tmp_path / "bad.safetensors")
    open(file, "wb").write(resealed(open(path, "rb").read(), edit))
    with pytest.raises(SidecarError) as e:
        _stream(cfg, source).load_sidecar(file)
    assert file in str(e.value) and field in str(e.value)
    assert main(["peek", yaml, "--num", "2", "--resume-from", file]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [
    ("next_shard", 10**12), ("epoch", 2**40), ("block_slot", 50), ("block_taken", 10**9), ("offset", 10**6),
    ("slots", [0, 10**9]), ("slots", [10**6, 0]),
])
def test_cursors_outside_the_data_are_refused_when_loaded(cfg, source, saved, tmp_path, field, value):
    path, _, _ = saved
    edit = _slots(value) if field == "slots" else _set_cursor(field, value)
    file = str(tmp_path / "far.safetensors")
    data = resealed(open(path, "rb").read(), edit)
    if field == "offset":      # keep consumed_samples consistent: only the bound on the window is wrong
        data = resealed(data, _digests(lambda d: d.update(consumed_samples=d["consumed_samples"] - 22 + 10**6)))
    open(file, "wb").write(data)
    with pytest.raises(SidecarError) as e:
        _stream(cfg, source).load_sidecar(file)
    assert file in str(e.value) and f"partitions[0].{field}" in str(e.value)


# ------------------------------------------------------------------ manifests and inspect
def _checkpoint(cfg, source, root, n=70):
    s = _stream(cfg, source)
    take_ids(s, n)
    s.save_sidecar(str(root / "stream_state"))
    return root / "stream_state"


def _edit_manifest(state_dir, change):
    path = state_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: m["files"].update({"rank-00000.safetensors": "abc"}), "files['rank-00000.safetensors']"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(bytes="12"), "files['rank-00000.safetensors']"),
    (lambda m: m.update(world_size="1"), "world_size"),
    (lambda m: m.update(files=[]), "files"),
    (lambda m: m.update(generation=-1), "generation"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(file="../outside/rank-00000.safetensors"), ".file"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(file="/etc/passwd"), ".file"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(file="rank-00001.safetensors"), ".file"),
])
def test_a_malformed_or_escaping_manifest_is_refused_naming_the_field(cfg, source, tmp_path, capsys, change, field):
    state_dir = _checkpoint(cfg, source, tmp_path / "ck")
    _edit_manifest(state_dir, change)
    with pytest.raises(SidecarError) as e:
        _stream(cfg, source).load_sidecar(str(tmp_path / "ck"))
    assert "manifest.json" in str(e.value) and field in str(e.value)
    assert main(["inspect", str(tmp_path / "ck")]) == 2
    assert field in capsys.readouterr().err


def test_inspect_reads_only_the_files_of_its_directory_and_checks_their_digests(cfg, source, tmp_path, capsys):
    state_dir = _checkpoint(cfg, source, tmp_path / "ck")
    outside = _checkpoint(cfg, source, tmp_path / "other", n=10)   # a valid sidecar elsewhere
    entry = json.loads((state_dir / "manifest.json").read_text())["files"]["rank-00000.safetensors"]
    _edit_manifest(state_dir, lambda m: m["files"]["rank-00000.safetensors"].update(
        file="../../other/stream_state/rank-00000.safetensors"))
    assert main(["inspect", str(tmp_path / "ck")]) == 2
    assert "in the same directory" in capsys.readouterr().err
    _edit_manifest(state_dir, lambda m: m["files"]["rank-00000.safetensors"].update(file="rank-00000.safetensors"))
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    # another valid sidecar copied over the listed one: its own digest holds, the manifest's does not
    (state_dir / "rank-00000.safetensors").write_bytes((outside / "rank-00000.safetensors").read_bytes())
    assert entry["blake2b"] != ckpt._digest((state_dir / "rank-00000.safetensors").read_bytes())
    assert main(["inspect", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "rank-00000.safetensors" in err and "does not match its manifest entry" in err


@pytest.mark.parametrize("what", ["rank_file", "manifest", "bare"])
def test_a_fifo_is_refused_without_blocking(cfg, source, tmp_path, capsys, what):
    state_dir = _checkpoint(cfg, source, tmp_path / "ck")
    target = {"rank_file": state_dir / "rank-00000.safetensors", "manifest": state_dir / "manifest.json",
              "bare": tmp_path / "fifo.safetensors"}[what]
    if target.exists():
        target.unlink()
    os.mkfifo(target)       # nobody ever writes to it: opening it for reading would block forever
    path = str(target if what == "bare" else tmp_path / "ck")
    assert main(["inspect", path]) == 2
    assert "not a regular file (a FIFO)" in capsys.readouterr().err
    with pytest.raises(SidecarError, match="FIFO"):
        _stream(cfg, source).load_sidecar(path) if what != "bare" else ckpt.read_state_file(path)


# ------------------------------------------------------------------ file modes
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_sidecars_and_manifests_follow_the_umask(cfg, source, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        s = _stream(cfg, source)
        take_ids(s, 5)
        s.save_sidecar(str(tmp_path / "st"))
        s.save_sidecar(str(tmp_path / "st"))        # a second generation
        s.save_sidecar(str(tmp_path / "one.safetensors"))
    finally:
        os.umask(old)
    files = [tmp_path / "st" / f for f in os.listdir(tmp_path / "st")] + [tmp_path / "one.safetensors"]
    assert sorted(f.name for f in files) == ["fingerprint.g1.json", "index.g1.bin", "manifest.json",
                                             "one.safetensors", "rank-00000.g1.safetensors"]
    assert {oct(os.stat(f).st_mode & 0o777) for f in files} == {oct(mode)}


# ------------------------------------------------------------------ atomic saves into an existing directory
@pytest.mark.slow
def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_state(cfg, source, tmp_path):
    """A real process saving into one directory over and over is SIGKILLed 40 times at seeded random moments
    (tests/_support/save_killer.py): after every kill the directory loads, as the last complete save or the one being
    written, never older (the previous state is never lost); the final state then resumes exactly."""
    import subprocess
    import sys

    s = _stream(cfg, source)
    states_dir = tmp_path / "states"
    states_dir.mkdir()
    for k in range(400):
        take_ids(s, 1)
        (states_dir / f"{k}.safetensors").write_bytes(sc.encode_state({"stream": s.state_dict()}))
    state_dir = tmp_path / "ck" / "stream_state"
    helper = os.path.join(SUPPORT_DIR, "save_killer.py")
    r = subprocess.run([sys.executable, helper, str(states_dir), str(state_dir), "40", "7"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)["loaded"]
    assert len(loaded) == 40 or loaded[-1] == 399
    assert all(isinstance(k, int) for k in loaded), [k for k in loaded if not isinstance(k, int)]
    assert loaded == sorted(loaded)    # never back to an older state
    assert len(set(loaded)) >= 5      # saves went on between the kills
    reference = _stream(cfg, source)
    expected = take_ids(reference, loaded[-1] + 1 + 30)[-30:]
    resumed = _stream(cfg, source)
    resumed.load_sidecar(str(tmp_path / "ck"))
    assert take_ids(resumed, 30) == expected


# ------------------------------------------------------------------ fuzzing the decoded state
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_well_sealed_state_loads_or_is_a_named_error(cfg, source, saved, data):
    """Random values in the metadata (anywhere inside its JSON) and in the cursor / slot tensors, with a
    valid self-digest: loading either works or raises SidecarError / StreamMismatchError, never another type."""
    from resumable_stream import StreamMismatchError

    path, _, _ = saved
    original = open(path, "rb").read()

    def edit(tensors, meta):
        key = data.draw(st.sampled_from(sorted(k for k in meta if k != sc.SEAL_KEY)))
        try:
            value = json.loads(meta[key])
        except ValueError:
            value = meta[key]
        path_in = data.draw(st.integers(0, 3))
        node = value
        for _ in range(path_in):        # descend a few levels, replace one value there
            if isinstance(node, dict) and node:
                k = data.draw(st.sampled_from(sorted(node)))
                if isinstance(node[k], (dict, list)) and node[k]:
                    node = node[k]
                    continue
                node[k] = data.draw(_JSON)
                break
            if isinstance(node, list) and node:
                i = data.draw(st.integers(0, len(node) - 1))
                if isinstance(node[i], (dict, list)) and node[i]:
                    node = node[i]
                    continue
                node[i] = data.draw(_JSON)
                break
        else:
            value = data.draw(_JSON) if path_in == 0 else value
        meta[key] = json.dumps(value)
        name = data.draw(st.sampled_from(["cursors", "slots", "partition_ids"]))
        flat = tensors[name].reshape(-1)
        flat[data.draw(st.integers(0, len(flat) - 1))] = data.draw(st.integers(-2**62, 2**62))

    bad = resealed(original, edit)
    try:
        s = _stream(cfg, source)
        s.load_state_dict(sc.decode_state(bad, "fuzzed.safetensors"), where="sidecar 'fuzzed.safetensors'")
        take_ids(s, 3)
    except (SidecarError, StreamMismatchError):
        pass
