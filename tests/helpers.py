"""Shared helpers for the tests."""

import itertools
import os

from resumable_stream import ResumableStream, StreamConfig


def take_ids(stream: ResumableStream, n: int, column: str = "id") -> list:
    return [row[column] for row in itertools.islice(stream, n)]


def parquet_config(directory: str, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(directory, "*.parquet"), **kw)
