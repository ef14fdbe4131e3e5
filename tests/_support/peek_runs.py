"""Helper of test_cli's exit tests: ``python peek_runs.py N K OUT_DIR peek ARGS...`` runs the CLI N times, K at
a time, each in a process forked from this one after the imports (a run then costs its own work, not the
imports; the imported objects are moved out of the collector's reach first, see main), each ending with the interpreter's normal teardown (atexit, finalization, native destructors).
Run i writes its stdout to OUT_DIR/i.out and stderr to OUT_DIR/i.err. Prints ``{"exit_codes": [...]}``.
``... OUT_DIR plain CONFIG NUM`` reads NUM samples of a ResumableStream instead and leaves it unclosed."""

import atexit
import gc
import importlib
import json
import os
import sys

import pyarrow.parquet  # noqa: F401  (imported once, before the forks; every peek of parquet imports them)
import torch  # noqa: F401

from resumable_stream.app import cli


def plain(config: str, num: int) -> int:
    import itertools

    from resumable_stream import ResumableStream, StreamConfig

    for row in itertools.islice(ResumableStream(StreamConfig.from_yaml(config)), num):
        print(json.dumps({"id": row["id"]}))
    return 0


def fork_run(i: int, out_dir: str, argv: list[str], report_imports_to: int | None = None) -> int:
    """Starts run i in a forked child; returns its pid. With `report_imports_to` (a pipe's write end) the child
    writes, at the very end of its atexit, the names of the modules it imported itself."""
    pid = os.fork()
    if pid:
        return pid
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{i}.{suffix}"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if report_imports_to is not None:
        imported_before = set(sys.modules)
        # registered first, so it runs after every atexit handler the run registers
        atexit.register(lambda: os.write(report_imports_to,
                                         "\n".join(sorted(set(sys.modules) - imported_before)).encode()))
    if argv[0] == "plain":     # plain Python use: a stream read in part, never closed
        sys.exit(plain(argv[1], int(argv[2])))
    sys.exit(cli.main(argv))   # the child: a normal exit, as `resumable-stream peek` does


def main() -> None:
    n, k, out_dir, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    codes: dict[int, int] = {}
    running: dict[int, int] = {}
    started = 0
    # Before forking, as Python's docs advise for a pre-fork parent: gc.freeze() keeps the collector from walking
    # (and copying, page by page) the objects of the imports in every child. Without it a child's collections
    # and final teardown cost ~1.3 s of walking torch's and datasets' objects, most of a run. The child's own
    # objects (its streams, readers, threads) are collected and torn down as in any process, and each child
    # still ends with the interpreter's full teardown (atexit, module finalization, native destructors).
    gc.freeze()
    if n:
        # Run 0 goes alone, from this process as it is, and names the modules it imported (most of them are
        # imported inside the CLI's commands). They are imported here before the other runs are forked, so each
        # of those spends its time on its run, not on ~0.2 s of imports; every child has the modules a real
        # `peek` process has, no more (no module the run does not import itself: its teardown costs as a user's).
        read_end, write_end = os.pipe()
        pid = fork_run(0, out_dir, argv, report_imports_to=write_end)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            names = pipe.read().decode().split()
        codes[0] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        started = 1
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:     # a module only its own package can set up (e.g. a C extension's submodule)
                pass
        gc.freeze()
    while started < n or running:
        while started < n and len(running) < k:
            running[fork_run(started, out_dir, argv)] = started
            started += 1
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps({"exit_codes": [codes[i] for i in range(n)]}))


if __name__ == "__main__":
    main()
