"""``python -m resumable_stream llamafactory train`` with a pause before each checkpoint's manifest, for the
kill-in-the-middle-of-a-save test (tests/_support/slow_manifest_train.py does the same for ``resumable-stream train``).

    python tests/against_llamafactory/slow_save.py CONFIG
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_support"))   # tests/

from slow_manifest_train import slow  # noqa: E402

from resumable_stream.app.cli import main  # noqa: E402
from resumable_stream.integrations import checkpoints  # noqa: E402

if __name__ == "__main__":
    checkpoints.finish = slow(checkpoints.finish, 30)   # the name save_stream_state calls
    sys.exit(main(["llamafactory", "train", sys.argv[1]]))
