"""One training job per output directory (docs/training.md, "One job per output_dir"): rank 0 holds a ``flock`` on
``<output_dir>/.resumable-stream.lock``, which the kernel drops however the process dies, and broadcasts its
outcome. A lock lives on an inode: the file is never replaced, only removed (with the directories it made) by the
job that created it and left nothing else, and a job that takes a lock checks that the name still leads to it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import datetime, timezone

from ..errors import ConfigError, OutputDirLockedError, ResumableStreamError
from .collectives import broadcast_bytes, shared_over_dist

LOCK_FILE = ".resumable-stream.lock"
log = logging.getLogger(__name__)

# output dirs this process holds (realpath -> (descriptor or None off rank 0, holding thread)): a nested
# train() in the same thread (run_training -> the patched train) continues under the outer lock
_HELD: dict[str, tuple[int | None, int]] = {}
_ERRORS = {cls.__name__: cls for cls in (ConfigError, OutputDirLockedError)}
# a filesystem that cannot lock (some NFS / FUSE mounts): train unlocked, with a warning
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


@contextlib.contextmanager
def output_dir_lock(output_dir: str, rank: int = 0, world_size: int = 1) -> Iterator[None]:
    """Hold ``output_dir`` for this job while the block runs (created if missing); every rank enters, rank 0 locks.
    :class:`OutputDirLockedError` naming the holder, :class:`ConfigError` when not writable."""
    key = os.path.realpath(output_dir)
    held = _HELD.get(key)
    if held is not None:
        if held[1] != threading.get_ident():
            raise OutputDirLockedError(_refusal(output_dir, {"pid": os.getpid(), "host": socket.gethostname()},
                                                 " (this process, another thread)"))
        yield     # nested in the same thread: the outer block holds it and releases it
        return
    made = _missing_dirs(output_dir) if rank == 0 else []
    lock_was_there = os.path.lexists(os.path.join(output_dir, LOCK_FILE))
    entry = (_take_for_job(output_dir, rank, world_size), threading.get_ident())
    _HELD[key] = entry
    try:
        yield
    finally:
        # a forked child unwinding this block holds nothing (see _forget_in_child): only the holder releases
        if _HELD.get(key) is entry:
            del _HELD[key]
            if entry[0] is not None:
                if not lock_was_there:
                    _remove_if_unused(output_dir, made)
                _release(entry[0])


def _missing_dirs(output_dir: str) -> list[str]:
    """The directories of ``output_dir`` that do not exist yet, deepest first (the lock creates them)."""
    missing, path = [], os.path.abspath(output_dir)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_if_unused(output_dir: str, made: list[str]) -> None:
    """A job that leaves nothing but the lock file it created (its start was refused) takes it away, with
    the directories it made, so that no output_dir holds only a lock. Called while the lock is still held."""
    try:
        if os.listdir(output_dir) != [LOCK_FILE]:
            return
        os.unlink(os.path.join(output_dir, LOCK_FILE))
        for path in made:            # deepest first; one that another process wrote into stays
            os.rmdir(path)
    except OSError:
        pass


def _take_for_job(output_dir: str, rank: int, world_size: int) -> int | None:
    """Rank 0 takes the lock and tells the other ranks how it went; they raise what it raised."""
    shared = shared_over_dist(rank, world_size)
    if rank != 0:
        if shared:
            outcome = json.loads(broadcast_bytes(None))
            if "error" in outcome:
                cls = _ERRORS.get(outcome["error"]["type"], ResumableStreamError)
                raise cls(f"rank 0: {outcome['error']['message']}")
        return None
    try:
        fd = _take(output_dir)
    except Exception as e:
        if shared:
            broadcast_bytes(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}).encode())
        raise
    if shared:
        broadcast_bytes(b"{}")
    return fd


def _take(output_dir: str) -> int | None:
    for _ in range(100):     # the file was unlinked between our open and our lock: open the name again
        fd = _take_once(output_dir)
        if fd is None or _still_named(fd, os.path.join(output_dir, LOCK_FILE)):
            return fd
        os.close(fd)
    raise ConfigError(f"output_dir {output_dir!r}: its lock file {LOCK_FILE} keeps being removed and created "
                      "again; another program is cleaning the directory")


def _still_named(fd: int, path: str) -> bool:
    try:
        named, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _take_once(output_dir: str) -> int | None:
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise ConfigError(f"output_dir {output_dir!r}: cannot create the lock file {LOCK_FILE} in it ({e.strerror}); "
                          "training writes its checkpoints there: give it a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise OutputDirLockedError(_refusal(output_dir, holder)) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_LOCKS:
            raise ConfigError(f"output_dir {output_dir!r}: cannot lock {path} ({e.strerror})") from None
        log.warning("output_dir %s: its filesystem cannot lock files (%s); training without the one-job-per-"
                    "output_dir lock: make sure no other job writes there", output_dir, e.strerror)
        return None
    _write_holder(fd, output_dir)
    return fd


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)    # the holder's details go with the lock: a free lock names nobody
    os.close(fd)               # drops the flock


def _write_holder(fd: int, output_dir: str) -> None:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
              "job": job if job and job != "none" else None, "output_dir": os.path.abspath(output_dir)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)           # on a shared filesystem, so that another node's job can read it


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _refusal(output_dir: str, holder: dict, note: str = "") -> str:
    if holder.get("pid") is not None:
        who = f"pid {holder['pid']} on host {holder.get('host', '?')}{note}"
        if holder.get("started"):
            who += f", started {holder['started']}"
        if holder.get("job"):
            who += f", job {holder['job']}"
    else:
        who = "a job that has not written its details yet (it is starting)"
    return (f"output_dir {output_dir!r} is in use by another training job: {who} (lock file {LOCK_FILE} in it). "
            "Two jobs writing one output_dir would mix their checkpoints and logs; wait for that job to end or "
            "stop it, or give this one another output_dir")


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock descriptors: the lock then ends with
    its holder, not with the last child that outlives a killed holder. Closing a copy does not unlock."""
    for fd, _ in _HELD.values():
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)
