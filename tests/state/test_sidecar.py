"""Sidecars: safetensors layout, atomic writes, manifests, corrupt input, topology mismatches."""

import hashlib
import json
import os
import shutil

import pytest
from helpers import take_ids
from safetensors import safe_open

from resumable_stream import ResumableStream, SidecarError, StreamMismatchError
from resumable_stream.state import checkpoint as ckpt


def _saved(cfg, source, tmp_path, n=150, world_size=1, rank=0, num_workers=0):
    s = ResumableStream(cfg, rank=rank, world_size=world_size, num_workers=num_workers, source=source)
    take_ids(s, n)
    return s, s.save_sidecar(tmp_path / "state")


def test_sidecar_is_safetensors_with_cursor_tensors_and_json_metadata(cfg, source, tmp_path):
    s, path = _saved(cfg, source, tmp_path)
    assert os.path.basename(path) == "rank-00000.safetensors"
    assert os.path.isfile(tmp_path / "state" / "manifest.json")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"partition_ids", "cursors", "slots", "chains"}
        cursors = f.get_tensor("cursors")
    assert (meta["format"], meta["format_version"], meta["kind"]) == ("resumable-stream-state", "1", "stream")
    fields = json.loads(meta["cursor_fields"])
    row = dict(zip(fields, cursors[0].tolist()))
    assert row["offset"] + row["consumed_before"] == 150
    # the dataset's fingerprint is the directory's, once: the rank file holds its digest
    assert "fingerprint" not in meta
    fp_bytes = (tmp_path / "state" / "fingerprint.json").read_bytes()
    assert meta["fingerprint_digest"] == hashlib.blake2b(fp_bytes, digest_size=16).hexdigest()
    fp = json.loads(fp_bytes)
    assert fp["order"]["seed"] == 42 and fp["order"]["buffer_size"] == 64
    assert fp["dataset"]["files"]["count"] == 4        # the files' count and digest: their identities are the index's
    assert json.loads(meta["topology"]) == {"rank": 0, "world_size": 1, "num_workers": 0, "num_partitions": 1}
    digests = json.loads(meta["digests"])["0"]
    assert digests["consumed_samples"] == 150 and len(digests["next_sample"]) == 16
    manifest = json.loads((tmp_path / "state" / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["fingerprint"]["file"] == "fingerprint.json"
    # no temp files left behind
    assert sorted(os.listdir(tmp_path / "state")) == ["fingerprint.json", "index.bin", "manifest.json",
                                                     "rank-00000.safetensors"]


def test_a_sidecar_file_alone_holds_the_whole_fingerprint(cfg, source, tmp_path):
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 10)
    path = s.save_sidecar(tmp_path / "alone.safetensors")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    assert "fingerprint_digest" not in meta
    saved = json.loads(meta["fingerprint"])          # the files listed (the file alone names one that changed)
    assert saved["dataset"]["files"] == [source.index["files"].identity(i) for i in range(4)]
    assert {**saved, "dataset": {**saved["dataset"], "files": s.fingerprint()["dataset"]["files"]}} == s.fingerprint()


def test_a_rank_file_taken_out_of_its_directory_is_refused_with_the_reason(cfg, source, tmp_path):
    s, path = _saved(cfg, source, tmp_path)
    alone = tmp_path / "elsewhere.safetensors"
    alone.write_bytes(open(path, "rb").read())
    with pytest.raises(SidecarError, match="fingerprint.json.*not beside it; load the directory"):
        ResumableStream(cfg, rank=0, world_size=1, source=source).load_sidecar(alone)


def test_a_rank_file_of_another_save_is_refused(cfg, source, tmp_path):
    """Rank files from two saves of different data in one directory: the fingerprint digest tells them apart."""
    _saved(cfg, source, tmp_path)
    other = ResumableStream(cfg.replace(shuffle_seed=7), rank=0, world_size=1, source=source)
    take_ids(other, 5)
    other.save_sidecar(tmp_path / "other")
    state = tmp_path / "state"
    (state / "fingerprint.json").write_bytes((tmp_path / "other" / "fingerprint.json").read_bytes())
    manifest = json.loads((state / "manifest.json").read_text())
    data = (state / "fingerprint.json").read_bytes()
    manifest["fingerprint"].update(bytes=len(data), blake2b=hashlib.blake2b(data, digest_size=16).hexdigest())
    (state / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SidecarError, match="saved with dataset fingerprint .* not one save's files"):
        ResumableStream(cfg, rank=0, world_size=1, source=source).load_sidecar(state)


def test_the_fingerprint_is_checked_against_the_manifest(cfg, source, tmp_path):
    _saved(cfg, source, tmp_path)
    fp = tmp_path / "state" / "fingerprint.json"
    fp.write_bytes(fp.read_bytes().replace(b'"seed":42', b'"seed":43'))
    with pytest.raises(SidecarError, match="fingerprint.json.*does not match its manifest entry"):
        ResumableStream(cfg, rank=0, world_size=1, source=source).load_sidecar(tmp_path / "state")


def test_consumed_digest_identifies_what_was_consumed(cfg, source, tmp_path):
    a = ResumableStream(cfg, rank=0, world_size=1, source=source)
    b = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(a, 100)
    take_ids(b, 100)
    assert a.state_dict()["partitions"][0]["consumed_digest"] == b.state_dict()["partitions"][0]["consumed_digest"]
    take_ids(b, 1)
    assert a.state_dict()["partitions"][0]["consumed_digest"] != b.state_dict()["partitions"][0]["consumed_digest"]
    c = ResumableStream(cfg.replace(shuffle_seed=1), rank=0, world_size=1, source=source)
    take_ids(c, 100)
    assert c.state_dict()["partitions"][0]["consumed_digest"] != a.state_dict()["partitions"][0]["consumed_digest"]


def test_consumed_digest_is_kept_up_as_samples_are_consumed(cfg, source, monkeypatch):
    """The digest after k samples of a window equals one hash of the window's first k keys after the chain of
    the windows before, whatever the snapshots in between; each snapshot hashes only the keys consumed since
    the previous one (the loader takes one per batch, so its cost must not grow with buffer_size)."""
    import hashlib

    from resumable_stream.stream import partition

    hashed = []
    blake2b = hashlib.blake2b

    class Counting:
        def __init__(self, *a, **kw):
            self._h = blake2b(*a, **kw)

        def update(self, data):
            hashed.append(memoryview(data).nbytes)
            self._h.update(data)

        def copy(self):
            c = Counting.__new__(Counting)
            c._h = self._h.copy()
            return c

        def digest(self):
            return self._h.digest()

        def hexdigest(self):
            return self._h.hexdigest()

    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 70)                            # into the second 64-row window
    reader = s._readers[0]
    win = reader.window()
    chain = reader.cursor.chain
    monkeypatch.setattr(partition.hashlib, "blake2b", Counting)
    before = 0
    for k in (1, 2, 5, 5, 17, 30):
        reader.offset = k
        hashed.clear()
        got = reader.consumed_digest()
        assert got == blake2b(chain + win.keys[:k].tobytes(), digest_size=16).hexdigest()
        assert sum(hashed) == 16 * (k - before)    # only the keys since the previous snapshot (16 bytes each)
        before = k
    reader.offset = 9                          # backwards (a reload): hashed afresh, still right
    assert reader.consumed_digest() == blake2b(chain + win.keys[:9].tobytes(), digest_size=16).hexdigest()
    hashed.clear()
    reader.offset = 12
    reader.consumed_digest()
    assert sum(hashed) == 16 * 3


def test_atomic_write_keeps_the_old_file_when_interrupted(cfg, source, tmp_path, monkeypatch):
    s, path = _saved(cfg, source, tmp_path)
    before = open(path, "rb").read()
    take_ids(s, 10)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", boom)
    with pytest.raises(OSError):
        s.save_sidecar(path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".tmp")] == []


@pytest.mark.parametrize("damage", ["truncate_half", "truncate_8", "empty", "garbage", "flip_header", "not_ours"])
def test_corrupt_or_truncated_sidecar_is_a_clear_error(cfg, source, tmp_path, damage):
    _, path = _saved(cfg, source, tmp_path)
    data = open(path, "rb").read()
    if damage == "truncate_half":
        data = data[: len(data) // 2]
    elif damage == "truncate_8":
        data = data[:8]
    elif damage == "empty":
        data = b""
    elif damage == "garbage":
        data = os.urandom(500)
    elif damage == "flip_header":
        data = data[:8] + b"#" + data[9:]
    elif damage == "not_ours":
        import numpy as np
        from safetensors.numpy import save
        data = save({"w": np.zeros(3)}, metadata={"x": "y"})
    open(path, "wb").write(data)
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    with pytest.raises(SidecarError) as e:
        s.load_sidecar(path)      # the file itself: no manifest check
    assert path in str(e.value)


def test_missing_sidecar_names_the_path(cfg, source, tmp_path):
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    with pytest.raises(SidecarError, match="not found"):
        s.load_sidecar(tmp_path / "nope.safetensors")
    with pytest.raises(SidecarError, match="expected a rank"):
        s.load_sidecar(tmp_path)


def test_directory_without_manifest_is_incomplete(cfg, source, tmp_path):
    _, path = _saved(cfg, source, tmp_path)
    os.unlink(tmp_path / "state" / "manifest.json")
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    with pytest.raises(SidecarError, match="manifest.json"):
        s.load_sidecar(tmp_path / "state")


def test_rank_file_changed_after_manifest_is_refused(cfg, source, tmp_path):
    s, path = _saved(cfg, source, tmp_path)
    take_ids(s, 5)
    ckpt.write_state_file(path, {"stream": s.state_dict()})      # rewritten without a new manifest
    fresh = ResumableStream(cfg, rank=0, world_size=1, source=source)
    with pytest.raises(SidecarError, match="manifest"):
        fresh.load_sidecar(tmp_path / "state")


def test_checkpoint_directory_with_stream_state_subdir(cfg, source, tmp_path):
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 70)
    s.save_sidecar(tmp_path / "checkpoint-70" / "stream_state")
    expected = take_ids(s, 30)
    r = ResumableStream(cfg.replace(resume_state_path=str(tmp_path / "checkpoint-70")), rank=0, world_size=1,
                        source=source)
    assert take_ids(r, 30) == expected


def test_multi_rank_manifest(cfg, source, tmp_path):
    state_dir = tmp_path / "checkpoint-5" / "stream_state"
    expected = {}
    for rank in range(3):
        s = ResumableStream(cfg, rank=rank, world_size=3, source=source)
        take_ids(s, 40 + rank)
        s.save_sidecar(state_dir)
        expected[rank] = take_ids(s, 20)
    with pytest.raises(SidecarError, match="manifest.json"):
        ResumableStream(cfg, rank=1, world_size=3, source=source).load_sidecar(state_dir.parent)
    ckpt.write_manifest(str(state_dir), 3)
    for rank in range(3):
        r = ResumableStream(cfg, rank=rank, world_size=3, source=source)
        r.load_sidecar(state_dir.parent)
        assert take_ids(r, 20) == expected[rank]
    os.unlink(state_dir / "rank-00002.safetensors")
    with pytest.raises(SidecarError, match="missing"):
        ResumableStream(cfg, rank=2, world_size=3, source=source).load_sidecar(state_dir)
    with pytest.raises(SidecarError, match="rank-00002.safetensors missing"):
        ckpt.write_manifest(str(state_dir), 3)


@pytest.mark.parametrize(
    ("saved", "now", "what"),
    [
        ((2, 0, 0), (3, 0, 0), "world_size"),
        ((2, 0, 0), (1, 0, 0), "world_size"),
        ((1, 0, 2), (1, 0, 1), "num_workers"),
        ((1, 0, 0), (1, 0, 2), "num_workers"),
        ((2, 1, 0), (2, 0, 0), "rank"),
    ],
)
def test_topology_change_is_a_mismatch(cfg, source, tmp_path, saved, now, what):
    w, r, k = saved
    s = ResumableStream(cfg, rank=r, world_size=w, num_workers=k, source=source)
    take_ids(s, 20)
    path = s.save_sidecar(tmp_path / "x.safetensors")
    w2, r2, k2 = now
    fresh = ResumableStream(cfg, rank=r2, world_size=w2, num_workers=k2, source=source)
    with pytest.raises(StreamMismatchError) as e:
        fresh.load_sidecar(path)
    assert what in str(e.value)
    assert any(d[0] == what for d in e.value.differences)


@pytest.mark.parametrize(
    ("change", "key"),
    [({"shuffle_seed": 43}, "data.shuffle_seed"), ({"buffer_size": 65}, "data.buffer_size"),
     ({"shuffle": False}, "data.shuffle"), ({"interleave_shards": 2}, "data.interleave_shards")],
)
def test_config_change_is_a_mismatch_naming_old_and_new(cfg, source, tmp_path, change, key):
    s, path = _saved(cfg, source, tmp_path)
    fresh = ResumableStream(cfg.replace(**change), rank=0, world_size=1, source=source)
    with pytest.raises(StreamMismatchError) as e:
        fresh.load_sidecar(path)
    msg = str(e.value)
    (name, new), = change.items()
    old = getattr(cfg, name)
    assert key in msg and f"saved {old!r}, now {new!r}" in msg


def test_future_format_version_is_refused(cfg, source, tmp_path):
    _, path = _saved(cfg, source, tmp_path)
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"format_version":"1"', b'"format_version":"9"')
    assert len(header) == n
    open(path, "wb").write(data[:8] + header + data[8 + n:])
    with pytest.raises(SidecarError, match="format version '9'"):
        ResumableStream(cfg, rank=0, world_size=1, source=source).load_sidecar(path)


def test_the_saved_dataset_index_has_its_own_size_limit(cfg, source, tmp_path, monkeypatch):
    """The index saved with a state is bounded by its own limit, not the manifest's: an index larger than
    the manifest limit (large datasets) still saves and resumes."""
    s = ResumableStream(cfg, source=source)
    take_ids(s, 5)
    state = tmp_path / "st"
    s.save_sidecar(str(state))
    index, manifest = (state / "index.bin").stat().st_size, (state / "manifest.json").stat().st_size
    assert index > manifest
    monkeypatch.setattr(ckpt, "MAX_MANIFEST_BYTES", (index + manifest) // 2)
    take_ids(s, 7)
    s.save_sidecar(str(state))                 # the next generation: its manifest names and digests the index
    assert (state / "index.g1.bin").is_file()
    after = take_ids(s, 7)
    resumed = ResumableStream(cfg.replace(resume_state_path=str(state)))    # opened from the saved index
    assert resumed.source.index == source.index
    assert take_ids(resumed, 7) == after


def test_what_describes_the_dataset_is_written_once_per_job(cfg, source, tmp_path):
    """Saves of one process into new checkpoint directories link the unchanged fingerprint and index (one
    inode, nothing written again); a changed file, or one touched since, is written anew."""
    s = ResumableStream(cfg, rank=0, world_size=1, source=source)
    take_ids(s, 5)
    s.save_sidecar(tmp_path / "ck1")
    take_ids(s, 5)
    s.save_sidecar(tmp_path / "ck2")
    for name in ("fingerprint.json", "index.bin"):
        a, b = os.stat(tmp_path / "ck1" / name), os.stat(tmp_path / "ck2" / name)
        assert a.st_ino == b.st_ino and b.st_nlink >= 2, name
    os.utime(tmp_path / "ck2" / "index.bin", ns=(1, 1))            # touched: not trusted to be the one written
    s.save_sidecar(tmp_path / "ck3")
    assert os.stat(tmp_path / "ck3" / "index.bin").st_ino != os.stat(tmp_path / "ck2" / "index.bin").st_ino
    assert os.stat(tmp_path / "ck3" / "fingerprint.json").st_ino == os.stat(tmp_path / "ck1" / "fingerprint.json").st_ino
    other = ResumableStream(cfg.replace(shuffle_seed=5), rank=0, world_size=1, source=source)
    take_ids(other, 5)
    other.save_sidecar(tmp_path / "ck4")                            # another fingerprint: its own file
    assert json.loads((tmp_path / "ck4" / "fingerprint.json").read_text())["order"]["seed"] == 5
    shutil.rmtree(tmp_path / "ck1")                                 # (save_total_limit): the others keep theirs
    for ck, seed, consumed in (("ck2", 42, 10), ("ck3", 42, 10), ("ck4", 5, 5)):
        fresh = ResumableStream(cfg.replace(shuffle_seed=seed), rank=0, world_size=1, source=source)
        fresh.load_sidecar(tmp_path / ck)
        assert fresh.state_dict()["partitions"][0]["consumed"] == consumed


def test_an_unmoved_partition_gives_the_same_state_and_a_moved_one_a_new_one(cfg, source):
    """state_dict over many partitions costs what the partitions that moved cost; the loader's carries never
    end up in the stream's own states."""
    from resumable_stream.loader import StreamLoader

    s = ResumableStream(cfg.replace(num_partitions=4), rank=0, world_size=1, source=source)
    take_ids(s, 10)
    before = {p: s.partition_state(p) for p in s.partitions}
    assert all(s.partition_state(p) is before[p] for p in s.partitions)
    take_ids(s, 1)                                      # the main process moved exactly one partition
    moved = [p for p in s.partitions if s.partition_state(p) is not before[p]]
    assert len(moved) == 1 and s.partition_state(moved[0]).consumed == before[moved[0]].consumed + 1

    class Carry:                                        # a transform whose state is a count
        def __init__(self):
            self.n, self.out = 0, []

        def feed(self, sample, key, source=None):
            self.n += 1
            self.out.append({"id": sample["id"], "keys": [key]})

        def ready(self):
            return len(self.out)

        def take(self):
            return self.out.pop(0)

        def state(self):
            return {"meta": {"n": self.n}, "tensors": {}}

        def load_state(self, st):
            self.n = st["meta"]["n"]

        def fingerprint(self):
            return {"carry": 1}

    one = ResumableStream(cfg, rank=0, world_size=1, source=source)
    loader = StreamLoader(one, batch_size=4, processor_factory=Carry)
    it = iter(loader)
    next(it)
    assert loader.rank_state()["transform"][0]["meta"]["n"] >= 4
    assert "extra" not in one.state_dict()["partitions"][0]     # the carry is the loader's, not the stream's
