"""A mixture whose weights change (a schedule, and changes made from code) in a real training: torchrun, SIGKILL,
restart (moved here from tests/stream/test_mixture_changes.py, which tests the schedules and changes in process)."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from training_helpers import (
    TINY,
    Procs,
    complete_checkpoints,
    consumed,
    count_lines,
    free_port,
    train_log_records,
    train_losses,
    write_config,
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_two_ranks_with_workers_and_packing_resume_a_ramp_and_code_changes_exactly_after_sigkill(tmp_path):
    """examples/online_mixing.py on examples/tiny/train_mix.yaml with a ramp (notes 0.1 -> 0.9 over 18 steps) and
    the callback reweighting at steps 9 and 18: 2 gloo ranks, a DataLoader worker each, packing. SIGKILLed once
    checkpoint-6 is complete (inside the ramp, before the first change from code), restarted, SIGKILLed again
    after checkpoint-12 (after that change), restarted: every step's sample keys on both ranks, losses and the
    logged changes equal an uninterrupted run's."""
    max_steps, save_steps = 18, 6
    script = os.path.join(os.path.dirname(TINY), "online_mixing.py")
    sources = [{"label": "lm", "dataset_name_or_path": "parquet", "data_files": os.path.join(TINY, "data", "*.parquet"),
                "weight": 1.0},
               {"label": "notes", "dataset_name_or_path": "parquet",
                "data_files": os.path.join(TINY, "data_notes", "*.parquet"),
                "weight": {"schedule": "linear", "unit": "steps", "points": [[0, 0.1], [18, 0.9]]}}]
    procs = Procs(str(tmp_path))

    def command(config):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), script, config, "--every", "9"]

    try:
        runs = {}
        for name in ("ref", "run"):
            runs[name] = write_config(str(tmp_path), name, max_steps=max_steps, save_steps=save_steps, packing=True,
                                      workers=1, template="train_mix.yaml", data={"sources": sources},
                                      per_device_train_batch_size=4)
        ref = procs.start(runs["ref"][0], "ref", command=command(runs["ref"][0]))
        run = procs.start(runs["run"][0], "run", command=command(runs["run"][0]))
        out = runs["run"][1]
        log = os.path.join(out, "train_log.jsonl")
        run.wait_until(lambda: count_lines(log) >= 7 and complete_checkpoints(out), "step 7 and checkpoint-6",
                       timeout=600)
        run.kill()
        assert run.proc.returncode == -signal.SIGKILL and count_lines(log) < 9, run.describe()
        assert complete_checkpoints(out)[-1] == 6
        # killed again after checkpoint-12, which holds the change made from code at step 9
        again = procs.start(runs["run"][0], "restart", command=command(runs["run"][0]))
        again.wait_until(lambda: count_lines(log) >= 13 and complete_checkpoints(out)[-1:] == [12],
                         "step 13 and checkpoint-12", timeout=600)
        again.kill()
        assert count_lines(log) < 18, again.describe()
        procs.start(runs["run"][0], "restart2", command=command(runs["run"][0])).wait_ok(timeout=600)
        ref.wait_ok(timeout=600)
        ref_out = runs["ref"][1]
        for rank in (0, 1):
            assert consumed(out, rank) == consumed(ref_out, rank), rank
        ref_losses, losses = train_losses(ref_out), train_losses(out)
        assert sorted(losses) == list(range(1, max_steps + 1))
        assert all(abs(ref_losses[s] - losses[s]) <= 1e-6 for s in ref_losses)

        def changes(directory):
            return {r["step"]: r["mixture_changes"] for r in train_log_records(directory) if "mixture_changes" in r}

        assert changes(out) == changes(ref_out) and sorted(changes(out)) == [9, 18]
        # the ramp is followed: notes' share of the samples grows from the first third to the second
        keys = [consumed(out, r) for r in (0, 1)]

        def share(steps):
            got = [k.split("/")[0] for r in keys for s in steps for k in r[s]]
            return got.count("notes") / len(got)

        assert share(range(1, 7)) < share(range(7, 10))
    finally:
        procs.cleanup()
