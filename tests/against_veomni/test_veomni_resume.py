"""VeOmni 0.1.12's own trainer with our dataset: its yaml (datasets_type / dataloader.type: resumable_stream),
its TextTrainer, data transform, collators, DCP checkpointer and CheckpointerCallback (which saves
train_dataloader.state_dict() per rank beside its shards and restores it before the first step), under torchrun
(gloo) on 1 and 2 ranks with 2 DataLoader workers per rank, shuffled. A run is SIGKILLed after the checkpoint of
step 6 and restarted through VeOmni's own resume (train.checkpoint.load_path: auto); every rank's sample keys
and the losses of the steps after the resume equal an uninterrupted run's.

Runs in the venv .ci/veomni builds (tests/conftest.py collects this folder only where veomni is installed); the
CPU stand-ins are in veomni_launch.py, each explained there."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import veomni_helpers as vh
from tagged_processes import TAG, kill_tagged, new_tag

from resumable_stream.errors import ConfigError

pytestmark = pytest.mark.timeout(600)

STEPS, SAVE, KILL_AFTER = 10, 3, 7       # checkpoints at 3, 6, 9; killed after step 7 (its checkpoint: 6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(config: str, log_dir: str, nproc: int, env: dict | None = None, hold: int | None = None) -> None:
    """torchrun of veomni_launch.py to its end, or with ``hold`` until every rank logged step ``hold`` and
    then SIGKILLed (the whole process group: torchrun, its ranks and their DataLoader workers)."""
    tag = new_tag()     # torchrun's ranks run in sessions of their own: killed by this tag (tagged_processes)
    run_env = {**os.environ, **vh.ENV, **(env or {}), TAG: tag}
    if hold is not None:
        run_env["VEOMNI_TEST_HOLD_AFTER"] = str(hold)
    out = open(os.path.join(os.path.dirname(log_dir), os.path.basename(log_dir) + ".out"), "ab")
    proc = subprocess.Popen(vh.torchrun(config, log_dir, nproc, _free_port()), env=run_env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=os.path.dirname(config))
    try:
        if hold is None:
            assert proc.wait(timeout=400) == 0, _tail(out.name)
            return
        deadline = time.monotonic() + 400
        while not all(hold in _steps(log_dir, r) for r in range(nproc)):
            assert proc.poll() is None, f"ended before step {hold}:\n{_tail(out.name)}"
            assert time.monotonic() < deadline, f"no step {hold} after 400 s:\n{_tail(out.name)}"
            time.sleep(0.2)
    finally:
        kill_tagged(tag)
        proc.wait(timeout=60)
        out.close()


def _steps(log_dir: str, rank: int) -> dict:
    try:
        return vh.records(log_dir, rank)
    except FileNotFoundError:
        return {}


def _tail(path: str, n: int = 6000) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("veomni_assets")
    model = vh.make_model(str(d / "model"))
    data = vh.make_data(str(d / "data"))
    return model, data


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_after_a_checkpoint_resumes_exactly_through_veomni(tmp_path, assets, nproc):
    model, data = assets
    stream = vh.write_stream_yml(str(tmp_path), data, buffer_size=64)

    straight = vh.write_veomni_yaml(str(tmp_path), "straight", model, stream, str(tmp_path / "straight"),
                                    max_steps=STEPS, save_steps=SAVE, nproc=nproc)
    _run(straight, str(tmp_path / "log_straight"), nproc)

    killed = vh.write_veomni_yaml(str(tmp_path), "killed", model, stream, str(tmp_path / "killed"),
                                  max_steps=STEPS, save_steps=SAVE, nproc=nproc, load_path="auto")
    _run(killed, str(tmp_path / "log_killed"), nproc, hold=KILL_AFTER)
    ckpts = sorted(os.listdir(tmp_path / "killed" / "checkpoints"))
    assert ckpts == ["global_step_3", "global_step_6"], ckpts
    # VeOmni's own per-rank file holds our loader's state (plain values: it loads with weights_only=True)
    import torch

    from resumable_stream.state.job_state import STATE_KEY, decode_state_dict

    for r in range(nproc):
        extra = torch.load(tmp_path / "killed" / "checkpoints" / "global_step_6" / "extra_state" /
                           f"extra_state_rank_{r}.pt", weights_only=True)
        assert set(extra["train_dataloader"]) == {STATE_KEY}     # our bytes, saved by VeOmni as they are
        assert decode_state_dict(extra["train_dataloader"], "extra_state")["stream"]["topology"]["rank"] == r

    _run(killed, str(tmp_path / "log_killed"), nproc)        # VeOmni's resume: load_path auto -> global_step_6

    for r in range(nproc):
        want, got = vh.records(str(tmp_path / "log_straight"), r), vh.records(str(tmp_path / "log_killed"), r)
        assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            # steps 1-7: the killed run's first part; 7-10: the resume (step 7 is trained again from step 6)
            assert got[step]["keys"] == want[step]["keys"], f"rank {r} step {step}"
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5, abs=1e-6), f"rank {r} step {step}"
        assert len({k for s in want.values() for k in s["keys"]}) == STEPS * 4   # no row twice in a run
    if nproc == 2:     # the ranks read disjoint rows
        keys = [{k for s in vh.records(str(tmp_path / "log_straight"), r).values() for k in s["keys"]}
                for r in range(2)]
        assert not keys[0] & keys[1]


# --------------------------------------------------------------------------------------- what is refused, named
def test_a_train_path_ending_in_yaml_is_refused_naming_veomnis_multisource_reading(tmp_path, assets):
    from resumable_stream.integrations.veomni import build_dataset

    stream = vh.write_stream_yml(str(tmp_path), assets[1])
    renamed = str(tmp_path / "stream.yaml")
    os.rename(stream, renamed)
    with pytest.raises(ConfigError, match=r"data\.train_path.*multi-source.*\*\.yml"):
        build_dataset(train_path=renamed, dataloader={"type": "resumable_stream"})


def test_another_dataloader_type_and_dynamic_batching_are_refused(tmp_path, assets):
    from resumable_stream.integrations.veomni import build_dataloader, build_dataset

    stream = vh.write_stream_yml(str(tmp_path), assets[1])
    with pytest.raises(ConfigError, match=r"data\.dataloader\.type: got 'native'"):
        build_dataset(train_path=stream, dataloader={"type": "native"})
    dataset = build_dataset(train_path=stream, dataloader={"type": "resumable_stream"})
    with pytest.raises(ConfigError, match=r"train\.dyn_bsz"):
        build_dataloader(dataset, micro_batch_size=1, global_batch_size=1, dataloader_batch_size=1, dyn_bsz=True)
    with pytest.raises(ConfigError, match=r"data\.dataloader\.type: the resumable_stream dataset"):
        iter(dataset)


def test_importing_the_module_registers_both_builders():
    from veomni.data.data_loader import DATALOADER_REGISTRY
    from veomni.data.dataset import DATASET_REGISTRY

    import resumable_stream.integrations.veomni as ours

    assert DATASET_REGISTRY["resumable_stream"] is ours.build_dataset
    assert DATALOADER_REGISTRY["resumable_stream"] is ours.build_dataloader
    ours.register()                          # again: nothing changes, nothing raises
    assert DATASET_REGISTRY["resumable_stream"] is ours.build_dataset
