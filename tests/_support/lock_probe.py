"""Another process taking or trying an output_dir lock, for the lock tests.

    python tests/_support/lock_probe.py try DIR         exit 0 if it got the lock, 3 (the refusal on stderr) if not
    python tests/_support/lock_probe.py hold DIR        takes it, prints "held", sleeps until killed
    python tests/_support/lock_probe.py hold-fork DIR   the same, after forking a child that keeps a copy of the
                                               descriptor (as DataLoader workers do); prints "held CHILD_PID"

It imports the lock module alone, not the package (whose torch imports cost a second per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
REFUSED = 3


def start_holder(directory: str, fork: bool = False) -> tuple[subprocess.Popen, int | None]:
    """A process holding ``directory``'s lock (and its forked child's pid with ``fork``), once it holds it."""
    proc = subprocess.Popen([sys.executable, __file__, "hold-fork" if fork else "hold", directory],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[:1] == ["held"], f"the holder did not take the lock (exit {proc.poll()})"
    return proc, int(line[1]) if fork else None


def try_lock(directory: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, "try", directory], capture_output=True, text=True, timeout=60)


def _lock_module():
    import importlib
    import types

    package = types.ModuleType("resumable_stream")
    package.__path__ = [os.path.join(ROOT, "resumable_stream")]
    sys.modules["resumable_stream"] = package
    return importlib.import_module("resumable_stream.runtime.output_lock")


def main(mode: str, directory: str) -> int:
    lock = _lock_module()
    try:
        with lock.output_dir_lock(directory):
            if mode == "try":
                return 0
            child = os.fork() if mode == "hold-fork" else None
            if child == 0:
                time.sleep(600)
                os._exit(0)
            print("held", child or "", flush=True)
            time.sleep(600)
    except lock.OutputDirLockedError as e:
        print(e, file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
