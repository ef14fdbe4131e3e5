"""examples/own_trainer.py (docs/trainers.md shows it): your own transformers Trainer with ``patch_trainer`` and a
``TrainingStream``. SIGKILLed after its first checkpoint and run again, it resumes through
``train(resume_from_checkpoint=True)`` and trains the remaining steps with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import sys

import pytest
from training_helpers import ROOT, Procs

SCRIPT = os.path.join(ROOT, "examples", "own_trainer.py")
STEPS = 9            # checkpoints every 3 steps (the example's save_steps)

pytestmark = pytest.mark.slow


def _losses(run) -> dict[int, str]:
    """What the example prints at its end: "step loss" per step of the log history (the Trainer prints more)."""
    pairs = [line.split() for line in run.stdout.splitlines()]
    return {int(p[0]): p[1] for p in pairs if len(p) == 2 and p[0].isdigit()}


def test_own_trainer_resumes_exactly_after_a_sigkill(tmp_path):
    procs = Procs(str(tmp_path))
    try:
        # the uninterrupted run trains side by side with the one that is killed (a process each, on 2 cores)
        whole = procs.start(str(tmp_path / "x"), "whole", command=[sys.executable, SCRIPT, str(tmp_path / "whole"),
                                                                    str(STEPS)])
        out = tmp_path / "killed"
        manifest = out / "checkpoint-3" / "stream_state" / "manifest.json"
        victim = procs.start(str(tmp_path / "x"), "victim", command=[sys.executable, SCRIPT, str(out), str(STEPS)])
        victim.wait_until(manifest.exists, "the checkpoint of step 3")
        victim.kill()
        whole.wait_ok(300)
        assert not (out / f"checkpoint-{STEPS}").exists(), "the run ended before the kill: nothing was resumed"
        resumed = procs.start(str(tmp_path / "x"), "resumed",
                              command=[sys.executable, SCRIPT, str(out), str(STEPS)]).wait_ok(300)
    finally:
        procs.cleanup()
    expected, got = _losses(whole), _losses(resumed)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert sorted(got) == list(range(1, STEPS + 1)), "the resumed run's log history covers every step"
    assert got == expected, "the steps after the checkpoint it resumed from trained on other data or weights"
    assert (out / f"checkpoint-{STEPS}" / "stream_state" / "manifest.json").exists()
