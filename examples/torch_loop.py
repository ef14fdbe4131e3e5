"""A plain PyTorch loop over a resumable stream, with DataLoader workers, saved and resumed.

    python examples/torch_loop.py OUTPUT_DIR STEPS     # run it twice: the second run continues the first
"""

import os
import sys

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader


def ids(rows):               # collate_fn: rows (dicts with the dataset's columns) -> a batch
    return [row["id"] for row in rows]


if __name__ == "__main__":
    output_dir, steps = sys.argv[1], int(sys.argv[2])
    state_dir = os.path.join(output_dir, "stream_state")
    config = StreamConfig.from_yaml(os.path.join(os.path.dirname(__file__), "tiny", "stream.yaml"))
    stream = ResumableStream(config, rank=0, world_size=1, num_workers=2)
    loader = StreamLoader(stream, batch_size=8, collate_fn=ids, num_workers=2)   # same workers as the stream
    if os.path.isdir(state_dir):
        loader.load_sidecar(state_dir)          # continue right after the last batch the previous run used
    for step, batch in enumerate(loader, start=1):
        print(batch)                            # train on the batch here
        if step == steps:
            break
    loader.save_sidecar(state_dir)              # with your model and optimizer checkpoint: what was consumed
