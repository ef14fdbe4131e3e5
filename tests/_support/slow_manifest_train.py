"""``examples/train_lm.py`` with a pause before each checkpoint's manifest, for the kill-during-checkpoint test.

    python tests/_support/slow_manifest_train.py CONFIG

Rank 0 sleeps ``MANIFEST_DELAY_S`` after every rank wrote its stream state and before it writes the manifest
that completes the checkpoint (``integrations.checkpoints.save_stream_state``), so that a SIGKILL sent once
the rank file exists lands between the two. The library itself has no such hook.
"""

import sys
import time

from resumable_stream.app.cli import main
from resumable_stream.integrations import checkpoints

MANIFEST_DELAY_S = 5


def slow(write_manifest, delay_s: float = MANIFEST_DELAY_S):
    """``finish`` (the manifest) after a sleep of ``delay_s`` (also used by tests/against_llamafactory/slow_save.py)."""
    def write_manifest_later(*args, **kwargs):
        time.sleep(delay_s)
        return write_manifest(*args, **kwargs)

    return write_manifest_later


if __name__ == "__main__":
    checkpoints.finish = slow(checkpoints.finish)   # the name save_stream_state calls
    sys.exit(main(["train", sys.argv[1]]))
