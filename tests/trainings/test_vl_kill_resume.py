"""Kill real vision-language training processes with SIGKILL and restart them: the result must equal an
uninterrupted run, exactly as for text (``test_kill_resume.py``; both use ``kill_resume_harness.py``).

Each test trains the tiny Qwen3-VL-style model of ``examples/tiny/train_vl.yaml`` with
``examples/train_vl.py`` (one process, ``torch.distributed.run`` with 2 gloo ranks, or 2 DataLoader
workers) on the bundled pictures, about 1.5% of which are broken and skipped (``data.bad_sample: skip``).
It kills the run at a random step after the first checkpoint, restarts it, and compares with an
uninterrupted reference: every step's loss, every rank's consumed samples, and every step's transform
counters (samples read, examples made, skips) in ``train_log.jsonl``. A broken sample never reaches a batch.
The two one-process cases are killed and restarted side by side (``one_process_kills``).

Reproduce a failure with ``RS_TEST_SEED=<seed> pytest tests/trainings/test_vl_kill_resume.py``.
"""

from __future__ import annotations

import io
import json
import os

import pyarrow.parquet as pq
import pytest
from helpers import seeded_rng
from kill_resume_harness import (
    References,
    assert_resumed_from,
    assert_same_training,
    first_difference,
    kill_and_restart_side_by_side,
    kill_at_random_step,
)
from training_helpers import TINY, TRAIN_VL, Procs, checkpoint_steps, consumed, is_complete, write_vl_config

from resumable_stream.transforms.vl import STAT_KEYS as VL_STAT_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TRAINING_SCRIPT = TRAIN_VL     # what the procs fixture (conftest.py) runs

MAX_STEPS, SAVE_STEPS = 80, 20     # not the text tests' 40 / 10: the longer run meets more broken rows
BATCH = 4      # samples per step and rank (the yaml has 8): half the work, the same checks
# name -> (write_vl_config options, ranks)
SETUPS = {
    "single": (dict(workers=0, per_device_train_batch_size=BATCH), 1),
    "ddp": (dict(workers=0, per_device_train_batch_size=BATCH), 2),
    "workers2": (dict(workers=2, per_device_train_batch_size=BATCH), 1),
}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    r = References(str(tmp_path_factory.mktemp("vl-references")), SETUPS, write_vl_config, TRAIN_VL, MAX_STEPS,
                   SAVE_STEPS)
    try:
        yield r
    finally:
        r.procs.cleanup()


@pytest.fixture(scope="module")
def broken_ids() -> set[str]:
    """Ids of the bundled rows that cannot be used, found with PIL directly (not with our transform)."""
    from PIL import Image

    bad = set()
    for f in sorted(os.listdir(os.path.join(TINY, "data_vl"))):
        for row in pq.read_table(os.path.join(TINY, "data_vl", f)).to_pylist():
            placeholders = sum(m["content"].count("<image>") for m in row["messages"])
            ok = placeholders == len(row["images"])
            for img in row["images"]:
                try:
                    im = Image.open(io.BytesIO(img["bytes"]))
                    im.load()
                    ok = ok and im.mode == "RGB"
                except Exception:  # noqa: BLE001 - None bytes, truncated, garbage
                    ok = False
            if not ok:
                bad.add(str(row["id"]))
    assert 10 <= len(bad) <= 60, f"the bundled data should hold a few dozen broken rows, found {len(bad)}"
    return bad


def _counters(out: str) -> dict[int, dict]:
    """step -> the transform counters (``data_<counter>``) logged with it (not the data path's timings)."""
    names = {f"data_{k}" for k in VL_STAT_KEYS}
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: {k: v for k, v in r.items() if k in names} for r in recs}


def vl_kill_and_resume(procs, refs, tmp_path, name: str, broken_ids: set[str]) -> None:
    options, ranks = SETUPS[name]
    refs.start(name)
    rng = seeded_rng(f"vl-{name}")
    config, out = write_vl_config(str(tmp_path), name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, **options)
    _, _, resume_step, note = kill_at_random_step(procs, config, out, f"vl-{name}", ranks, rng, MAX_STEPS,
                                                 SAVE_STEPS)

    restart = procs.start(config, f"{name}-restart", nproc=ranks).wait_ok()
    assert_resumed_like_the_reference(refs, name, out, restart, resume_step, note, broken_ids)


def assert_resumed_like_the_reference(refs, name: str, out: str, restart, resume_step: int, note: str,
                                      broken_ids: set[str]) -> None:
    ranks = SETUPS[name][1]
    assert_resumed_from(restart, out, resume_step, note, MAX_STEPS)
    ref_out = refs.get(name)
    assert_same_training(ref_out, out, ranks, note, MAX_STEPS)
    assert all(is_complete(out, s) for s in checkpoint_steps(out)), f"incomplete checkpoint left behind {note}"

    ref_counters, counters = _counters(ref_out), _counters(out)
    assert counters == ref_counters, \
        f"transform counters differ: {first_difference(ref_counters, counters)} {note}"
    last = ref_counters[MAX_STEPS]
    skipped = last["data_skipped_image"] + last["data_skipped_mismatch"]
    assert skipped > 0, f"the reference skipped no broken sample ({last}); the test would prove nothing {note}"
    assert last["data_samples"] - last["data_examples"] == skipped + last["data_skipped_empty"] \
        + last["data_skipped_processor"] + last["data_dropped_overlong"], f"counters do not add up: {last} {note}"
    for rank in range(ranks):
        keys = {k for step_keys in consumed(out, rank).values() for k in step_keys}
        assert not keys & broken_ids, f"rank {rank} trained on broken rows {sorted(keys & broken_ids)} {note}"


ONE_PROCESS = ["single", "workers2"]


@pytest.fixture(scope="module")
def one_process_kills(refs, tmp_path_factory):
    """The one-process cases, each killed at its own random step and restarted as vl_kill_and_resume does, side by
    side with their references (a one-process run leaves a core idle while it starts, imports and saves):
    name -> (output dir, (restart, resume step, note) or the case's AssertionError)."""
    root = str(tmp_path_factory.mktemp("vl_one_process_kills"))
    procs = Procs(root, script=TRAIN_VL)
    cases, outs = {}, {}
    for name in ONE_PROCESS:
        options, ranks = SETUPS[name]
        refs.start(name)
        config, outs[name] = write_vl_config(root, name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, **options)
        cases[f"vl-{name}"] = (config, outs[name], ranks, seeded_rng(f"vl-{name}"), f"{name}-restart")
    try:
        results = kill_and_restart_side_by_side(procs, cases, MAX_STEPS, SAVE_STEPS)
        yield {name: (outs[name], results[f"vl-{name}"]) for name in ONE_PROCESS}
    finally:
        procs.cleanup()


def one_process_kill_and_resume(refs, one_process_kills, name: str, broken_ids: set[str]) -> None:
    out, result = one_process_kills[name]
    if isinstance(result, AssertionError):
        raise result
    restart, resume_step, note = result
    assert_resumed_like_the_reference(refs, name, out, restart, resume_step, note, broken_ids)


@pytest.mark.timeout(900)     # the first one-process case waits for both
def test_vl_sigkill_at_random_step_resumes_exactly(refs, one_process_kills, broken_ids):
    one_process_kill_and_resume(refs, one_process_kills, "single", broken_ids)


@pytest.mark.timeout(900)     # run first alone (-k): waits for both
def test_vl_sigkill_with_two_dataloader_workers_resumes_exactly(refs, one_process_kills, broken_ids):
    one_process_kill_and_resume(refs, one_process_kills, "workers2", broken_ids)


def test_vl_sigkill_torchrun_two_ranks_resumes_exactly(procs, refs, tmp_path, broken_ids):
    vl_kill_and_resume(procs, refs, tmp_path, "ddp", broken_ids)
    ref_out = refs.get("ddp")
    per_rank = [{k for keys in consumed(ref_out, r).values() for k in keys} for r in range(2)]
    assert not per_rank[0] & per_rank[1], f"ranks 0 and 1 both read rows {sorted(per_rank[0] & per_rank[1])[:10]}"
