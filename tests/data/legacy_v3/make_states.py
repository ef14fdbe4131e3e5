"""Write the format-version-3 checkpoints of this directory as they were before the compact fingerprint (run
once, with resumable-stream at commit ba6445e, the last one that wrote them so): each stream_state directory's
``fingerprint.json`` lists every data file's identity, its dataset index is ``index.json`` (a mixture's:
``index-<label>.json``), JSON.

    mkdir /tmp/v3 && git archive ba6445e resumable_stream | tar -x -C /tmp/v3
    PYTHONPATH=/tmp/v3:tests/_support python tests/data/legacy_v3/make_states.py

Over the datasets of ``tests/data/legacy_v1/data``, the same saves as ``legacy_v2`` (see its make_states.py):
``stream/stream_state`` and ``mixture/stream_state`` (2 ranks x 4 partitions, after 7 batches per rank), the
bare streams' ``stream.safetensors`` and ``mixture.safetensors``, and ``expected.json``: what this version
read next.
"""

import importlib.util
import json
import os
import tempfile

from legacy_states import LEGACY_V1, LEGACY_V3, NUM_PARTITIONS, copy_data, mixture_config, stream_config


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
            "stream": v1.checkpoint(stream_config, data, os.path.join(LEGACY_V3, "stream")),
            "mixture": v1.checkpoint(mixture_config, data, os.path.join(LEGACY_V3, "mixture")),
            "stream_file": v1.bare_file(stream_config, data, os.path.join(LEGACY_V3, "stream.safetensors")),
            "mixture_file": v1.bare_file(mixture_config, data, os.path.join(LEGACY_V3, "mixture.safetensors")),
        }
    with open(os.path.join(LEGACY_V3, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
