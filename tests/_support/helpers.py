"""Shared helpers for the tests."""

import itertools
import os
import random

from resumable_stream import ResumableStream, StreamConfig


def take_ids(stream: ResumableStream, n: int, column: str = "id") -> list:
    return [row[column] for row in itertools.islice(stream, n)]


def parquet_config(directory: str, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(directory, "*.parquet"), **kw)


_SOURCES: dict = {}


def shared_source(cfg: StreamConfig):
    """One opened source per dataset for a test session (opening resolves files and reads footers)."""
    from resumable_stream.sources import open_source

    key = (str(cfg.data_files), cfg.streaming)
    if key not in _SOURCES:
        _SOURCES[key] = open_source(cfg.source_spec)
    return _SOURCES[key]


# One seed for every random choice the tests make in a session: RS_TEST_SEED=<seed> reruns it (conftest.py
# prints it in the header and with every failure).
TEST_SEED = int(os.environ.get("RS_TEST_SEED") or random.SystemRandom().randrange(2**31))


def seeded_rng(name: str) -> random.Random:
    """A random.Random for one use (a test id, a run name), seeded from TEST_SEED."""
    return random.Random(f"{TEST_SEED}:{name}")


def resealed(data: bytes, edit) -> bytes:
    """The sidecar ``data`` with ``edit(tensors, metadata)`` applied and a valid self-digest: a malformed state
    that only the field checks can catch."""
    import json

    from safetensors.numpy import load as st_load
    from safetensors.numpy import save as st_save

    from resumable_stream.state import sidecar as sc

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n])["__metadata__"]
    tensors = st_load(data)
    edit(tensors, meta)
    meta[sc.SEAL_KEY] = "0" * 32
    return sc._seal(st_save(tensors, metadata=meta))


def run_forked(fn, memory_mb: int = 512, timeout_s: float = 60.0):
    """``fn()`` in a child forked from this process (its imports already done), its address space capped at
    what it maps now plus ``memory_mb``: ``(result, stderr, seconds)``, ``result`` being what ``fn`` returned
    (picklable), or the repr of what it raised (a MemoryError: it needed more than ``memory_mb``); ``seconds``:
    how long ``fn`` ran. A child still running after ``timeout_s`` is killed: result ``"timeout"``."""
    import io
    import pickle
    import resource
    import select
    import signal
    import sys
    import time

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into the test session
        os.close(read_end)
        out = ("not run", "", 0.0)
        try:
            mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            resource.setrlimit(resource.RLIMIT_AS, (mapped + (memory_mb << 20), hard))
            sys.stderr = io.StringIO()
            start = time.monotonic()
            try:
                result = fn()
            except BaseException as e:
                result = repr(e)
            out = (result, sys.stderr.getvalue(), time.monotonic() - start)
        finally:
            os.write(write_end, pickle.dumps(out))
            os._exit(0)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            return "timeout", "", timeout_s
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks))


def run_cli_forked(argv: list[str], memory_mb: int = 512, timeout_s: float = 60.0):
    """``resumable-stream ARGV`` (``cli.main``) under :func:`run_forked`: ``(exit code, stderr, seconds)``."""
    from resumable_stream.app.cli import main

    return run_forked(lambda: main(argv), memory_mb, timeout_s)


def through_sidecar(state: dict) -> dict:
    """``state`` (a stream's ``state_dict()``, or a nested state: a loader's ``rank_state()``) written as sidecar
    bytes and read back, in the form it was given."""
    from resumable_stream.state.sidecar import decode_state, encode_state

    nested = "stream" in state and "partitions" not in state
    back = decode_state(encode_state(state if nested else {"stream": state}))
    return back if nested else back["stream"]
