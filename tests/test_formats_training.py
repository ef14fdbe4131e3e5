"""Real training (``examples/train_lm.py``, DataLoader workers) on a mixture of a plain-text source whose rows
a ``data.map`` hook splits, drops and rewrites, and an alpaca source, killed with SIGKILL at a random step
and restarted: every step's samples and loss equal an uninterrupted run's."""

from __future__ import annotations

import os
import random
import signal

import pytest
from training_helpers import (
    TINY,
    Procs,
    checkpoint_path,
    complete_checkpoints,
    consumed,
    count_lines,
    printed_steps,
    train_losses,
    write_config,
)

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(TINY.rstrip(os.sep).rsplit(os.sep, 1)[0])
MAX_STEPS, SAVE_STEPS = 40, 10
SEED = int(os.environ.get("RS_KILL_SEED") or random.SystemRandom().randrange(2**31))
# map_hooks is imported by the training processes (and their workers) from the tests directory
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")) if p)}


def _config(directory: str, name: str) -> tuple[str, str]:
    sources = [{"label": "lm", "dataset_name_or_path": "parquet", "data_files": os.path.join(TINY, "data", "*.parquet"),
                "weight": 0.5, "map": "map_hooks:split_drop_rewrite"},
               {"label": "chat", "dataset_name_or_path": "json", "weight": 0.5,
                "data_files": os.path.join(ROOT, "tests", "data", "alpaca.jsonl"), "format": "alpaca",
                "columns": {"system": "system", "history": "history"}}]
    return write_config(directory, name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, workers=2,
                        template="train_mix.yaml",
                        data={"sources": sources, "packing": False, "max_seq_len": 96, "buffer_size": 32})


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path))
    try:
        yield p
    finally:
        p.cleanup()


def test_sigkill_resumes_a_mapped_and_mixed_format_run_exactly(procs, tmp_path):
    note = f"[seed {SEED}; rerun with RS_KILL_SEED={SEED}]"
    ref_config, ref_out = _config(str(tmp_path), "reference")
    reference = procs.start(ref_config, "reference", env=ENV)
    config, out = _config(str(tmp_path), "killed")
    target = random.Random(SEED).randint(SAVE_STEPS + 2, MAX_STEPS - 10)
    run = procs.start(config, "killed", env=ENV)
    log = os.path.join(out, "train_log.jsonl")
    run.wait_until(lambda: count_lines(log) >= target and complete_checkpoints(out), f"step {target} {note}")
    run.kill()
    assert run.proc.returncode == -signal.SIGKILL, f"not killed mid-training {note}\n{run.describe()}"
    resume_step = complete_checkpoints(out)[-1]
    restart = procs.start(config, "restart", env=ENV).wait_ok()
    assert f"resuming from {checkpoint_path(out, resume_step)}" in restart.stderr, restart.describe()
    assert printed_steps(restart) == MAX_STEPS - resume_step
    reference.wait_ok()

    ref_keys, keys = consumed(ref_out), consumed(out)
    assert sorted(ref_keys) == list(range(1, MAX_STEPS + 1))
    flat = [k for s in sorted(ref_keys) for k in ref_keys[s]]
    # both sources fed the run, the hook's split rows among them (keys id#i), none of its dropped ids
    assert any(k.startswith("chat/") for k in flat) and any(k.startswith("lm/") for k in flat), flat[:20]
    assert any("#" in k for k in flat), flat[:40]
    assert not [k for k in flat if k.startswith("lm/") and int(k.split("/")[-1].split("#")[0]) % 5 == 0]
    assert keys == ref_keys, f"consumed samples differ after resuming from checkpoint-{resume_step} {note}"
    ref_losses, losses = train_losses(ref_out), train_losses(out)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, MAX_STEPS + 1))
    bad = [(s, ref_losses[s], losses[s]) for s in ref_losses if abs(ref_losses[s] - losses[s]) > 1e-6]
    assert not bad, f"step losses differ: {bad[:5]} {note}"
