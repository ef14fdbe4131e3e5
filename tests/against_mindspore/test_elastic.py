"""data.elastic_determinism with MindSpore's adapter: a data-parallel MindSpore job (tests/against_mindspore/
ms_elastic_train.py: one MindSporeSource per rank, each step one micro-batch of every one of the 12 partitions)
SIGKILLed on 2 ranks after step 4, resumed on 1 rank and SIGKILLed after step 7, resumed on 3 ranks to step 10,
trains every step on the samples of the uninterrupted one-rank run, with its losses up to the order of the float
additions; packed, and the partitions pass epoch ends (about every 3 steps). A gradient accumulation that takes
fewer than every partition per step is refused by the adapter, naming its argument."""

import json
import os
import sys

import ms_helpers
import pytest
from training_helpers import count_lines

from resumable_stream import ConfigError, ResumableStream
from resumable_stream.testing import write_parquet_dataset

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ms_elastic_train.py")
STEPS = 10


def _run(procs, out, data, label, ranks):
    return procs.start(out, label, command=[sys.executable, SCRIPT, out, data, "--ranks", str(ranks),
                                            "--steps", str(STEPS)])


def _steps(out):
    with open(os.path.join(out, "steps.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    steps = {r["step"]: r for r in records}
    assert len(steps) == len(records), "a step logged twice"
    return steps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_and_resumed_on_other_ranks_trains_the_identical_steps(procs, tmp_path, record_property):
    data = str(tmp_path / "data")
    write_parquet_dataset(data, rows=144, files=12, row_group_size=6)
    ref_out, out = str(tmp_path / "reference"), str(tmp_path / "run")
    _run(procs, ref_out, data, "reference", 1).wait_ok(300)
    os.makedirs(out)
    for ranks, kill_after in ((2, 4), (1, 7)):
        run = _run(procs, out, data, f"ranks{ranks}", ranks)
        run.wait_until(lambda: count_lines(os.path.join(out, "steps.jsonl")) >= kill_after,  # noqa: B023
                       f"step {kill_after} logged")
        run.kill()
    run = _run(procs, out, data, "ranks3", 3).wait_ok(300)
    assert "resumed from" in run.stdout and "on 3 ranks" in run.stdout, run.describe()
    reference, got = _steps(ref_out), _steps(out)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    assert [got[s]["ranks"] for s in sorted(got)] == [2, 2, 2, 1, 1, 1, 3, 3, 3, 3]
    for step in reference:
        assert got[step]["keys"] == reference[step]["keys"], f"step {step}: other samples than the uninterrupted run"
        assert len(got[step]["keys"]) >= 12 * 2
    worst = max(abs(got[s]["loss"] - reference[s]["loss"]) / reference[s]["loss"] for s in reference)
    record_property("figure", f"MindSpore, 2 -> 1 -> 3 ranks: largest relative loss difference {worst:.2e}")
    assert worst <= 1e-4


def test_the_adapter_refuses_an_accumulation_that_skips_partitions():
    from resumable_stream.integrations.mindspore import MindSporeSource

    tok = ms_helpers.tokenizer()
    stream = ResumableStream(ms_helpers.stream_config(num_partitions=4), rank=0, world_size=2)
    make = lambda steps: MindSporeSource(stream, 2, ms_helpers.COLUMNS,  # noqa: E731
                                         lambda ex: ms_helpers.collate_numpy(ex, tok.pad_token_id),
                                         ms_helpers.processor_factory(tok), gradient_accumulation_steps=steps)
    with pytest.raises(ConfigError) as e:
        make(1)
    assert str(e.value).startswith("MindSporeSource(gradient_accumulation_steps): got 1 on 2 rank(s) x num_workers 0 "
                                   "with data.num_partitions 4")
    assert "a multiple of num_partitions / ranks = 2" in str(e.value)
    assert make(4).micro_batches_per_step == 2
