"""Helper of test_cli's exit tests: ``python peek_runs.py [--import-what-run-0-imports] N K OUT_DIR peek ARGS...``
runs the CLI N times, K at a time, each in a process forked from this one after the imports (a run then costs its
own work, not the imports; the imported objects are moved out of the collector's reach first, see main), each
ending with the interpreter's normal teardown (atexit, finalization, native destructors).
Run i writes its stdout to OUT_DIR/i.out and stderr to OUT_DIR/i.err. Prints ``{"exit_codes": [...]}``.
``... OUT_DIR plain CONFIG NUM`` reads NUM samples of a ResumableStream instead and leaves it unclosed.

``--import-what-run-0-imports``: run 0 goes alone and names the modules it imported; they are imported here, in
its order, before the other runs fork (without it: datasets, pyarrow and torch only). Used for local reads only:
over HTTP (run 0's aiohttp / fsspec / datasets stack imported here, then in name order) a forked run once failed
its reads with aiohttp's "Timeout context manager should be used inside a task"; the cause was not found."""

import atexit
import gc
import importlib
import json
import os
import sys

# imported once, before the forks (datasets: unless run 0 names what to import, see main)
_IMPORT_WHAT_RUN_0_IMPORTS = sys.argv[1:2] == ["--import-what-run-0-imports"]
if not _IMPORT_WHAT_RUN_0_IMPORTS:
    import datasets  # noqa: F401
import pyarrow.parquet  # noqa: E402, F401
import torch  # noqa: E402, F401

from resumable_stream.app import cli  # noqa: E402  (after the imports above, as before)


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
        # registered first, so it runs after every atexit handler the run registers; in import order
        atexit.register(lambda: os.write(report_imports_to, "\n".join(
            name for name in list(sys.modules) if name not in imported_before).encode()))
    if argv[0] == "plain":     # plain Python use: a stream read in part, never closed
        sys.exit(plain(argv[1], int(argv[2])))
    sys.exit(cli.main(argv))   # the child: a normal exit, as `resumable-stream peek` does


def main() -> None:
    args = sys.argv[2:] if _IMPORT_WHAT_RUN_0_IMPORTS else sys.argv[1:]
    n, k, out_dir, argv = int(args[0]), int(args[1]), args[2], args[3:]
    codes: dict[int, int] = {}
    running: dict[int, int] = {}
    started = 0
    # Before forking, as Python's docs advise for a pre-fork parent: gc.freeze() keeps the collector from walking
    # (and copying, page by page) the objects of the imports in every child. Without it a child's collections
    # and final teardown cost ~1.3 s of walking torch's and datasets' objects, most of a run. The child's own
    # objects (its streams, readers, threads) are collected and torn down as in any process, and each child
    # still ends with the interpreter's full teardown (atexit, module finalization, native destructors).
    gc.freeze()
    if n and _IMPORT_WHAT_RUN_0_IMPORTS:
        # Run 0 goes alone, from this process as it is, and names the modules it imported (most of them are
        # imported inside the CLI's commands). They are imported here before the other runs are forked, so each
        # of those spends its time on its run, not on ~0.2 s of imports; every child has the modules a real
        # `peek` process has (datasets, which a local peek never imports, is not loaded: its teardown too costs
        # what a user's does).
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
