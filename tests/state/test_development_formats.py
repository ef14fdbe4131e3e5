"""The state format is version 1 of the released format; what the development builds of 0.1.0 wrote (format
"resumable-stream", versions 1-3: tests/data/development_formats, written by the builds named in its README)
is refused with an error naming it, from the library and at the CLI (exit 2), never read as another layout."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from repo_paths import DATA_DIR
from small_mixture import copy_data, stream_config

from resumable_stream import ResumableStream, SidecarError
from resumable_stream.app.cli import main
from resumable_stream.state.sidecar import FORMAT, FORMAT_VERSION

FORMATS = os.path.join(DATA_DIR, "development_formats")
FILES = {1: "v1.safetensors", 2: "v2.safetensors", 3: "v3.safetensors"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("dev_formats")))


def _says_development(message: str, version: int) -> None:
    assert f"format 'resumable-stream' version {version}" in message, message
    assert "development build of resumable-stream 0.1.0" in message, message
    assert f"reads only {FORMAT!r} version {FORMAT_VERSION}" in message, message


@pytest.mark.parametrize("version", sorted(FILES))
def test_a_file_of_a_development_build_is_refused_naming_it(version, data):
    stream = ResumableStream(stream_config(data), rank=0, world_size=2)
    with pytest.raises(SidecarError) as e:
        stream.load_sidecar(os.path.join(FORMATS, FILES[version]))
    _says_development(str(e.value), version)


def test_a_checkpoint_of_a_development_build_is_refused_at_its_manifest(data, tmp_path):
    checkpoint = str(tmp_path / "checkpoint-4")
    shutil.copytree(os.path.join(FORMATS, "v3_checkpoint"), checkpoint)
    manifest = json.load(open(os.path.join(checkpoint, "stream_state", "manifest.json")))
    assert (manifest["format"], manifest["format_version"]) == ("resumable-stream", 3)   # as that build wrote it
    for rank in range(2):
        with pytest.raises(SidecarError) as e:
            ResumableStream(stream_config(data), rank=rank, world_size=2).load_sidecar(checkpoint)
        _says_development(str(e.value), 3)


def test_inspect_and_peek_exit_2_naming_the_development_build(data, tmp_path, capsys):
    checkpoint = os.path.join(FORMATS, "v3_checkpoint")
    assert main(["inspect", checkpoint]) == 2
    _says_development(capsys.readouterr().err, 3)
    config = tmp_path / "data.yaml"
    config.write_text("data:\n  dataset_name_or_path: parquet\n"
                      f"  data_files: {os.path.join(data, 'a', '*.parquet')}\n"
                      "  shuffle: true\n  buffer_size: 16\n  block_rows: 5\n  num_partitions: 4\n")
    assert main(["peek", str(config), "--resume-from", os.path.join(FORMATS, FILES[2]), "--world-size", "2"]) == 2
    _says_development(capsys.readouterr().err, 2)


def test_a_manifest_of_another_version_of_this_format_asks_for_a_newer_release(data, tmp_path):
    stream = ResumableStream(stream_config(data), rank=0, world_size=1)
    state_dir = str(tmp_path / "stream_state")
    stream.save_sidecar(state_dir)
    path = os.path.join(state_dir, "manifest.json")
    manifest = json.load(open(path))
    assert (manifest["format"], manifest["format_version"]) == (FORMAT, FORMAT_VERSION)
    for version in (2, "1", True, 1.0):
        json.dump({**manifest, "format_version": version}, open(path, "w"))
        with pytest.raises(SidecarError, match="format version"):
            ResumableStream(stream_config(data), rank=0, world_size=1).load_sidecar(state_dir)
