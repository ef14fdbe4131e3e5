"""Real training (``examples/train_lm.py``, DataLoader workers) on a mixture of a plain-text source whose rows
a ``data.map`` hook splits, drops and rewrites, and an alpaca source, killed with SIGKILL at a random step
and restarted from a checkpoint taken inside a split row: every step's samples and loss equal an
uninterrupted run's."""

from __future__ import annotations

import os
import random
import signal

import pytest
from training_helpers import (
    TINY,
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
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "tests", "_support"), os.environ.get("PYTHONPATH")) if p)}


def _config(directory: str, name: str, save_steps: int) -> tuple[str, str]:
    sources = [{"label": "lm", "dataset_name_or_path": "parquet", "data_files": os.path.join(TINY, "data", "*.parquet"),
                "weight": 0.5, "map": "map_hooks:split_drop_rewrite"},
               {"label": "chat", "dataset_name_or_path": "json", "weight": 0.5,
                "data_files": os.path.join(ROOT, "tests", "data", "alpaca.jsonl"), "format": "alpaca",
                "columns": {"system": "system", "history": "history"}}]
    return write_config(directory, name, max_steps=MAX_STEPS, save_steps=save_steps, workers=2,
                        template="train_mix.yaml",
                        data={"sources": sources, "packing": False, "max_seq_len": 96, "buffer_size": 32})


def _split_across(steps: dict[int, list[str]]) -> list[int]:
    """Steps after which some row split by the hook has outputs still to come (keys ``id#i``)."""
    seen: dict[str, list[int]] = {}
    for step, keys in steps.items():
        for key in keys:
            if "#" in key:
                seen.setdefault(key.rsplit("#", 1)[0], []).append(step)
    return sorted({t for ss in seen.values() for t in range(min(ss), max(ss))})


def test_sigkill_resumes_a_mapped_and_mixed_format_run_exactly(procs, tmp_path):
    """The killed run checkpoints after a step that consumed only some of the outputs of a split row (found
    in the reference run's consumed log), is killed after it, and resumes from that checkpoint."""
    ref_config, ref_out = _config(str(tmp_path), "reference", SAVE_STEPS)
    procs.start(ref_config, "reference", env=ENV).wait_ok()
    ref_keys = consumed(ref_out)
    assert sorted(ref_keys) == list(range(1, MAX_STEPS + 1))
    flat = [k for s in sorted(ref_keys) for k in ref_keys[s]]
    # both sources fed the run, the hook's split rows among them (keys id#i), none of its dropped ids
    assert any(k.startswith("chat/") for k in flat) and any(k.startswith("lm/") for k in flat), flat[:20]
    assert not [k for k in flat if k.startswith("lm/") and int(k.split("/")[-1].split("#")[0]) % 5 == 0]
    cuts = [t for t in _split_across(ref_keys) if 8 <= t <= MAX_STEPS // 2]
    assert cuts, f"no step between 8 and {MAX_STEPS // 2} ends inside a split row: {_split_across(ref_keys)}"
    cut = random.Random(SEED).choice(cuts)
    note = f"[checkpoint after step {cut}; seed {SEED}, rerun with RS_KILL_SEED={SEED}]"

    config, out = _config(str(tmp_path), "killed", cut)
    run = procs.start(config, "killed", env=ENV)
    log = os.path.join(out, "train_log.jsonl")
    run.wait_until(lambda: count_lines(log) >= cut + 2 and cut in complete_checkpoints(out), f"step {cut + 2} {note}")
    run.kill()
    assert run.proc.returncode == -signal.SIGKILL, f"not killed mid-training {note}\n{run.describe()}"
    resume_step = complete_checkpoints(out)[-1]
    assert resume_step == cut, f"the kill landed after checkpoint {resume_step} {note}"
    restart = procs.start(config, "restart", env=ENV).wait_ok()
    assert f"resuming from {checkpoint_path(out, cut)}" in restart.stderr, restart.describe()
    assert printed_steps(restart) == MAX_STEPS - cut

    keys = consumed(out)
    assert keys == ref_keys, f"consumed samples differ {note}"
    ref_losses, losses = train_losses(ref_out), train_losses(out)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, MAX_STEPS + 1))
    bad = [(s, ref_losses[s], losses[s]) for s in ref_losses if abs(ref_losses[s] - losses[s]) > 1e-6]
    assert not bad, f"step losses differ: {bad[:5]} {note}"
