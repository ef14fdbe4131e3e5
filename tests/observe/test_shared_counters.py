"""The rank's shared data-path counters (observe.metrics.SharedCounters): every process's additions count,
forked and spawned workers alike, and a SIGKILLed process leaves nothing for multiprocessing's resource
tracker to report (it used to print "resource_tracker: There appear to be 1 leaked semaphore objects")."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest
from counter_probe import add_many
from repo_paths import SUPPORT_DIR

from resumable_stream.observe.metrics import SOURCE_COUNTERS, SharedCounters
from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])   # spawn: ~6 s of CPU
def test_additions_of_every_process_count(method):
    counters = SharedCounters(SOURCE_COUNTERS)
    workers = [multiprocessing.get_context(method).Process(target=add_many, args=(counters, 2000))
               for _ in range(2)]
    for w in workers:
        w.start()
    add_many(counters, 2000)                  # this process at the same time
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    got = counters.snapshot()
    assert (got["requests"], got["bytes_read"]) == (6000, 12000)


def test_a_sigkilled_reader_with_forked_workers_leaves_no_leaked_semaphore_warning(tmp_path):
    """`kill -9` of the main process only (as a user does): its workers and any resource tracker stay and
    end on their own, writing into the same stderr, which is read until every one of them closed it."""
    write_parquet_dataset(str(tmp_path), rows=400, files=2, row_group_size=50)
    proc = subprocess.Popen([sys.executable, os.path.join(SUPPORT_DIR, "counter_probe.py"),
                             str(tmp_path / "*.parquet"), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready") and int(ready.split()[1]) > 0, ready   # the workers counted row groups
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert "resource_tracker" not in err and "leaked" not in err, err
