"""Kill real vision-language training processes with SIGKILL and restart them: the result must equal an
uninterrupted run, exactly as for text (``test_kill_resume.py``, whose harness this reuses).

Each test trains the tiny Qwen3-VL-style model of ``examples/tiny/train_vl.yaml`` with
``examples/train_vl.py`` (one process, ``torch.distributed.run`` with 2 gloo ranks, or 2 DataLoader
workers) on the bundled pictures, about 1.5% of which are broken and skipped (``data.bad_sample: skip``).
It kills the run at a random step after the first checkpoint, restarts it, and compares with an
uninterrupted reference: every step's loss, every rank's consumed samples, and every step's transform
counters (samples read, examples made, skips) in ``train_log.jsonl``. A broken sample never reaches a batch.

Reproduce a failure with ``RS_KILL_SEED=<seed> pytest tests/test_vl_kill_resume.py``.
"""

from __future__ import annotations

import io
import json
import os
import random

import pyarrow.parquet as pq
import pytest
import test_kill_resume as kr
from training_helpers import TINY, TRAIN_VL, Procs, checkpoint_steps, consumed, is_complete, write_vl_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BATCH = 4      # samples per step and rank (the yaml has 8): half the work, the same checks
# name -> (write_vl_config options, ranks)
SETUPS = {
    "single": (dict(workers=0, per_device_train_batch_size=BATCH), 1),
    "ddp": (dict(workers=0, per_device_train_batch_size=BATCH), 2),
    "workers2": (dict(workers=2, per_device_train_batch_size=BATCH), 1),
}


class VLReferences(kr.References):
    """Uninterrupted VL runs, started on first use so they overlap the runs they are compared with."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.procs = Procs(directory, script=TRAIN_VL)

    def start(self, name: str) -> None:
        if name not in self.runs:
            options, ranks = SETUPS[name]
            config, out = write_vl_config(self.directory, f"ref-{name}", max_steps=kr.MAX_STEPS,
                                          save_steps=kr.SAVE_STEPS, **options)
            self.runs[name] = (self.procs.start(config, f"ref-{name}", nproc=ranks), out)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    r = VLReferences(str(tmp_path_factory.mktemp("vl-references")))
    try:
        yield r
    finally:
        r.procs.cleanup()


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path), script=TRAIN_VL)
    try:
        yield p
    finally:
        p.cleanup()


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
    """step -> the transform counters (``data_*``) logged with it."""
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("data_")} for r in recs}


def vl_kill_and_resume(procs, refs, tmp_path, name: str, broken_ids: set[str]) -> None:
    options, ranks = SETUPS[name]
    refs.start(name)
    rng = random.Random(f"{kr.SEED}:vl-{name}")
    config, out = write_vl_config(str(tmp_path), name, max_steps=kr.MAX_STEPS, save_steps=kr.SAVE_STEPS, **options)
    _, _, resume_step, note = kr.kill_at_random_step(procs, config, out, f"vl-{name}", ranks, rng)

    restart = procs.start(config, f"{name}-restart", nproc=ranks).wait_ok()
    kr.assert_resumed_from(restart, out, resume_step, note)
    ref_out = refs.get(name)
    kr.assert_same_training(ref_out, out, ranks, note)
    assert all(is_complete(out, s) for s in checkpoint_steps(out)), f"incomplete checkpoint left behind {note}"

    ref_counters, counters = _counters(ref_out), _counters(out)
    assert counters == ref_counters, \
        f"transform counters differ: {kr._first_difference(ref_counters, counters)} {note}"
    last = ref_counters[kr.MAX_STEPS]
    skipped = last["data_skipped_image"] + last["data_skipped_mismatch"]
    assert skipped > 0, f"the reference skipped no broken sample ({last}); the test would prove nothing {note}"
    assert last["data_samples"] - last["data_examples"] == skipped + last["data_skipped_empty"] \
        + last["data_skipped_processor"] + last["data_dropped_overlong"], f"counters do not add up: {last} {note}"
    for rank in range(ranks):
        keys = {k for step_keys in consumed(out, rank).values() for k in step_keys}
        assert not keys & broken_ids, f"rank {rank} trained on broken rows {sorted(keys & broken_ids)} {note}"


def test_vl_sigkill_at_random_step_resumes_exactly(procs, refs, tmp_path, broken_ids):
    vl_kill_and_resume(procs, refs, tmp_path, "single", broken_ids)


def test_vl_sigkill_with_two_dataloader_workers_resumes_exactly(procs, refs, tmp_path, broken_ids):
    vl_kill_and_resume(procs, refs, tmp_path, "workers2", broken_ids)


def test_vl_sigkill_torchrun_two_ranks_resumes_exactly(procs, refs, tmp_path, broken_ids):
    vl_kill_and_resume(procs, refs, tmp_path, "ddp", broken_ids)
    ref_out = refs.get("ddp")
    per_rank = [{k for keys in consumed(ref_out, r).values() for k in keys} for r in range(2)]
    assert not per_rank[0] & per_rank[1], f"ranks 0 and 1 both read rows {sorted(per_rank[0] & per_rank[1])[:10]}"
