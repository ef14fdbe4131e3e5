"""Relocated data: a copy of the dataset elsewhere (mtimes not kept) resumes when its content is the same.

Copies here are made the way ``cp`` without ``-p`` / ``rsync`` without ``-t`` make them: new files with
the same bytes and new mtimes (set far from the originals' so that they surely differ).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pyarrow.parquet as pq
import pytest
from helpers import take_ids as _take_column

from resumable_stream import ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.app.cli import main
from resumable_stream.state.relocation import dataset_root, relative_paths
from resumable_stream.testing import write_jsonl_dataset, write_parquet_dataset

pytestmark = pytest.mark.timeout(120)

ROWS, K, AFTER = 480, 150, 120


def take_ids(stream, n: int) -> list:
    return _take_column(stream, n, column="text")


def _copy_tree(src: str, dst: str) -> None:
    """Copy every file below ``src`` to ``dst`` with the content only (new mtimes, like ``cp`` without -p)."""
    for root, _, names in os.walk(src):
        for name in names:
            target = os.path.join(dst, os.path.relpath(os.path.join(root, name), src))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(root, name), target)
            os.utime(target, (1_000_000_000, 1_000_000_000))


def _parquet(directory: str) -> list[str]:
    """Two sub-directories, so that relative paths carry a directory too (other texts: compared by text)."""
    return (write_parquet_dataset(os.path.join(directory, "en"), rows=ROWS // 2, files=2, row_group_size=40)
            + write_parquet_dataset(os.path.join(directory, "fr"), rows=ROWS // 2, files=2, row_group_size=40,
                                    words=11))


def _cfg(root: str, pattern: str = "*/*.parquet", builder: str = "parquet", **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(root, pattern), shuffle=True,
                        buffer_size=64, **kw)


@pytest.fixture
def saved(tmp_path):
    """A parquet dataset in ``a/``, the uninterrupted reference, and a sidecar saved after K samples."""
    a = str(tmp_path / "a")
    _parquet(a)
    ref = take_ids(ResumableStream(_cfg(a)), K + AFTER)
    first = ResumableStream(_cfg(a))
    assert take_ids(first, K) == ref[:K]
    first.save_sidecar(tmp_path / "state")
    return a, ref, str(tmp_path / "state")


def test_relative_paths_are_relative_to_the_deepest_common_directory():
    paths = ["s3://b/ds/en/x.parquet", "s3://b/ds/fr/y.parquet"]
    assert dataset_root(paths) == "s3://b/ds" and relative_paths(paths) == ["en/x.parquet", "fr/y.parquet"]
    assert relative_paths(["/data/ds/x.parquet"]) == ["x.parquet"]


def test_local_copy_without_mtimes_resumes_exactly(saved, tmp_path, caplog):
    a, ref, state = saved
    b = str(tmp_path / "ssd" / "copy")
    _copy_tree(a, b)
    with caplog.at_level(logging.INFO, logger="resumable_stream.state.relocation"):
        resumed = ResumableStream(_cfg(b, resume_state_path=state))
    assert resumed.source.index["files"][0]["mtime"] == 1_000_000_000    # the mtimes did change
    assert take_ids(resumed, AFTER) == ref[K:K + AFTER]
    assert f"data relocated: {a} -> {b}" in caplog.text
    assert "only their size" not in caplog.text         # parquet: the footer digest vouches for every file


def test_local_copy_with_an_edited_file_is_a_mismatch_naming_it(saved, tmp_path):
    a, _, state = saved
    b = str(tmp_path / "copy")
    _copy_tree(a, b)
    edited = os.path.join(b, "fr", "part-00001.parquet")
    table = pq.read_table(edited)
    values = table.column(1).take(list(reversed(range(table.num_rows))))   # same rows, other order of a column
    pq.write_table(table.set_column(1, table.column_names[1], values), edited, row_group_size=40)
    with pytest.raises(StreamMismatchError) as err:
        ResumableStream(_cfg(b, resume_state_path=state))
    assert f"file modified: {edited} (footer; was {os.path.join(a, 'fr', 'part-00001.parquet')})" in str(err.value)
    assert "part-00000" not in str(err.value)           # the unchanged files are not named


def test_copy_with_a_renamed_file_is_not_the_same_data(saved, tmp_path):
    a, _, state = saved
    b = str(tmp_path / "copy")
    _copy_tree(a, b)
    os.rename(os.path.join(b, "en", "part-00001.parquet"), os.path.join(b, "en", "part-00009.parquet"))
    with pytest.raises(StreamMismatchError, match=r"file removed: .*a/en/part-00001.parquet"):
        ResumableStream(_cfg(b, resume_state_path=state))


def test_unmoved_data_still_compares_mtimes(saved):
    """In place nothing changes: a touched file is still a mismatch (the fingerprint format is unchanged, so
    sidecars saved before relocation support load and compare as they did)."""
    a, _, state = saved
    os.utime(os.path.join(a, "en", "part-00000.parquet"), (1_000_000_000, 1_000_000_000))
    with pytest.raises(StreamMismatchError, match=r"file modified: .*en/part-00000.parquet \(mtime\)"):
        ResumableStream(_cfg(a, resume_state_path=state))


def test_moved_jsonl_resumes_with_a_warning_and_a_resized_file_is_caught(tmp_path, caplog):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_jsonl_dataset(a, rows=300, files=3)
    cfg = _cfg(a, "*.jsonl", builder="json")
    ref = take_ids(ResumableStream(cfg), 200)
    first = ResumableStream(cfg)
    take_ids(first, 90)
    first.save_sidecar(tmp_path / "state")
    _copy_tree(a, b)
    with caplog.at_level(logging.WARNING, logger="resumable_stream.state.relocation"):
        resumed = ResumableStream(_cfg(b, "*.jsonl", builder="json", resume_state_path=str(tmp_path / "state")))
    assert take_ids(resumed, 110) == ref[90:200]
    assert "3 file(s) have no content identity comparable across the move" in caplog.text
    assert "only their size is checked" in caplog.text

    grown = os.path.join(b, "part-00002.jsonl")
    with open(grown, "a") as f:
        f.write(json.dumps({"id": 10_000, "text": "one more"}) + "\n")
    with pytest.raises(StreamMismatchError, match=r"file resized: .*b/part-00002.jsonl \(size"):
        ResumableStream(_cfg(b, "*.jsonl", builder="json", resume_state_path=str(tmp_path / "state")))


def test_inspect_shows_each_files_identity(saved, capsys):
    a, _, state = saved
    assert main(["inspect", os.path.join(state, "rank-00000.safetensors"), "--full"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert files["root"] == a and files["count"] == 4
    assert files["identity"] == {"parquet footer digest": 4}
    first = files["files"][0]
    assert first["relative_path"] == "en/part-00000.parquet"
    assert first["size"] == os.path.getsize(os.path.join(a, "en", "part-00000.parquet"))
    assert first["identity"] == "parquet footer digest" and len(first["footer"]) == 32 and "mtime" in first
