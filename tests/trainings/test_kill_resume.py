"""Kill real training processes with SIGKILL and restart them: the result must equal an uninterrupted run.

Each test trains the tiny model of ``examples/tiny/train_lm.yaml`` with ``examples/train_lm.py`` (one
process, or ``torch.distributed.run`` with 2 gloo ranks), kills it, restarts it with the same yaml (it
resumes from the last complete checkpoint) and compares, step by step, what every rank consumed
(``data.consumed_log``) and the loss of every step (``train_log.jsonl``, logging_steps 1) with an
uninterrupted reference run. References are shared through a module fixture and run alongside the
killed run they are compared with (one thread per process, so two processes fill the 2 cores); the four
one-process cases (single, packing, packing-workers2, packing-neat) are killed and restarted side by side
(``one_process_kills``), each polled for its own kill step.

The kill step is random; the seed is printed in every assertion message. Reproduce a failure with
``RS_TEST_SEED=<seed> pytest tests/trainings/test_kill_resume.py`` (the exact step reached when the kill lands
still depends on timing, so the message also says where it landed and which checkpoint was used).
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
from helpers import seeded_rng
from kill_resume_harness import (
    MAX_STEPS,
    SAVE_STEPS,
    References,
    assert_resumed_from,
    assert_same_training,
    kill_and_restart_side_by_side,
    kill_at_random_step,
    seed_note,
    train_log,
)
from training_helpers import (
    MANIFEST,
    SLOW_MANIFEST_TRAIN,
    STATE_DIR,
    TINY,
    TRAIN_LM,
    Procs,
    assert_data_parallel,
    checkpoint_path,
    checkpoint_steps,
    complete_checkpoints,
    consumed,
    is_complete,
    printed_steps,
    train_log_records,
    train_losses,
    write_config,
)

pytestmark = pytest.mark.slow

BATCH = 8                    # per_device_train_batch_size of the tiny yaml

# name -> (write_config options, ranks)
SETUPS = {
    "single": (dict(packing=False, workers=0), 1),
    "packing": (dict(packing=True, workers=0), 1),
    "packing-workers2": (dict(packing=True, workers=2), 1),
    "packing-neat": (dict(packing=True, workers=2, data={"packing_mode": "neat"}), 1),
    "ddp": (dict(packing=False, workers=0), 2),
    "ddp-packing": (dict(packing=True, workers=0), 2),
}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    r = References(str(tmp_path_factory.mktemp("references")), SETUPS, write_config, TRAIN_LM)
    try:
        yield r
    finally:
        r.procs.cleanup()


def assert_resumed_like_the_reference(refs: References, name: str, out: str, restart, resume_step: int,
                                      note: str) -> None:
    assert_resumed_from(restart, out, resume_step, note)
    assert_same_training(refs.get(name), out, SETUPS[name][1], note)
    assert all(is_complete(out, s) for s in checkpoint_steps(out)), f"incomplete checkpoint left behind {note}"


def kill_and_resume(procs: Procs, refs: References, tmp_path, name: str) -> None:
    options, ranks = SETUPS[name]
    refs.start(name)    # the reference trains alongside the run we kill
    rng = seeded_rng(name)
    config, out = write_config(str(tmp_path), name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, **options)
    _, _, resume_step, note = kill_at_random_step(procs, config, out, name, ranks, rng)

    restart = procs.start(config, f"{name}-restart", nproc=ranks).wait_ok()
    assert_resumed_like_the_reference(refs, name, out, restart, resume_step, note)


ONE_PROCESS = ["single", "packing", "packing-workers2", "packing-neat"]


@pytest.fixture(scope="module")
def one_process_kills(refs, tmp_path_factory):
    """The one-process cases, each killed at its own random step and restarted as kill_and_resume does, all side by
    side with their references (a one-process run leaves a core idle while it starts, imports and saves):
    name -> (output dir, (restart, resume step, note) or the case's AssertionError)."""
    root = str(tmp_path_factory.mktemp("one_process_kills"))
    procs = Procs(root)
    cases = {}
    for name in ONE_PROCESS:
        options, ranks = SETUPS[name]
        refs.start(name)
        config, out = write_config(root, name, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, **options)
        cases[name] = (config, out, ranks, seeded_rng(name), f"{name}-restart")
    try:
        results = kill_and_restart_side_by_side(procs, cases)
        yield {name: (cases[name][1], results[name]) for name in ONE_PROCESS}
    finally:
        procs.cleanup()


def one_process_kill_and_resume(refs: References, one_process_kills, name: str) -> None:
    out, result = one_process_kills[name]
    if isinstance(result, AssertionError):
        raise result
    restart, resume_step, note = result
    assert_resumed_like_the_reference(refs, name, out, restart, resume_step, note)


# ------------------------------------------------------------------------------------------------- (a) one process
@pytest.mark.timeout(900)     # the first one-process case waits for all four
def test_sigkill_at_random_step_resumes_exactly(refs, one_process_kills):
    one_process_kill_and_resume(refs, one_process_kills, "single")


# ------------------------------------------------------------------------ (c) SIGKILL while a checkpoint is written
CUTS = {"first-checkpoint": SAVE_STEPS, "second-checkpoint": 2 * SAVE_STEPS}


def test_sigkill_while_checkpoint_is_written_uses_previous_checkpoint(procs, refs, tmp_path):
    """Rank 0 sleeps between the sidecars and the manifest (tests/_support/slow_manifest_train.py); the kill lands there. The restart removes the
    incomplete checkpoint and resumes from the one before it (or, killed in the first one, starts over).
    ``save_total_limit: 1`` also checks that the previous checkpoint is not rotated away before the new
    one is complete. Both cases (killed in the first checkpoint, in the second) in one test: their one-rank runs
    go side by side on the 2 cores (the second's sleep in its first checkpoint is the first's time to train); each
    message names its case (``checkpoint=`` in the note)."""
    name, (options, ranks) = "single", SETUPS["single"]
    refs.start(name)
    cases = {}
    for case, cut in CUTS.items():
        note = seed_note("kill-during-checkpoint", checkpoint=cut)
        config, out = write_config(str(tmp_path), f"midsave-{case}", max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                                   save_total_limit=1, **options)
        state_dir = os.path.join(checkpoint_path(out, cut), STATE_DIR)
        run = procs.start(config, f"midsave-{case}-killed", script=SLOW_MANIFEST_TRAIN)
        cases[case] = (cut, note, config, out, state_dir, run)

    restarts = {}
    for case, (cut, note, config, out, state_dir, run) in cases.items():
        previous = cut - SAVE_STEPS
        rank_file = os.path.join(state_dir, "rank-00000.safetensors")
        run.wait_until(lambda rank_file=rank_file: os.path.isfile(rank_file),
                       f"checkpoint-{cut}/{STATE_DIR}/rank-00000.safetensors {note}")
        run.kill()
        assert run.proc.returncode == -signal.SIGKILL, f"not killed (exit {run.proc.returncode}) {note}"
        assert not os.path.exists(os.path.join(state_dir, MANIFEST)), \
            f"the manifest was written before the kill; slow_manifest_train.py did not delay it {note}"
        assert os.path.isfile(os.path.join(checkpoint_path(out, cut), "trainer_state.json")), note
        assert complete_checkpoints(out) == ([previous] if previous else []), \
            f"expected complete checkpoints {[previous] if previous else []} (the previous one kept until the new " \
            f"one is complete), found checkpoints {checkpoint_steps(out)}, complete {complete_checkpoints(out)} {note}"
        restarts[case] = procs.start(config, f"midsave-{case}-restart")

    for case, (cut, note, _, out, _, _) in cases.items():
        previous = cut - SAVE_STEPS
        restart = restarts[case].wait_ok()
        assert f"removing incomplete checkpoint {checkpoint_path(out, cut)}" in restart.stderr, \
            f"restart did not report removing the incomplete checkpoint {note}\n{restart.describe()}"
        if previous:
            assert_resumed_from(restart, out, previous, note)
        else:
            assert "resuming from" not in restart.stderr, f"nothing to resume from, yet {note}\n{restart.describe()}"
            assert printed_steps(restart) == MAX_STEPS, f"the restart must train from step 1 {note}"
        assert_same_training(refs.get(name), out, ranks, note)
        assert checkpoint_steps(out) == [MAX_STEPS] and is_complete(out, MAX_STEPS), \
            f"checkpoints after the restart: {checkpoint_steps(out)} {note}"


# ---------------------------------------------------------------- explicit resume_from_checkpoint: refused if partial
def test_explicit_resume_from_incomplete_checkpoint_is_refused(procs, refs, tmp_path):
    ref_out = refs.get("single")
    source = checkpoint_path(ref_out, complete_checkpoints(ref_out)[-1])
    no_manifest = str(tmp_path / "no-manifest" / "checkpoint-60")
    no_state = str(tmp_path / "no-state" / "checkpoint-60")
    shutil.copytree(source, no_manifest)
    os.remove(os.path.join(no_manifest, STATE_DIR, MANIFEST))
    shutil.copytree(source, no_state)
    shutil.rmtree(os.path.join(no_state, STATE_DIR))

    cases = {}
    for label, checkpoint, env in [("no-manifest", no_manifest, None), ("no-state", no_state, None),
                                   ("no-manifest-debug", no_manifest, {"RESUMABLE_STREAM_DEBUG": "1"})]:
        config, out = write_config(str(tmp_path), f"explicit-{label}", max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                                   resume_from_checkpoint=checkpoint, **SETUPS["single"][0])
        cases[label] = (procs.start(config, f"explicit-{label}", env=env), out, checkpoint)
    for label, (run, out, checkpoint) in cases.items():
        rc = run.wait()
        err = run.stderr
        assert rc not in (0, None), f"{label}: resuming from {checkpoint} was not refused\n{run.describe()}"
        assert checkpoint in err, f"{label}: the error does not name the checkpoint {checkpoint}\n{run.describe()}"
        assert not os.path.exists(train_log(out)) and not checkpoint_steps(out), f"{label}: it trained anyway"
        if label == "no-state":
            assert STATE_DIR in err, f"{label}: the error does not name {STATE_DIR}/\n{run.describe()}"
        else:
            assert MANIFEST in err, f"{label}: the error does not name {MANIFEST}\n{run.describe()}"
        if label.endswith("-debug"):
            assert "Traceback" in err, f"{label}: RESUMABLE_STREAM_DEBUG=1 shows no traceback\n{run.describe()}"
        else:
            assert rc == 2, f"{label}: exit {rc}, expected 2 (a resumable-stream error)\n{run.describe()}"
            assert "Traceback" not in err, f"{label}: a traceback without --debug\n{run.describe()}"
            assert "resumable-stream: error:" in err, f"{label}: not the one-line error\n{run.describe()}"


# ------------------------------------------------------------------------------------- restarting a finished run
def test_restarting_a_finished_run_trains_nothing_more(procs, refs, tmp_path):
    """A kill after the final checkpoint (or a rerun of a finished job) must not train past max_steps.

    Fails with transformers 5.24: resuming an IterableDataset run from checkpoint-<max_steps> trains one
    more step (num_train_epochs is sys.maxsize, and should_training_stop is only checked after a step);
    the patched ``train`` (integrations/transformers/patch.py ``_train``) should return without training instead."""
    ref_out = refs.get("single")
    config, out = write_config(str(tmp_path), "finished", max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                               **SETUPS["single"][0])
    shutil.copytree(ref_out, out)
    restart = procs.start(config, "finished-restart").wait_ok()
    assert printed_steps(restart) == 0 and checkpoint_steps(out)[-1] == MAX_STEPS, \
        f"restarting a run finished at max_steps={MAX_STEPS} trained {printed_steps(restart)} more step(s); " \
        f"checkpoints now {checkpoint_steps(out)}, train log steps {sorted(train_losses(out))[-3:]}"
    assert_same_training(ref_out, out, 1, "[restart of a finished run]")


# ------------------------------------------------------------------ (d) packing, and packing with 2 DataLoader workers
@pytest.mark.timeout(900)     # run first alone (-k): waits for all four one-process cases
@pytest.mark.parametrize("name", ["packing", "packing-workers2", "packing-neat"])
def test_sigkill_resumes_exactly_with_packing_and_workers(refs, one_process_kills, name):
    """packing-neat: data.packing_mode neat, whose carry holds document boundaries, and whose losses would
    differ if the resumed blocks' position ids (documents) differed."""
    one_process_kill_and_resume(refs, one_process_kills, name)


# ------------------------------------------------------------------------------------- (b) torchrun, 2 gloo ranks
@pytest.mark.parametrize("name", ["ddp", "ddp-packing"])
def test_sigkill_torchrun_two_ranks_resumes_exactly(procs, refs, tmp_path, name):
    """Also one model for both ranks (assert_same_training: assert_data_parallel), with and without packing."""
    kill_and_resume(procs, refs, tmp_path, name)
    if name == "ddp-packing":   # packed rows span steps and epochs; the split is checked without packing
        return
    # the ranks split the data: within the first epoch (2 x 320 of 4000 rows) no row is read twice
    ref_out = refs.get(name)
    per_rank = []
    for rank in range(2):
        keys = [k for step in sorted(consumed(ref_out, rank)) for k in consumed(ref_out, rank)[step]]
        assert len(keys) == MAX_STEPS * BATCH, f"rank {rank}: {len(keys)} samples"
        assert len(set(keys)) == len(keys), f"rank {rank} read a row twice within the first epoch"
        per_rank.append(set(keys))
    both = per_rank[0] & per_rank[1]
    assert not both, f"ranks 0 and 1 both read rows {sorted(both)[:10]}"


def test_torchrun_two_ranks_sft_trains_one_model(procs, tmp_path):
    """format messages (examples/tiny/train_sft.yaml) on 2 gloo ranks: one model, the logged loss the ranks'
    mean; data.eval evaluated on both ranks (each its own share of num_samples) at steps 3 and 6."""
    sft = os.path.join(TINY, "data_sft", "*.parquet")
    config, out = write_config(str(tmp_path), "sft", max_steps=6, save_steps=6, template="train_sft.yaml",
                               data={"data_files": sft, "eval": {"data_files": sft, "num_samples": 16}},
                               eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4)
    procs.start(config, "sft", nproc=2).wait_ok()
    assert sorted(train_losses(out)) == list(range(1, 7))
    assert_data_parallel(out, 2)
    # the data path's figures of every rank, gathered into the main process's log line of each step
    for rec in (r for r in train_log_records(out) if "loss" in r):
        ranks = rec["data_ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["batches"] == 1 for r in ranks), rec
        assert rec["data_batches"] == 2 and rec["data_samples_per_s"] > 0 and 0 <= rec["data_wait_share"] <= 1
        assert rec["data_epoch"] == pytest.approx(sum(r["epoch"] for r in ranks) / 2, abs=1e-6)
        assert rec["data_epoch"] > 0 and rec["epoch"] is not None
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        evals = {r["step"]: r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r}
    assert sorted(evals) == [3, 6] and evals[3] != evals[6], evals
