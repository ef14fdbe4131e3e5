"""``resumable-stream inspect`` refuses a rank file whose recorded rank is not the one its name says (a file
copied or renamed over another rank's), as a resume refuses it, naming the file and both ranks (exit 2)."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest

from resumable_stream import ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.app.cli import main
from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run(tmp_path):
    """A run's output_dir with one complete 2-rank checkpoint: (config, run dir, checkpoint, stream_state)."""
    write_parquet_dataset(str(tmp_path / "data"), rows=400, files=2, row_group_size=50)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=str(tmp_path / "data" / "*.parquet"),
                       shuffle=True, buffer_size=32)
    ck = tmp_path / "run" / "checkpoint-3"
    state_dir = str(ck / "stream_state")
    for rank in (0, 1):
        s = ResumableStream(cfg, rank=rank, world_size=2)
        list(itertools.islice(s, 10 + rank))
        s.save_sidecar(state_dir)
        s.close()
    write_manifest(state_dir, 2)
    (ck / "trainer_state.json").write_text("{}")
    return cfg, str(tmp_path / "run"), str(ck), state_dir


def _refused(capsys, path: str, file: str) -> str:
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"resumable-stream: error: sidecar {file!r}: the saved stream state is rank 0's, "
                          "its file name says rank 1; a rank file copied or renamed over another rank's"), err
    assert err.count("\n") == 1          # one line, as the CLI's other refusals
    return err


def test_inspect_refuses_a_rank_file_holding_another_ranks_state(run, capsys):
    cfg, run_dir, ck, state_dir = run
    for path in (run_dir, ck, state_dir):       # the untouched checkpoint is shown
        assert main(["inspect", path]) == 0
        assert set(json.loads(capsys.readouterr().out)["ranks"]) == {"rank-00000.safetensors", "rank-00001.safetensors"}
    one = os.path.join(state_dir, "rank-00001.safetensors")
    shutil.copyfile(os.path.join(state_dir, "rank-00000.safetensors"), one)
    _refused(capsys, one, one)                   # the file itself, by its name
    write_manifest(state_dir, 2)                 # listed with its digest: the manifest alone does not catch it
    for path in (one, ck, state_dir, run_dir):
        _refused(capsys, path, one)
    # a resume refuses it too: rank 1 reads rank-00001.safetensors and finds rank 0's state
    s = ResumableStream(cfg, rank=1, world_size=2)
    with pytest.raises(StreamMismatchError, match=r"rank-00001\.safetensors'.*rank 0's, this is rank 1"):
        s.load_sidecar(ck)
    s.close()


def test_a_sidecar_file_outside_a_checkpoint_is_checked_by_its_name_only_when_it_is_a_rank_name(run, tmp_path,
                                                                                                capsys):
    cfg = run[0]
    s = ResumableStream(cfg, rank=0, world_size=2)
    list(itertools.islice(s, 5))
    mine = str(tmp_path / "mine.safetensors")
    s.save_sidecar(mine)                           # a whole state in one file (fingerprint included)
    s.close()
    assert main(["inspect", mine]) == 0            # any name but rank-NNNNN: nothing to compare
    assert json.loads(capsys.readouterr().out)["topology"]["rank"] == 0
    (tmp_path / "copies").mkdir()
    renamed = str(tmp_path / "copies" / "rank-00001.safetensors")
    shutil.copyfile(mine, renamed)
    _refused(capsys, renamed, renamed)
