"""Checkpoints as DeepSpeed and FSDP lay them out: the stream state beside the engine's own files is what makes
one complete, whatever those files are. (DeepSpeed ZeRO-2 / ZeRO-3 train for real on CPU in
tests/against_llamafactory/test_deepspeed.py; FSDP does not run on CPU ranks with accelerate, so its sharded layout is
built here as transformers writes it.)"""

from __future__ import annotations

import json
import os

import pytest
from helpers import parquet_config, take_ids

from resumable_stream import ResumableStream, SidecarError
from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.state.names import STATE_DIR
from resumable_stream.state.output_dir import is_complete, latest_complete_checkpoint, resume_latest

# the engine's files of a checkpoint (transformers' Trainer with each engine), relative to checkpoint-N
LAYOUTS = {
    "plain": ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"],
    "deepspeed-zero3": ["global_step{n}/zero_pp_rank_0_mp_rank_00_model_states.pt",
                        "global_step{n}/zero_pp_rank_1_mp_rank_00_model_states.pt",
                        "global_step{n}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "latest", "zero_to_fp32.py",
                        "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt"],
    "fsdp-sharded": ["pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
                     "pytorch_model_fsdp_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/.metadata",
                     "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt"],
}


def _engine_files(checkpoint: str, layout: str, step: int) -> None:
    for name in LAYOUTS[layout]:
        path = os.path.join(checkpoint, name.format(n=step))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"engine state")


def _trainer_state(checkpoint: str, step: int) -> None:
    with open(os.path.join(checkpoint, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump({"global_step": step}, f)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_stream_state_completes_a_checkpoint_of_any_engine_and_resumes_from_it(parquet_small, tmp_path,
                                                                                    layout):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=64)
    out = str(tmp_path / "out")
    streams = [ResumableStream(cfg, rank=r, world_size=2) for r in (0, 1)]
    for s in streams:
        take_ids(s, 70)
    ten = os.path.join(out, "checkpoint-10")
    _engine_files(ten, layout, 10)
    for s in streams:                        # every rank's file, then rank 0's manifest (the trainer's order)
        s.save_sidecar(os.path.join(ten, STATE_DIR))
    write_manifest(os.path.join(ten, STATE_DIR), 2)
    _trainer_state(ten, 10)
    expected = [take_ids(s, 30) for s in streams]
    # two saves a kill cut short: the engine wrote its files but not the trainer state; the stream state of
    # every rank was written, not the manifest
    twenty, thirty = os.path.join(out, "checkpoint-20"), os.path.join(out, "checkpoint-30")
    _engine_files(twenty, layout, 20)
    _engine_files(thirty, layout, 30)
    _trainer_state(thirty, 30)
    for s in streams:
        s.save_sidecar(os.path.join(thirty, STATE_DIR))
    assert is_complete(ten) and not is_complete(twenty) and not is_complete(thirty)
    assert latest_complete_checkpoint(out) == ten
    assert resume_latest(out, True, lambda: None) == ten
    assert sorted(os.listdir(out)) == ["checkpoint-10"]               # the cut-short ones removed
    for r in (0, 1):
        resumed = ResumableStream(cfg.replace(resume_state_path=ten), rank=r, world_size=2)
        assert take_ids(resumed, 30) == expected[r]


def test_a_rank_file_rank_0_cannot_see_is_named_with_the_shared_output_dir_it_needs(parquet_small, tmp_path):
    """Two nodes writing a checkpoint into output_dirs of their own: rank 0 finds only its own node's files."""
    state_dir = os.path.join(str(tmp_path), "checkpoint-4", STATE_DIR)
    cfg = parquet_config(parquet_small)
    for rank in (0, 1):              # node 0's ranks of 4; ranks 2 and 3 wrote on another machine
        s = ResumableStream(cfg, rank=rank, world_size=4)
        take_ids(s, 3)
        s.save_sidecar(os.path.join(state_dir, f"rank-{rank:05d}.safetensors"))
    with pytest.raises(SidecarError) as e:
        write_manifest(state_dir, 4)
    assert "rank-00002.safetensors missing" in str(e.value)
    assert "train.output_dir must be one directory every node sees" in str(e.value)
    assert not is_complete(os.path.dirname(state_dir))
