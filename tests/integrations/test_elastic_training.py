"""Elastic resume of real training: torchrun (gloo) writes checkpoint-12 on W ranks, training resumes from it
on W' ranks, and across the change every sample of epoch 0 is consumed exactly once.

Without ``data.elastic`` the same change (checked for 2 -> 1) is refused with a message that says how to allow it.

The data is 6 parquet files of 96 rows (6 shards) read as ``data.num_partitions: 6`` virtual partitions, so
each partition holds one shard: 12 batches of 8 rows. Every rank rotates over its partitions batch by batch,
so after ``CKPT`` steps each partition of the first run consumed the same number of batches, and the resumed
run is given exactly the steps that finish epoch 0 of every partition: the consumed logs (``id`` keys) of
both runs together must then hold each of the 576 rows exactly once. A partition restarted from its epoch
start would show duplicates, one skipped ahead would show missing rows.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from training_helpers import (
    assert_data_parallel,
    checkpoint_path,
    complete_checkpoints,
    consumed,
    train_losses,
    write_config,
)

from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.slow

FILES, ROWS_PER_FILE, BATCH = 6, 96, 8       # BATCH: per_device_train_batch_size of the tiny yaml
PARTITIONS = FILES
CKPT = 12


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic_data")
    write_parquet_dataset(str(d), rows=FILES * ROWS_PER_FILE, files=FILES, row_group_size=ROWS_PER_FILE)
    return str(d)


def _steps_to_finish_epoch(before: int, after: int) -> int:
    """Steps after CKPT that consume exactly the rest of epoch 0 on ``after`` ranks."""
    batches = ROWS_PER_FILE // BATCH                       # per partition and epoch
    done = CKPT * before // PARTITIONS                     # per partition, before the change
    return PARTITIONS // after * (batches - done)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [((2, 0), (1, 2)), ((1, 0), (2, 0)), ((2, 0), (3, 0))],
                         ids=["2to1-workers0to2", "1to2", "2to3"])
def test_torchrun_resumes_on_another_world_size_reading_each_sample_once(procs, tmp_path, data_dir, before,
                                                                          after):
    (w0, k0), (w1, k1) = before, after
    total = CKPT + _steps_to_finish_epoch(w0, w1)
    data = {"data_files": os.path.join(data_dir, "*.parquet"), "num_partitions": PARTITIONS, "elastic": True,
            "buffer_size": 256}
    first, out = write_config(str(tmp_path), "run", max_steps=CKPT, save_steps=CKPT, workers=k0, data=data)
    procs.start(first, "first", nproc=w0).wait_ok()
    assert complete_checkpoints(out) == [CKPT]
    if w0 > 1:
        assert_data_parallel(out, w0)   # one model on all ranks

    if w1 == 1:   # without data.elastic the change is refused, saying how to allow it
        refused, _ = write_config(str(tmp_path), "run", max_steps=total, save_steps=CKPT, workers=k1,
                                  data={**data, "elastic": False})
        run = procs.start(refused, "refused")
        assert run.wait() == 2, run.describe()
        assert "data.elastic: true" in run.stderr and "world_size: saved 2, now 1" in run.stderr, run.describe()
        assert complete_checkpoints(out) == [CKPT]
    second, out2 = write_config(str(tmp_path), "run", max_steps=total, save_steps=CKPT, workers=k1, data=data)
    assert out2 == out
    run = procs.start(second, "resumed", nproc=w1).wait_ok()
    assert f"resuming from {checkpoint_path(out, CKPT)}" in run.stderr, run.describe()
    if w1 > 1:
        assert_data_parallel(out, w1)

    keys = []
    for rank in range(max(w0, w1)):
        steps = consumed(out, rank)
        expected = list(range(1, CKPT + 1)) if rank < w0 else []
        expected += list(range(CKPT + 1, total + 1)) if rank < w1 else []
        assert sorted(steps) == expected, f"rank {rank} logged steps {sorted(steps)}"
        assert all(len(v) == BATCH for v in steps.values())
        keys += [k for v in steps.values() for k in v]
    counts = Counter(int(k) for k in keys)
    twice = sorted(k for k, c in counts.items() if c > 1)
    missing = sorted(set(range(FILES * ROWS_PER_FILE)) - set(counts))
    assert not twice and not missing, f"{before} -> {after}: read twice {twice[:10]}, never read {missing[:10]}"
    assert sorted(train_losses(out)) == list(range(1, total + 1))
