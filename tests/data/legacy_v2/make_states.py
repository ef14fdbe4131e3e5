"""Write the format-version-2 sidecars of this directory (run once, with resumable-stream at commit 26e5f4c, the
last release that wrote version 2: a full dataset fingerprint in every rank file, the digest chain over the
shard ids then the row ids of a window).

    git worktree add /tmp/v2 26e5f4c
    PYTHONPATH=/tmp/v2:tests python tests/data/legacy_v2/make_states.py

Over the datasets of ``tests/data/legacy_v1/data`` (the same files):

* ``stream/stream_state``, ``mixture/stream_state``: checkpoints of a shuffled stream and of a 2-source
  mixture, 2 ranks x 4 partitions, read by a StreamLoader with a carrying transform (tests/legacy_states.py),
  saved after 7 batches per rank;
* ``stream.safetensors``, ``mixture.safetensors``: a bare stream's sidecar file (1 rank, 4 partitions) after
  17 samples;
* ``expected.json``: what this version read next: per rank the next batches, the same on 1 rank
  (data.elastic), and the bare streams' next samples.
"""

import json
import os
import tempfile

from legacy_states import (
    LEGACY_V2,
    NUM_PARTITIONS,
    SAVED_WORLD,
    batch_ids,
    copy_data,
    loader,
    mixture_config,
    sample_ids,
    stream_config,
)

from resumable_stream.mixture import open_stream
from resumable_stream.sidecar import write_manifest

SAVED_AFTER_BATCHES = 7
NEXT_BATCHES = 6


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
    with tempfile.TemporaryDirectory() as tmp:   # saved over a copy: the tests read them over another one
        data = copy_data(tmp)
        expected = {
            "saved_after_batches": SAVED_AFTER_BATCHES, "num_partitions": NUM_PARTITIONS,
            "stream": checkpoint(stream_config, data, os.path.join(LEGACY_V2, "stream")),
            "mixture": checkpoint(mixture_config, data, os.path.join(LEGACY_V2, "mixture")),
            "stream_file": bare_file(stream_config, data, os.path.join(LEGACY_V2, "stream.safetensors")),
            "mixture_file": bare_file(mixture_config, data, os.path.join(LEGACY_V2, "mixture.safetensors")),
        }
    with open(os.path.join(LEGACY_V2, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
