"""Write the format-version-2 sidecars of this directory (run once, with resumable-stream at commit 26e5f4c, the
last release that wrote version 2: a full dataset fingerprint in every rank file, the digest chain over the
shard ids then the row ids of a window).

    git worktree add /tmp/v2 26e5f4c
    PYTHONPATH=/tmp/v2:tests python tests/data/legacy_v2/make_states.py

Over the datasets of ``tests/data/legacy_v1/data`` (the same files):

* ``stream/stream_state``, ``mixture/stream_state``: checkpoints of a shuffled stream and of a 2-source
  mixture, 2 ranks x 4 partitions, read by a StreamLoader with a carrying transform (tests/_support/legacy_states.py),
  saved after 7 batches per rank;
* ``stream.safetensors``, ``mixture.safetensors``: a bare stream's sidecar file (1 rank, 4 partitions) after
  17 samples;
* ``expected.json``: what this version read next: per rank the next batches, the same on 1 rank
  (data.elastic), and the bare streams' next samples.
"""

import importlib.util
import json
import os
import tempfile

from legacy_states import LEGACY_V1, LEGACY_V2, NUM_PARTITIONS, copy_data, mixture_config, stream_config


def _v1_script():
    """tests/data/legacy_v1/make_states.py: the same saves (``checkpoint``, ``bare_file``), into another place."""
    spec = importlib.util.spec_from_file_location("legacy_v1_make_states", os.path.join(LEGACY_V1, "make_states.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    v1 = _v1_script()
    with tempfile.TemporaryDirectory() as tmp:   # saved over a copy: the tests read them over another one
        data = copy_data(tmp)
        expected = {
            "saved_after_batches": v1.SAVED_AFTER_BATCHES, "num_partitions": NUM_PARTITIONS,
            "stream": v1.checkpoint(stream_config, data, os.path.join(LEGACY_V2, "stream")),
            "mixture": v1.checkpoint(mixture_config, data, os.path.join(LEGACY_V2, "mixture")),
            "stream_file": v1.bare_file(stream_config, data, os.path.join(LEGACY_V2, "stream.safetensors")),
            "mixture_file": v1.bare_file(mixture_config, data, os.path.join(LEGACY_V2, "mixture.safetensors")),
        }
    with open(os.path.join(LEGACY_V2, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
