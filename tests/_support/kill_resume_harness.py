"""The kill-and-resume harness shared by test_kill_resume.py (text) and test_vl_kill_resume.py (VL).

A run of ``MAX_STEPS`` steps with a checkpoint every ``SAVE_STEPS`` is SIGKILLed at a random step (from
the session seed, helpers.TEST_SEED) after its first checkpoint, restarted, and compared step by step with an
uninterrupted reference run (``References``: started on first use, so it trains alongside the killed run).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable

from helpers import TEST_SEED
from training_helpers import (
    Procs,
    assert_data_parallel,
    checkpoint_path,
    complete_checkpoints,
    consumed,
    count_lines,
    printed_steps,
    run_results,
    train_epochs,
    train_log_records,
    train_losses,
    wait_until_each,
)

# 40 steps of 8 rows, a checkpoint every 10, reach every case the kill tests assert: a kill after the
# first checkpoint and before the end (steps 11..25), and no epoch end either way (80 steps read 16% of the text
# data's epoch). VL keeps 80 / 20 (test_vl_kill_resume.py): its broken rows are ~1.5% of the data, and the longer
# run meets more of them around the resume point.
MAX_STEPS = 40
SAVE_STEPS = 10
LOSS_TOL = 1e-6


class References:
    """Uninterrupted runs, started on first use (so they overlap the test's own runs), waited for on ``get``.

    ``setups``: name -> (options, ranks); ``write``: (directory, name, max_steps=, save_steps=, **options) ->
    (yaml path, output dir), e.g. training_helpers.write_config."""

    def __init__(self, directory: str, setups: dict, write: Callable[..., tuple[str, str]], script: str,
                 max_steps: int = MAX_STEPS, save_steps: int = SAVE_STEPS):
        self.directory, self.setups, self.write = directory, setups, write
        self.max_steps, self.save_steps = max_steps, save_steps
        self.procs = Procs(directory, script=script)
        self.runs: dict[str, tuple] = {}

    def start(self, name: str) -> None:
        if name not in self.runs:
            options, ranks = self.setups[name]
            config, out = self.write(self.directory, f"ref-{name}", max_steps=self.max_steps,
                                     save_steps=self.save_steps,
                                     **options)
            self.runs[name] = (self.procs.start(config, f"ref-{name}", nproc=ranks), out)

    def get(self, name: str) -> str:
        self.start(name)
        run, out = self.runs[name]
        run.wait_ok()
        return out


def seed_note(name: str, **facts) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in facts.items())
    return f"[{name}: seed {TEST_SEED} (rerun with RS_TEST_SEED={TEST_SEED}){', ' + extra if extra else ''}]"


def train_log(out: str) -> str:
    return f"{out}/train_log.jsonl"


def first_difference(a: dict, b: dict) -> str:
    for step in sorted(set(a) | set(b)):
        if a.get(step) != b.get(step):
            return f"first difference at step {step}: reference {a.get(step)!r}, resumed {b.get(step)!r}"
    return "no difference"


def assert_same_training(ref_out: str, out: str, ranks: int, note: str, max_steps: int = MAX_STEPS) -> None:
    """Every step's loss (within LOSS_TOL) and every rank's consumed samples equal the reference's."""
    ref_losses, losses = train_losses(ref_out), train_losses(out)
    assert sorted(ref_losses) == list(range(1, max_steps + 1)), f"reference train log incomplete {note}"
    assert sorted(losses) == list(range(1, max_steps + 1)), \
        f"resumed train log steps {sorted(set(losses) ^ set(ref_losses))[:10]} differ from 1..{max_steps} {note}"
    bad = [(s, ref_losses[s], losses[s]) for s in ref_losses if abs(ref_losses[s] - losses[s]) > LOSS_TOL]
    assert not bad, f"{len(bad)} step losses differ (step, reference, resumed): {bad[:5]} {note}"
    # the Trainer's own epoch continues through the resume (it restarted from 0 when its skip was turned off)
    ref_epochs, epochs = train_epochs(ref_out), train_epochs(out)
    assert epochs == ref_epochs, f"the Trainer's epoch differs: {first_difference(ref_epochs, epochs)} {note}"
    # the run ends as HF's: trainer_state.json with the whole log history, train_results / all_results.json
    ref_results, results = run_results(ref_out), run_results(out)
    history = {h["step"]: h["epoch"] for h in results["trainer_state.json"]["log_history"] if "loss" in h}
    assert history == ref_epochs, f"output_dir/trainer_state.json: {first_difference(ref_epochs, history)} {note}"
    for name in ("train_results.json", "all_results.json"):
        assert results[name]["epoch"] == ref_results[name]["epoch"] == 1.0, f"{name}: {results[name]} {note}"
    for rank in range(ranks):
        ref_keys, keys = consumed(ref_out, rank), consumed(out, rank)
        assert sorted(ref_keys) == list(range(1, max_steps + 1)), f"reference rank {rank} consumed log {note}"
        assert all(ref_keys[s] for s in ref_keys), f"reference rank {rank} logged a step with no samples {note}"
        assert keys == ref_keys, f"rank {rank} consumed other samples: {first_difference(ref_keys, keys)} {note}"
    if ranks > 1:
        assert_data_parallel(ref_out, ranks, f"[reference] {note}")
        assert_data_parallel(out, ranks, note)


def start_killed_run(procs: Procs, config: str, name: str, ranks: int, rng: random.Random,
                     max_steps: int = MAX_STEPS, save_steps: int = SAVE_STEPS):
    """Start the run to kill and draw its kill step (after the first checkpoint): (run, target step)."""
    target = rng.randint(save_steps + 1, max_steps - 15)
    return procs.start(config, f"{name}-killed", nproc=ranks), target


def ready_to_kill(out: str, target: int) -> bool:
    return count_lines(train_log(out)) >= target and bool(complete_checkpoints(out))


def kill_now(run, out: str, name: str, target: int, max_steps: int = MAX_STEPS):
    """SIGKILL all the run's processes; check the kill landed mid-training after a complete checkpoint.

    Returns (target step, steps logged when killed, last complete checkpoint step, note)."""
    run.kill()
    logged = count_lines(train_log(out))
    note = seed_note(name, target_step=target, killed_after_step=logged)
    assert run.proc.returncode == -signal.SIGKILL, \
        f"the run was not killed mid-training (exit {run.proc.returncode}) {note}\n{run.describe()}"
    assert logged < max_steps, f"the run got to the end before the kill landed {note}"
    done = complete_checkpoints(out)
    assert done, f"no complete checkpoint when killed {note}"
    return target, logged, done[-1], seed_note(name, target_step=target, killed_after_step=logged,
                                               resumed_from=f"checkpoint-{done[-1]}")


def kill_at_random_step(procs: Procs, config: str, out: str, name: str, ranks: int, rng: random.Random,
                        max_steps: int = MAX_STEPS, save_steps: int = SAVE_STEPS):
    """Start a run; SIGKILL all its processes at a random step after the first checkpoint.

    Returns (target step, steps logged when killed, last complete checkpoint step, note)."""
    run, target = start_killed_run(procs, config, name, ranks, rng, max_steps, save_steps)
    run.wait_until(lambda: ready_to_kill(out, target), f"step {target} and a complete checkpoint {seed_note(name)}")
    return kill_now(run, out, name, target, max_steps)


def kill_and_restart_side_by_side(procs: Procs, cases: dict, max_steps: int = MAX_STEPS,
                                  save_steps: int = SAVE_STEPS, timeout: float = 400) -> dict:
    """``kill_at_random_step`` and the restart for several runs at once (one-process runs leave a core idle while
    they start, import and save): ``cases`` is name -> (config, out, ranks, rng, restart label). Each run is killed
    as soon as it reached its own kill step (all are polled together), and restarted at once.

    Returns name -> (the finished restart, last complete checkpoint step when killed, note), or the
    AssertionError of that case (raised by the test of that case)."""
    runs = {name: start_killed_run(procs, config, name, ranks, rng, max_steps, save_steps)
            for name, (config, out, ranks, rng, _) in cases.items()}
    waits = {name: (run, lambda out=cases[name][1], target=target: ready_to_kill(out, target),
                    f"step {target} and a complete checkpoint {seed_note(name)}")
             for name, (run, target) in runs.items()}
    results: dict = {}
    restarts = {}
    for name, failure in wait_until_each(waits, timeout):
        config, out, ranks, _, restart_label = cases[name]
        run, target = runs[name]
        try:
            assert failure is None, failure
            _, _, resume_step, note = kill_now(run, out, name, target, max_steps)
        except AssertionError as e:
            results[name] = e
            continue
        restarts[name] = (procs.start(config, restart_label, nproc=ranks), resume_step, note)
    for name, (restart, resume_step, note) in restarts.items():
        try:
            results[name] = (restart.wait_ok(), resume_step, note)
        except AssertionError as e:
            results[name] = e
    return results


def assert_resumed_from(run, out: str, resume_step: int, note: str, max_steps: int = MAX_STEPS) -> None:
    """The restart loaded ``checkpoint-<resume_step>`` and trained only the steps after it."""
    expected = checkpoint_path(out, resume_step)
    assert f"resuming from {expected}" in run.stderr, f"restart did not log 'resuming from {expected}' {note}\n" \
                                                      f"{run.describe()}"
    trained = printed_steps(run)
    assert trained == max_steps - resume_step, \
        f"restart trained {trained} steps, expected {max_steps - resume_step} (steps after the checkpoint) {note}"
    # train_log.jsonl marks the resume point (for `resumable-stream report`): on the first line after it only
    marks = {r["step"]: r["resumed_from"] for r in train_log_records(out) if "resumed_from" in r}
    assert marks == {resume_step + 1: f"checkpoint-{resume_step}"}, f"resume marks {marks} {note}"
