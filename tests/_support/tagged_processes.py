"""Every process of a run, found by an environment tag, killed at once (no third-party package needed: the
venvs of .ci/ run it too).

torchrun starts each rank in a session of its own, so killing the launcher's process group leaves the ranks (and
their DataLoader workers) running. A run started with ``RS_TEST_RUN=<tag>`` in its environment passes the tag to
every process it starts; :func:`kill_tagged` freezes them all (SIGSTOP: no rank sees another die and reacts),
then SIGKILLs them.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

TAG = "RS_TEST_RUN"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged(tag: str) -> list[int]:
    """Pids of the live processes whose environment holds ``RS_TEST_RUN=tag``."""
    needle = f"{TAG}={tag}".encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    with open(f"/proc/{name}/stat", "rb") as s:
                        if s.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                            found.append(int(name))
        except OSError:
            continue
    return found


def kill_tagged(tag: str, timeout: float = 30) -> None:
    """SIGSTOP, then SIGKILL, every process of the run, until none is left (or ``timeout``)."""
    frozen: set[int] = set()
    for _ in range(10):                     # until no new process appears (a worker forked meanwhile)
        new = [p for p in tagged(tag) if p not in frozen]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            frozen.add(pid)
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
