"""``python -m resumable_stream llamafactory train`` with a pause before each checkpoint's manifest, for the
kill-in-the-middle-of-a-save test (as tests/slow_manifest_train.py does for ``resumable-stream train``).

    python tests/llamafactory/slow_save.py CONFIG
"""

import sys
import time

from resumable_stream.cli import main
from resumable_stream.trainer_patch import checkpoints

MANIFEST_DELAY_S = 30


def _slow(write_manifest):
    def write_manifest_later(*args, **kwargs):
        time.sleep(MANIFEST_DELAY_S)
        return write_manifest(*args, **kwargs)

    return write_manifest_later


if __name__ == "__main__":
    checkpoints.write_manifest = _slow(checkpoints.write_manifest)   # the name save_stream_state calls
    sys.exit(main(["llamafactory", "train", sys.argv[1]]))
