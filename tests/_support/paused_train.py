"""``examples/train_lm.py`` that stops after one step until the test lets it go on, for the output_dir lock tests.

    RS_TEST_PAUSE_AT=3 RS_TEST_PAUSE_DIR=DIR python tests/_support/paused_train.py CONFIG

After step RS_TEST_PAUSE_AT rank 0 writes DIR/paused and every rank waits until DIR/go exists: the job
holds its output_dir (and its earlier checkpoints are complete) for as long as the test needs. The library
itself has no such hook.
"""

import os
import sys
import time

from transformers import TrainerCallback

import resumable_stream.app.train as train_module
from resumable_stream.app.cli import main


class PauseAt(TrainerCallback):
    def __init__(self, step: int, directory: str):
        self.step, self.directory = step, directory

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        if state.is_world_process_zero:
            open(os.path.join(self.directory, "paused"), "w").close()
        while not os.path.exists(os.path.join(self.directory, "go")):
            time.sleep(0.05)


def _pausing(build_trainer):
    def build(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        trainer.add_callback(PauseAt(int(os.environ["RS_TEST_PAUSE_AT"]), os.environ["RS_TEST_PAUSE_DIR"]))
        return trainer
    return build


if __name__ == "__main__":
    train_module.build_trainer = _pausing(train_module.build_trainer)   # the name run_training calls
    sys.exit(main(["train", sys.argv[1]]))
