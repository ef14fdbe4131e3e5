"""A small dataset and mixture (``tests/data/small_mixture``: ``a``, 3 parquet files x 40 rows, ids 0..119;
``b``, 2 files x 25 rows, ids 1000..1049), the configs and topology tests read them with, and a toy transform
with a carry (what a packing transform's tokens are)."""

from __future__ import annotations

import os
import shutil

import numpy as np
from repo_paths import DATA_DIR

SMALL_MIXTURE = os.path.join(DATA_DIR, "small_mixture")
BATCH_SIZE = 3
SAVED_WORLD = 2
NUM_PARTITIONS = 4


class TripleProcessor:
    """A transform with a carry: groups each 3 consecutive samples' ids into one example; the 0-2 samples
    not yet grouped are its state (an int64 tensor plus their keys), as a packing transform's tokens are."""

    def __init__(self):
        self.ids: list[int] = []
        self.keys: list[str] = []
        self.samples = 0
        self.ready_examples: list[dict] = []

    def feed(self, sample: dict, key: str, source: str | None = None) -> None:
        self.samples += 1
        self.ids.append(int(sample["id"]))
        self.keys.append(key)
        if len(self.ids) == 3:
            self.ready_examples.append({"ids": self.ids, "keys": self.keys})
            self.ids, self.keys = [], []

    def ready(self) -> int:
        return len(self.ready_examples)

    def take(self) -> dict:
        return self.ready_examples.pop(0)

    def stats(self) -> dict:
        return {"samples": self.samples}

    def state(self) -> dict:
        pending = [i for ex in self.ready_examples for i in ex["ids"]] + self.ids
        keys = [k for ex in self.ready_examples for k in ex["keys"]] + self.keys
        return {"meta": {"keys": keys, "stats": self.stats()}, "tensors": {"ids": np.asarray(pending, np.int64)}}

    def load_state(self, state: dict) -> None:
        self.ready_examples = []
        self.ids = [int(i) for i in state["tensors"]["ids"]]
        self.keys = list(state["meta"]["keys"])
        self.samples = int(state["meta"]["stats"]["samples"])
        while len(self.ids) >= 3:
            self.ready_examples.append({"ids": self.ids[:3], "keys": self.keys[:3]})
            self.ids, self.keys = self.ids[3:], self.keys[3:]

    def fingerprint(self) -> dict:
        return {"name": "triples", "version": 1}


def collate(examples: list[dict]) -> list[list[int]]:
    return [ex["ids"] for ex in examples]


def copy_data(to: str) -> str:
    """The datasets, copied under ``to`` (tests may change or move them)."""
    target = os.path.join(to, "small_mixture")
    shutil.copytree(SMALL_MIXTURE, target)
    return target


def stream_config(data: str, **kw):
    from resumable_stream.config.stream_config import StreamConfig

    return StreamConfig.from_dict({"dataset_name_or_path": "parquet", "data_files": os.path.join(data, "a", "*.parquet"),
                                   "shuffle": True, "buffer_size": 16, "block_rows": 5,
                                   "num_partitions": NUM_PARTITIONS, **kw})


def mixture_config(data: str, **kw):
    from resumable_stream.config.stream_config import StreamConfig

    return StreamConfig.from_dict({
        "shuffle": True, "buffer_size": 16, "block_rows": 5, "num_partitions": NUM_PARTITIONS,
        "stopping": "all_exhausted", **kw,
        "sources": [{"label": "a", "dataset_name_or_path": "parquet", "weight": 0.6,
                     "data_files": os.path.join(data, "a", "*.parquet")},
                    {"label": "b", "dataset_name_or_path": "parquet", "weight": 0.4,
                     "data_files": os.path.join(data, "b", "*.parquet")}]})


def loader(config, rank: int, world_size: int):
    from resumable_stream.loader import StreamLoader
    from resumable_stream.stream.mixture import open_stream

    stream = open_stream(config, rank=rank, world_size=world_size)
    return StreamLoader(stream, BATCH_SIZE, collate_fn=collate, processor_factory=TripleProcessor)


def batch_ids(batches, n: int) -> list[list[list[int]]]:
    """The sample ids of the next ``n`` batches."""
    return [next(batches) for _ in range(n)]


def sample_ids(stream, n: int) -> list[int]:
    it = iter(stream)
    return [int(next(it)["id"]) for _ in range(n)]
