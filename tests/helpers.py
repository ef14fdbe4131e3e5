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
    from resumable_stream.source import open_source

    key = (str(cfg.data_files), cfg.streaming)
    if key not in _SOURCES:
        _SOURCES[key] = open_source(cfg)
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

    from resumable_stream import sidecar as sc

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n])["__metadata__"]
    tensors = st_load(data)
    edit(tensors, meta)
    meta[sc.SEAL_KEY] = "0" * 32
    return sc._seal(st_save(tensors, metadata=meta))
