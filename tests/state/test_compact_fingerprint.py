"""The dataset fingerprint held compactly (an indexed parquet dataset's files: their count and digest) and the
checkpoint's packed index: O(1) per rank and per state, every changed file still named on a resume, states
that list the files (written before) compared exactly as they were."""

from __future__ import annotations

import gc
import json
import os
import random

import numpy as np
import pytest
from helpers import take_ids

from resumable_stream import ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.sources import fingerprint_files, open_source
from resumable_stream.sources.index import decode_index, encode_index, encode_message, load_index
from resumable_stream.sources.index_table import FileTable
from resumable_stream.state.relocation import _files_diff, compare_files
from resumable_stream.testing import synthetic_parquet_index, write_parquet_dataset

pytestmark = pytest.mark.timeout(120)


def _cfg(root: str, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(root, "*.parquet"), shuffle=True,
                        buffer_size=32, **kw)


@pytest.fixture
def dataset(tmp_path):
    root = str(tmp_path / "data")
    return root, write_parquet_dataset(root, rows=240, files=4, row_group_size=30)


def _touch(path: str) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


# ------------------------------------------------------------------ what a rank holds
def test_the_fingerprint_of_an_indexed_dataset_is_o1_whatever_its_files():
    sizes = {}
    for files in (50, 2_000):
        index = synthetic_parquet_index(files, 2, 10)
        source = open_source(_cfg("/corpus").source_spec, index=index)
        fp = source.fingerprint
        assert set(fp["files"]) == {"count", "digest"} and fp["files"]["count"] == files
        # the digest is that of the identities a fingerprint listed before (as a list, put in columns)
        listed = [{k: v for k, v in e.items() if k not in ("footer_bytes", "row_groups")} for e in index["files"]]
        assert fingerprint_files.digest(listed) == fp["files"]["digest"]
        assert list(fingerprint_files.identities(fp["files"])) == listed
        sizes[files] = len(json.dumps(fp))
    assert sizes[50] < 600 and abs(sizes[2_000] - sizes[50]) < 10        # the count's digits


def test_one_changed_file_changes_the_digest():
    index = synthetic_parquet_index(20, 2, 10)
    base = open_source(_cfg("/corpus").source_spec, index=index).fingerprint["files"]
    for key, value in (("size", 1), ("mtime", 1.0), ("footer", "f" * 32), ("etag", '"x"')):
        changed = json.loads(json.dumps(index))
        entry = changed["files"][7]
        entry[key] = entry.get(key, 0) + value if key in ("size", "mtime") else value
        assert open_source(_cfg("/corpus").source_spec, index=changed).fingerprint["files"] != base, key


# ------------------------------------------------------------------ a resume names the files that differ
@pytest.fixture
def fresh_process(monkeypatch):
    """As in a process that did not save the state: no table of this process stands for its files."""
    monkeypatch.setattr(fingerprint_files, "_known", [])


def test_a_checkpoint_names_a_file_removed_since(dataset, tmp_path, fresh_process):
    """The removed file is only in the saved index: its identity is read from there to name it."""
    root, files = dataset
    s = ResumableStream(_cfg(root))
    take_ids(s, 50)
    s.save_sidecar(str(tmp_path / "ck" / "stream_state"))
    assert (tmp_path / "ck" / "stream_state" / "index.bin").is_file()
    fingerprint_files._known.clear()
    os.unlink(files[2])
    _touch(files[1])
    with pytest.raises(StreamMismatchError) as e:
        ResumableStream(_cfg(root, resume_state_path=str(tmp_path / "ck")))
    named = [what for what, _, _ in e.value.differences]
    assert f"file removed: {files[2]}" in named and f"file modified: {files[1]} (mtime)" in named, named
    assert not any(files[0] in w or files[3] in w for w in named)


def test_moved_data_resumes_from_a_checkpoint_in_another_process(dataset, tmp_path, fresh_process, caplog):
    """The whole dataset copied elsewhere (new mtimes): the saved index gives the saved identities, compared by
    relative path and content; the run continues exactly."""
    root, files = dataset
    ref = take_ids(ResumableStream(_cfg(root)), 120)
    s = ResumableStream(_cfg(root))
    take_ids(s, 50)
    s.save_sidecar(str(tmp_path / "ck" / "stream_state"))
    fingerprint_files._known.clear()
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in files:
        (moved / os.path.basename(f)).write_bytes(open(f, "rb").read())
    with caplog.at_level("INFO", logger="resumable_stream.state.relocation"):
        resumed = ResumableStream(_cfg(str(moved), resume_state_path=str(tmp_path / "ck")))
    assert f"data relocated: {root} -> {moved}" in caplog.text
    assert take_ids(resumed, 70) == ref[50:120]


def test_a_state_dict_without_its_checkpoint_says_where_the_files_are(dataset):
    """A state_dict holds the files' digest: when the files it stands for are in no table at hand (another
    process saved it, the data changed since), the difference is the files' count and digest, and the message
    says where they are listed."""
    root, _ = dataset
    s = ResumableStream(_cfg(root))
    take_ids(s, 50)
    state = json.loads(json.dumps(s.state_dict()))     # a copy: the stream's fingerprint is the state's
    arrays = s.source.index["files"].arrays()
    arrays["mtime"] = arrays["mtime"] - 7.0            # the files as another process saw them before a touch
    gone = FileTable(arrays)
    state["fingerprint"]["dataset"]["files"] = saved = fingerprint_files.compact(gone)
    del gone
    gc.collect()
    with pytest.raises(StreamMismatchError, match="load the state from its stream_state or checkpoint directory") as e:
        ResumableStream(_cfg(root)).load_state_dict(state)
    assert e.value.differences == [("dataset.files", saved, s.source.fingerprint["files"])]


def test_a_sidecar_file_alone_names_a_changed_file(dataset, tmp_path):
    root, files = dataset
    s = ResumableStream(_cfg(root))
    take_ids(s, 50)
    s.save_sidecar(str(tmp_path / "one.safetensors"))
    _touch(files[3])
    with pytest.raises(StreamMismatchError, match=f"file modified: {files[3]} \\(mtime\\)"):
        ResumableStream(_cfg(root, resume_state_path=str(tmp_path / "one.safetensors")))


def test_a_state_that_lists_the_files_resumes_and_names_a_change(dataset):
    """A state written before (its fingerprint lists every file) against a source that holds them compactly:
    the same files resume exactly, a changed one is named as before."""
    root, files = dataset
    ref = take_ids(ResumableStream(_cfg(root)), 120)
    s = ResumableStream(_cfg(root))
    assert take_ids(s, 50) == ref[:50]
    state = s.state_dict()
    state["fingerprint"] = fingerprint_files.expanded(state["fingerprint"])
    assert isinstance(state["fingerprint"]["dataset"]["files"], list)
    resumed = ResumableStream(_cfg(root))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert take_ids(resumed, 70) == ref[50:120]
    _touch(files[0])
    with pytest.raises(StreamMismatchError) as e:
        ResumableStream(_cfg(root)).load_state_dict(state)
    assert [w for w, _, _ in e.value.differences] == [f"file modified: {files[0]} (mtime)"]


def _identities(n: int, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        entry = {"path": f"/d/part-{i:04d}.parquet", "size": rng.randrange(10, 10**6), "footer": f"{rng.getrandbits(128):032x}"}
        if rng.random() < 0.5:
            entry["mtime"] = 1.7e9 + rng.random()
        else:
            entry["etag"] = f'"{rng.getrandbits(32):x}"'
            if rng.random() < 0.5:
                entry["last-modified"] = "Wed, 21 Oct 2015 07:28:00 GMT"
        out.append(entry)
    return out


def _edited(saved: list[dict], rng: random.Random) -> list[dict]:
    now = [dict(e) for e in saved]
    for i in rng.sample(range(len(now)), 40):
        e, what = now[i], rng.choice(["size", "mtime", "footer", "etag", "drop-lm", "add-lm", "nothing"])
        if what == "size":
            e["size"] += 1
        elif what == "mtime":
            e["mtime"] = e.get("mtime", 1.7e9) + 1
        elif what == "footer":
            e["footer"] = "0" * 32
        elif what == "etag":           # as long as it was (the same offsets) or longer
            e["etag"] = ('"' + "z" * (len(e["etag"]) - 2) + '"') if "etag" in e and rng.random() < 0.5 else '"longer-etag"'
        elif what == "drop-lm":
            e.pop("last-modified", None)
        elif what == "add-lm":
            e["last-modified"] = "Thu, 22 Oct 2015 07:28:00 GMT"
    return now


@pytest.mark.parametrize("seed", range(6))
def test_the_columnar_compare_names_what_the_per_file_compare_named(seed):
    """Same paths, some files edited: the files found over the columns, compared as dicts, give exactly what
    comparing every file as a dict gave (a Last-Modified only one side reports included)."""
    rng = random.Random(seed)
    saved = _identities(300, rng)
    now = _edited(saved, rng)
    table = FileTable.from_entries([{**e, "footer_bytes": 10, "row_groups": [[5, 0, 9]]} for e in now])
    compact = fingerprint_files.compact(table)
    expected = _files_diff(saved, now)
    saved_table = FileTable.from_entries([{**e, "footer_bytes": 10, "row_groups": [[5, 0, 9]]} for e in saved])
    for saved_form in (saved, fingerprint_files.compact(saved_table)):
        compared = compare_files(saved_form, compact)
        assert compared.named and compared.diffs == expected


# ------------------------------------------------------------------ the checkpoint's index file
def test_the_packed_checkpoint_index_round_trips_and_resumes(dataset, tmp_path):
    root, _ = dataset
    ref = take_ids(ResumableStream(_cfg(root)), 120)
    s = ResumableStream(_cfg(root))
    take_ids(s, 50)
    state = tmp_path / "ck" / "stream_state"
    s.save_sidecar(str(state))
    manifest = json.loads((state / "manifest.json").read_text())
    assert manifest["index"]["file"] == "index.bin" and not (state / "index.json").exists()
    back = decode_index((state / "index.bin").read_bytes(), "'index.bin'")
    assert back["files"] == s.source.index["files"] and encode_index(back) == encode_index(s.source.index)
    assert len(json.loads((state / "fingerprint.json").read_text())["dataset"]["files"]) == 2   # count, digest
    resumed = ResumableStream(_cfg(root, resume_state_path=str(tmp_path / "ck")))
    assert take_ids(resumed, 70) == ref[50:120]


def test_an_index_path_may_hold_the_packed_form(tmp_path):
    index = synthetic_parquet_index(30, 3, 10)
    path = tmp_path / "index.bin"
    path.write_bytes(encode_message(index))
    loaded = load_index(str(path))
    assert isinstance(loaded["files"], FileTable) and list(loaded["files"]) == index["files"]
    assert np.array_equal(loaded["files"].group_rows(), [g[0] for e in index["files"] for g in e["row_groups"]])


def test_an_unchanged_index_is_packed_once_per_process(dataset, tmp_path, monkeypatch):
    """Saves into new checkpoints link the index file without packing it again; a touched file is written anew."""
    from resumable_stream.state import checkpoint as ckpt

    packed, read = [], []
    real, real_read = ckpt.encode_message, ckpt._read_bytes
    monkeypatch.setattr(ckpt, "encode_message", lambda index: packed.append(1) or real(index))
    monkeypatch.setattr(ckpt, "_read_bytes", lambda path, *a: read.append(os.path.basename(path)) or real_read(path, *a))
    root, _ = dataset
    s = ResumableStream(_cfg(root))
    take_ids(s, 10)
    for name in ("ck1", "ck2"):
        s.save_sidecar(str(tmp_path / name))
    assert len(packed) == 1 and "index.bin" not in read      # nor read back to be hashed for the manifest
    assert ckpt.read_state_index(str(tmp_path / "ck2"))[1] == (tmp_path / "ck1" / "index.bin").read_bytes()
    assert os.stat(tmp_path / "ck1" / "index.bin").st_ino == os.stat(tmp_path / "ck2" / "index.bin").st_ino
    os.utime(tmp_path / "ck2" / "index.bin", ns=(1, 1))          # touched: not trusted to be the one written
    s.save_sidecar(str(tmp_path / "ck3"))
    assert len(packed) == 2
    assert decode_index((tmp_path / "ck3" / "index.bin").read_bytes(), "x")["files"] == s.source.index["files"]
