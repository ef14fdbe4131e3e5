"""The output_dir lock on its own: one holder at a time across processes, named to whoever is refused; a
killed holder's lock is free at once; re-entrant in the holding thread only."""

import json
import os
import signal
import socket
import threading

import pytest
from lock_probe import REFUSED, start_holder, try_lock

from resumable_stream.errors import ConfigError, OutputDirLockedError
from resumable_stream.runtime import output_lock
from resumable_stream.runtime.output_lock import LOCK_FILE, output_dir_lock
from resumable_stream.state.output_dir import checkpoint_dirs


def _kill(proc) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_a_second_process_is_refused_with_the_holder_and_takes_over_once_it_is_killed(tmp_path):
    out = str(tmp_path / "out")
    holder, _ = start_holder(out)
    try:
        refused = try_lock(out)
        assert refused.returncode == REFUSED, refused.stderr
        message = refused.stderr
        assert repr(out) in message and f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "started 20" in message and LOCK_FILE in message
        with pytest.raises(OutputDirLockedError, match=f"pid {holder.pid} "):   # this process too
            with output_dir_lock(out):
                pass
    finally:
        _kill(holder)
    assert holder.returncode == -signal.SIGKILL
    # the killed holder's details are still in the file, but the lock went with the process
    assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["pid"] == holder.pid
    with output_dir_lock(out):
        assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert try_lock(out).returncode == REFUSED
    assert try_lock(out).returncode == 0, "not released when the block ended"
    assert checkpoint_dirs(out) == [], "the lock file is not a checkpoint"


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path):
    """DataLoader workers are forked from the holder; one outliving a SIGKILLed holder must not hold the
    lock (the restart would be refused naming a dead process)."""
    out = str(tmp_path / "out")
    holder, child = start_holder(out, fork=True)
    try:
        _kill(holder)
        os.kill(child, 0)                       # the child still runs, with its copy of the descriptor
        assert try_lock(out).returncode == 0, "the forked child kept the lock of its killed parent"
    finally:
        os.kill(child, signal.SIGKILL)


def test_nested_in_the_holding_thread_and_refused_to_another_thread(tmp_path):
    out = str(tmp_path / "out")
    errors = []

    def other_thread():
        try:
            with output_dir_lock(out):
                pass
        except OutputDirLockedError as e:
            errors.append(str(e))

    with output_dir_lock(out):
        with output_dir_lock(out):           # e.g. run_training holds it around the patched train()
            pass
        assert try_lock(out).returncode == REFUSED, "the inner block released the outer one's lock"
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and f"pid {os.getpid()} " in errors[0] and "another thread" in errors[0]
    with output_dir_lock(out):               # a following run in the same process
        pass


def test_an_output_dir_that_cannot_hold_the_lock_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "out")
    with pytest.raises(ConfigError, match=f"output_dir {out!r}: cannot create the lock file"):
        with output_dir_lock(out):
            pass


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_dir_is_a_config_error(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="Permission denied"):
            with output_dir_lock(str(out)):
                pass
    finally:
        out.chmod(0o755)


def test_a_refused_start_leaves_no_directory_holding_only_the_lock(tmp_path):
    """What the block created it takes away when nothing else was written; anything else stays."""
    out = tmp_path / "runs" / "a"
    with pytest.raises(ConfigError):          # e.g. a model that does not load, after the lock was taken
        with output_dir_lock(str(out)):
            assert (out / LOCK_FILE).exists()
            raise ConfigError("model.tokenizer: cannot be loaded")
    assert os.listdir(tmp_path) == [], "the directories the lock made are left behind"

    given = tmp_path / "given"                # a directory the user made: kept, without our lock file
    given.mkdir()
    with output_dir_lock(str(given)):
        pass
    assert given.is_dir() and os.listdir(given) == []

    with output_dir_lock(str(out)):           # something written: everything stays
        (out / "train_log.jsonl").write_text("{}\n")
    assert sorted(os.listdir(out)) == [LOCK_FILE, "train_log.jsonl"]
    os.remove(out / "train_log.jsonl")
    with output_dir_lock(str(out)):           # a lock file from an earlier job is never removed
        pass
    assert os.listdir(out) == [LOCK_FILE]


def test_a_lock_file_unlinked_while_it_is_being_locked_is_opened_again(tmp_path, monkeypatch):
    """The lock another job takes on a file that was just unlinked (its cleanup) is not the directory's: the
    taker opens the name again and locks the file the name leads to."""
    out = tmp_path / "out"
    real_flock, unlinked = output_lock.fcntl.flock, []

    def flock_after_a_cleanup(fd, op):
        if not unlinked:
            os.unlink(out / LOCK_FILE)
            unlinked.append(os.fstat(fd).st_ino)
        return real_flock(fd, op)

    monkeypatch.setattr(output_lock.fcntl, "flock", flock_after_a_cleanup)
    with output_dir_lock(str(out)):
        (out / "checkpoint-1").mkdir()
        assert unlinked
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()   # written to the named file
        assert try_lock(str(out)).returncode == REFUSED, "the lock held is not the one the name leads to"
