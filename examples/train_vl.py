"""Train a vision-language model from one yaml (model / data / train sections, ``data.format: vl``), resumably.

    python examples/train_vl.py examples/tiny/train_vl.yaml [key=value ...]   # e.g. train.max_steps=20
    torchrun --nproc_per_node=2 examples/train_vl.py examples/tiny/train_vl.yaml

The same as ``resumable-stream train CONFIG``. Restarting with the same train.output_dir continues from its
last complete checkpoint, with the data stream (and every skipped bad sample) exactly where training left it.
"""

import sys

from resumable_stream.app.cli import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(["train", *sys.argv[1:]]))   # CONFIG [key=value ...]
