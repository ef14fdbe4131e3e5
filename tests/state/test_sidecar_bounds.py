"""State files are parsed defensively: every number read from a manifest, a sidecar or a dataset index is
bounded before it sizes anything, an unknown format version and deeply nested or oversized JSON are named
errors, and `inspect` checks a checkpoint's saved index as a resume does. Each case exits 2 in seconds and
bounded memory (the huge ones run in a forked child with a capped address space)."""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import resealed, run_cli_forked, run_forked, take_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_stream import ConfigError, ResumableStream, SidecarError
from resumable_stream.app.cli import main
from resumable_stream.errors import SourceError
from resumable_stream.io import safe_files as safe_io
from resumable_stream.sources import index as index_mod
from resumable_stream.sources.index_table import FileTable
from resumable_stream.state import checkpoint as ckpt
from resumable_stream.state import sidecar as sc

DEEP = 100_000     # levels of nesting of the deep JSON documents


@pytest.fixture(scope="module")
def saved_checkpoint(cfg, source, tmp_path_factory):
    """A checkpoint (stream_state: rank file, index.bin, manifest.json) after 70 samples, and a yaml."""
    root = tmp_path_factory.mktemp("bounds")
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 70)
    s.save_sidecar(str(root / "ck" / "stream_state"))
    yaml = root / "cfg.yaml"
    yaml.write_text(f"data:\n  dataset_name_or_path: parquet\n  data_files: {cfg.data_files}\n"
                    "  shuffle: true\n  buffer_size: 64\n")
    return root / "ck", str(yaml)


@pytest.fixture
def ck(saved_checkpoint, tmp_path):
    """A copy of the checkpoint to damage: (checkpoint dir, its stream_state dir, yaml)."""
    src, yaml = saved_checkpoint
    shutil.copytree(src, tmp_path / "ck")
    return tmp_path / "ck", tmp_path / "ck" / "stream_state", yaml


def _argv(command, ck):
    root, _, yaml = ck
    return ["inspect", str(root)] if command == "inspect" else ["peek", yaml, "--num", "1", "--resume-from", str(root)]


def _edit_manifest(state_dir, change):
    path = state_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _replace_index(state_dir, data: bytes, name: str = "index.json"):
    """The saved index replaced by ``data`` in file ``name`` (index.json: the JSON form older checkpoints have),
    the manifest's entry updated to match (only the index checks refuse it)."""
    (state_dir / "index.bin").unlink()
    (state_dir / name).write_bytes(data)
    _edit_manifest(state_dir, lambda m: m["index"].update(file=name, bytes=len(data), blake2b=ckpt._digest(data)))


def _packed(state_dir) -> bytes:
    return (state_dir / "index.bin").read_bytes()


def _deep(levels=DEEP) -> str:
    return "[" * levels + "]" * levels


# ------------------------------------------------------------------ the manifest
@pytest.mark.parametrize("command", ["peek", "inspect"])
def test_a_manifest_with_a_huge_world_size_is_refused_in_seconds_and_bounded_memory(ck, command):
    _, state_dir, _ = ck
    _edit_manifest(state_dir, lambda m: m.update(world_size=1_000_000_000))
    rc, err, seconds = run_cli_forked(_argv(command, ck), memory_mb=512, timeout_s=60)
    assert rc == 2, (rc, err)
    assert str(state_dir / "manifest.json") in err and "world_size: got 1000000000" in err, err
    assert "allowed: an integer from 1 to 100000" in err and "unexpected" not in err, err
    assert seconds < 5, seconds


@pytest.mark.parametrize("version", [99, "2", "1", True, 1.0, None], ids=repr)
@pytest.mark.parametrize("command", ["peek", "inspect"])
def test_a_manifest_of_another_format_version_is_refused_naming_what_is_read(ck, capsys, command, version):
    _, state_dir, _ = ck
    _edit_manifest(state_dir, (lambda m: m.pop("format_version")) if version is None
                   else (lambda m: m.update(format_version=version)))
    assert main(_argv(command, ck)) == 2
    err = capsys.readouterr().err
    assert str(state_dir / "manifest.json") in err and f"format version {version!r}" in err, err
    assert "this release reads version 1" in err, err
    assert ("a newer resumable-stream wrote it" in err) == (version in (99, "2")), err


@pytest.mark.parametrize("command", ["peek", "inspect"])
def test_a_deeply_nested_manifest_is_a_sidecar_error_naming_the_file(ck, capsys, command):
    _, state_dir, _ = ck
    (state_dir / "manifest.json").write_text(_deep())
    assert main(_argv(command, ck)) == 2
    err = capsys.readouterr().err
    assert str(state_dir / "manifest.json") in err and f"nested {DEEP} levels deep" in err, err
    assert "allowed: at most 64" in err and "unexpected" not in err, err


@pytest.mark.parametrize(("change", "field", "allowed"), [
    (lambda m: m.update(world_size=100_001), "world_size", "an integer from 1 to 100000"),
    (lambda m: m.update(generation=10**12), "generation", "an integer from 0 to 999999999"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(bytes=2**70), "files['rank-00000.safetensors']",
     f"bytes (an integer from 0 to {1 << 30})"),
    (lambda m: m["index"].update(bytes=2**40), "index", f"bytes (an integer from 0 to {1 << 30})"),
], ids=["world_size", "generation", "file-bytes", "index-bytes"])
def test_numbers_in_a_manifest_are_bounded(ck, change, field, allowed):
    _, state_dir, _ = ck
    _edit_manifest(state_dir, change)
    with pytest.raises(SidecarError) as e:
        ckpt.read_manifest(str(state_dir))
    message = str(e.value)
    assert str(state_dir / "manifest.json") in message and f"field {field}" in message and allowed in message


# ------------------------------------------------------------------ the saved index, read by inspect as by a resume
def _span_outside_its_file(d):
    """The packed index with its first row group's end byte past its file's size (the digest updated)."""
    from resumable_stream.sources.index_table import pack_index

    index = index_mod.decode_index(_packed(d), "x")
    arrays = index["files"].arrays()
    arrays["end"] = arrays["end"].copy()
    arrays["end"][0] = arrays["size"][0] + 1
    _replace_index(d, pack_index({**index, "files": FileTable(arrays)}), "index.bin")


_INDEX_CASES = {
    "corrupt": (lambda d: (d / "index.bin").write_bytes(b"x" * 50), "index.bin", "does not match its manifest entry"),
    "oversized": (lambda d: os.truncate(d / "index.bin", 2 << 30), "index.bin", f"over the limit of {1 << 30}"),
    "malformed": (lambda d: _replace_index(d, json.dumps({"format": index_mod.INDEX_FORMAT, "version": 99}).encode()),
                  "index.json", "version 99; this library reads version 1"),
    "nested": (lambda d: _replace_index(d, _deep().encode()), "index.json", f"nested {DEEP} levels deep"),
    "missing": (lambda d: (d / "index.bin").unlink(), "index.bin", "not found"),
    "packed-truncated": (lambda d: _replace_index(d, _packed(d)[:-9], "index.bin"), "index.bin",
                         "runs past the end of the message"),
    "packed-span": (_span_outside_its_file, "index.bin", "row group 0: span"),
}


@pytest.mark.parametrize("case", sorted(_INDEX_CASES))
@pytest.mark.parametrize("command", ["peek", "inspect"])
def test_inspect_checks_the_saved_index_as_a_resume_does(ck, capsys, command, case):
    _, state_dir, _ = ck
    damage, name, needle = _INDEX_CASES[case]
    damage(state_dir)
    assert main(_argv(command, ck)) == 2
    err = capsys.readouterr().err
    assert str(state_dir / name) in err and needle in err and "unexpected" not in err, err


def test_inspect_shows_the_saved_index(ck, capsys):
    root, state_dir, _ = ck
    assert main(["inspect", str(root)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["index"] == {"file": "index.bin", "files": 4, "row_groups": 20}
    assert shown["ranks"]["rank-00000.safetensors"]["files"]["count"] == 4      # listed from the saved index
    assert shown["ranks"]["rank-00000.safetensors"]["files"]["identity"] == {"parquet footer digest": 4}
    _replace_index(state_dir, index_mod.encode_index(index_mod.decode_index(_packed(state_dir), "x")))
    assert main(["inspect", str(root)]) == 0        # an older checkpoint's JSON index
    assert json.loads(capsys.readouterr().out)["index"] == {"file": "index.json", "files": 4, "row_groups": 20}


# ------------------------------------------------------------------ sidecars
def _rank_file(ck):
    return ck[1] / "rank-00000.safetensors"


def _set_meta(key, value):
    def edit(tensors, meta):
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    return edit


def _topology(**changes):
    return _set_meta("topology", {"rank": 0, "world_size": 1, "num_workers": 0, "num_partitions": 1, **changes})


def _wider_slots(tensors, meta):
    slots = tensors["slots"]
    tensors["slots"] = np.concatenate([slots, np.full((len(slots), 65 - slots.shape[1], 2), -1, np.int64)], axis=1)


@pytest.mark.parametrize(("edit", "field", "allowed"), [
    (_topology(world_size=10**9, num_partitions=10**9), "topology.world_size", "an integer from 1 to 100000"),
    (_topology(num_partitions=10**12), "topology.num_partitions", "an integer from 1 to 1000000"),
    (_topology(num_workers=10**9), "topology.num_workers", "an integer from 0 to 1 (ranks x workers must not exceed num_partitions 1)"),
    (_topology(num_partitions=4), "tensor partition_ids", "the 4 partitions of rank 0 of 1"),
    (_topology(world_size=2, num_partitions=1), "topology.num_partitions", "an integer from 2 to 1000000"),
    (_wider_slots, "tensor slots", "at most 64 open shards"),
    (_set_meta("loader", {"turns": {"0": 0}, "lane_turns": {"0": [0, 0]}}), "loader.lane_turns[0]",
     "a list of at most 1 integers in [0, 1)"),
    (_set_meta("loader", {"turns": {"0": 0}, "lane_turns": {"0": [10**12]}}), "loader.lane_turns[0]",
     "a list of at most 1 integers in [0, 1)"),
    (_set_meta("loader", {"turns": {"0": 10**12}, "lane_turns": {}}), "loader.turns[0]", "an integer in [0, 1)"),
    (_set_meta("loader", {"turns": {"7": 0}, "lane_turns": {}}), "loader", "each by rank (1 at most)"),
    (_set_meta("loader", {"turns": {str(r): 0 for r in range(10**5)}, "lane_turns": {}}), "loader",
     "each by rank (1 at most)"),
    (_set_meta("turn", str(10**12)), "turn", "an integer in [0, 1)"),
    (_set_meta("transform", {"9": {"meta": {}, "tensors": []}}), "transform", "of the partitions this file holds"),
], ids=["world_size", "num_partitions", "num_workers", "partition-count", "fewer-partitions-than-ranks", "slots",
        "lane_turns-length", "lane_turns-value", "turns-value", "turns-of-another-rank", "turns-of-many-ranks", "turn",
        "transform-of-another-partition"])
def test_numbers_in_a_sidecar_are_bounded(ck, edit, field, allowed):
    file = str(_rank_file(ck))
    with pytest.raises(SidecarError) as e:
        sc.decode_state(resealed(open(file, "rb").read(), edit), file, fingerprint=ckpt.fingerprint_beside(file))
    message = str(e.value)
    assert file in message and f"field {field}" in message and allowed in message, message


def test_a_sidecar_with_a_huge_topology_is_refused_in_seconds_and_bounded_memory(ck, tmp_path):
    """Before, a forged num_partitions sized this rank's plan: the load built a list of 10**12 partitions."""
    _, _, yaml = ck
    file = tmp_path / "forged.safetensors"
    file.write_bytes(resealed(_rank_file(ck).read_bytes(), _topology(num_partitions=10**12)))
    rc, err, seconds = run_cli_forked(["peek", yaml, "--num", "1", "--resume-from", str(file)])
    assert rc == 2 and str(file) in err and "topology.num_partitions" in err, (rc, err)
    assert seconds < 5, seconds


def test_deeply_nested_json_in_a_sidecar_is_a_sidecar_error_naming_the_file_and_field(ck):
    file = str(_rank_file(ck))
    data = open(file, "rb").read()
    def own_deep_fingerprint(tensors, meta):    # a file with a fingerprint of its own (a bare sidecar file)
        meta.pop("fingerprint_digest")
        meta["fingerprint"] = _deep()

    with pytest.raises(SidecarError) as e:
        sc.decode_state(resealed(data, own_deep_fingerprint), file)
    assert file in str(e.value) and "field fingerprint" in str(e.value) and f"nested {DEEP} levels" in str(e.value)
    header = b'{"__metadata__":{"format":"resumable-stream"},"x":' + _deep().encode() + b"}"
    with pytest.raises(SidecarError) as e:
        sc.decode_state(len(header).to_bytes(8, "little") + header, file)
    assert file in str(e.value) and "header" in str(e.value) and f"nested {DEEP + 1} levels" in str(e.value)


def test_an_oversized_sidecar_header_is_refused_before_it_is_parsed(ck):
    file = str(_rank_file(ck))
    header = b'{"__metadata__":{"format":"resumable-stream"}}'.ljust(100_000_001)
    with pytest.raises(SidecarError) as e:
        sc.decode_state(len(header).to_bytes(8, "little") + header, file)
    assert file in str(e.value) and "header of 100000001 bytes" in str(e.value) and "100000000" in str(e.value)


# ------------------------------------------------------------------ dataset index files
def _index(ck) -> dict:
    """The saved index in its JSON form."""
    return json.loads(index_mod.encode_index(index_mod.decode_index(_packed(ck[1]), "x")))


def _file_entry(**changes):
    def edit(index):
        index["files"][0].update(changes)
    return edit


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda i: i.update(version=True), "version True; this library reads version 1"),
    (lambda i: i.update(version=1.0), "version 1.0; this library reads version 1"),
    (_file_entry(footer_bytes=10**12), "files[0] is malformed"),
    (_file_entry(footer_bytes=True), "files[0] is malformed"),
    (_file_entry(row_groups=[[2**64, 0, 10]]), "files[0] is malformed"),
    (lambda i: i.update(features={"x": json.loads(_deep(64))}), "nested 66 levels deep; allowed: at most 64"),
], ids=["version-bool", "version-float", "footer_bytes", "footer_bytes-bool", "rows", "nested"])
def test_a_malformed_index_is_a_source_error_naming_it(ck, edit, needle):
    index = _index(ck)
    edit(index)
    with pytest.raises(SourceError) as e:
        index_mod.decode_index(json.dumps(index).encode(), "'x.json'")
    assert "'x.json'" in str(e.value) and needle in str(e.value), str(e.value)


def _load_index_error(path):
    try:
        index_mod.load_index(path)
    except SourceError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("what", ["oversized", "fifo", "nested"])
def test_an_index_path_is_read_in_bounded_time_and_memory(tmp_path, what):
    """``data.index_path`` names a file: a 2 GiB one or a FIFO is refused unread, a deep one unparsed."""
    path = tmp_path / "index.json"
    if what == "oversized":
        path.write_bytes(b"")
        os.truncate(path, 2 << 30)
    elif what == "fifo":
        os.mkfifo(path)     # nobody ever writes to it: opening it for reading would block forever
    else:
        path.write_text(_deep())
    message, _, seconds = run_forked(lambda: _load_index_error(str(path)), memory_mb=512, timeout_s=20)
    needle = {"oversized": f"over the limit of {1 << 30}", "fifo": "not a regular file (a FIFO)",
              "nested": f"nested {DEEP} levels deep"}[what]
    assert str(path) in message and needle in message, message
    assert seconds < 5, seconds


# ------------------------------------------------------------------ what a run writes stays readable
def test_a_run_larger_than_a_state_can_describe_is_refused_when_it_starts(cfg, source):
    with pytest.raises(ConfigError, match="world_size: got 100001; allowed: an integer from 1 to 100000"):
        ResumableStream(cfg, rank=0, world_size=100_001, source=source)
    with pytest.raises(ConfigError, match="1100000 virtual partitions .* at most 1000000"):
        ResumableStream(cfg, rank=0, world_size=100_000, num_workers=11, source=source)


# ------------------------------------------------------------------ the bounded JSON parser
def test_nesting_is_measured_outside_strings_only():
    depth = safe_io.json_depth
    assert depth(b"") == 0 and depth(b"1") == 0 and depth(b"[]") == 1 and depth(b'{"a": [[1], {"b": []}]}') == 4
    assert depth(b'["[[[{{{", "\\"[[[", "\\\\", [["]]]"]]]') == 3      # brackets and escaped quotes in strings
    assert depth(b'"\\\\\\"[[[["') == 0 and depth(b'["unterminated [[[') == 1
    for size in (1, 3, 7):     # a document cut anywhere between the chunks of the scan
        assert safe_io.json_depth(b'[["\\"]]"], [[]]]', chunk=size) == 3


_TEXT = st.text(alphabet='ab"\\[]{}é\n', max_size=6)
_JSON = st.recursive(st.none() | st.integers() | _TEXT, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=20)


def _nesting(value) -> int:
    if isinstance(value, (dict, list)):
        return 1 + max(map(_nesting, value.values() if isinstance(value, dict) else value), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(value=_JSON, chunk=st.sampled_from([1, 2, 5, 1 << 22]), ascii_only=st.booleans())
def test_the_nesting_of_any_json_document_is_measured_exactly(value, chunk, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert safe_io.json_depth(text.encode(), chunk=chunk) == _nesting(value)


def test_the_bounded_parser_reads_what_json_reads_up_to_the_depth_limit():
    doc = "[" * 64 + '"x \\" ]]"' + "]" * 64
    assert safe_io.parse_json(doc) == json.loads(doc) and safe_io.parse_json(doc.encode()) == json.loads(doc)
    for bad, needle in (("[" * 65 + "]" * 65, "nested 65 levels deep; allowed: at most 64"),
                        ('{"a": }', "not JSON"), (b"\xff[]", "not UTF-8")):
        with pytest.raises(safe_io.JSONRefused, match=needle):
            safe_io.parse_json(bad)
    assert issubclass(safe_io.JSONRefused, ValueError)
