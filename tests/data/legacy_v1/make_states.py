"""Write the format-version-1 sidecars of this directory (run once, with resumable-stream at commit 9d49163).

    PYTHONPATH=.:tests python tests/data/legacy_v1/make_states.py

* ``data/a``: 3 parquet files x 40 rows (ids 0..119), ``data/b``: 2 files x 25 rows (ids 1000..1049);
* ``stream/stream_state``, ``mixture/stream_state``: checkpoints of a shuffled stream and of a 2-source
  mixture, 2 ranks x 4 partitions, read by a StreamLoader with a carrying transform (tests/_support/legacy_states.py),
  saved after 7 batches per rank;
* ``stream.safetensors``, ``mixture.safetensors``: a bare stream's sidecar file (1 rank, 4 partitions) after
  17 samples;
* ``expected.json``: what this version read next: per rank the next batches, the same on 1 rank
  (data.elastic), and the bare streams' next samples.
"""

import json
import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from legacy_states import (
    LEGACY_V1,
    NUM_PARTITIONS,
    SAVED_WORLD,
    batch_ids,
    copy_data,
    loader,
    mixture_config,
    sample_ids,
    stream_config,
)

from resumable_stream.state.checkpoint import write_manifest
from resumable_stream.stream.mixture import open_stream

SAVED_AFTER_BATCHES = 7
NEXT_BATCHES = 6


def write_data(root: str) -> None:
    for name, files, rows, group, first in (("a", 3, 40, 10, 0), ("b", 2, 25, 5, 1000)):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for f in range(files):
            ids = np.arange(first + f * rows, first + (f + 1) * rows, dtype=np.int64)
            table = pa.table({"id": ids, "text": [f"{name} row {i}" for i in ids]})
            pq.write_table(table, os.path.join(root, name, f"part-{f}.parquet"), row_group_size=group)


def checkpoint(config_of, data: str, out: str) -> dict:
    state_dir = os.path.join(out, "stream_state")
    expected = {}
    for rank in range(SAVED_WORLD):
        ld = loader(config_of(data), rank, SAVED_WORLD)
        batches = iter(ld)
        batch_ids(batches, SAVED_AFTER_BATCHES)
        ld.save_sidecar(state_dir, manifest=False)
        expected[f"rank{rank}"] = batch_ids(batches, NEXT_BATCHES)
    write_manifest(state_dir, SAVED_WORLD)
    for rank in range(SAVED_WORLD):
        again = loader(config_of(data), rank, SAVED_WORLD)
        again.load_sidecar(state_dir)
        assert batch_ids(iter(again), NEXT_BATCHES) == expected[f"rank{rank}"]
    one = loader(config_of(data, elastic=True), 0, 1)
    one.load_sidecar(out)
    expected["elastic_one_rank"] = batch_ids(iter(one), NEXT_BATCHES)
    return expected


def bare_file(config_of, data: str, file: str) -> list[int]:
    stream = open_stream(config_of(data), rank=0, world_size=1)
    it = iter(stream)
    for _ in range(17):
        next(it)
    stream.save_sidecar(file)
    expected = sample_ids(stream, 10)
    again = open_stream(config_of(data), rank=0, world_size=1)
    again.load_sidecar(file)
    assert sample_ids(again, 10) == expected
    return expected


def main() -> None:
    write_data(os.path.join(LEGACY_V1, "data"))
    with tempfile.TemporaryDirectory() as tmp:   # saved over a copy: the tests read them over another one
        data = copy_data(tmp)
        expected = {
            "saved_after_batches": SAVED_AFTER_BATCHES, "num_partitions": NUM_PARTITIONS,
            "stream": checkpoint(stream_config, data, os.path.join(LEGACY_V1, "stream")),
            "mixture": checkpoint(mixture_config, data, os.path.join(LEGACY_V1, "mixture")),
            "stream_file": bare_file(stream_config, data, os.path.join(LEGACY_V1, "stream.safetensors")),
            "mixture_file": bare_file(mixture_config, data, os.path.join(LEGACY_V1, "mixture.safetensors")),
        }
    with open(os.path.join(LEGACY_V1, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
