"""One rank of ``python -m resumable_stream llamafactory train CONFIG`` (what torchrun runs) that also writes
its parameters' sum at the end of training to ``output_dir/parameters-rank{r}.json``: data parallelism means
every rank ends with the same model (a callback given to ``run.train``).

    torchrun --nproc_per_node 2 tests/against_llamafactory/dp_probe.py CONFIG
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

from resumable_stream.app import llamafactory as run


class ParameterSum(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            total = sum(float(p.double().sum()) for p in model.parameters())
        with open(os.path.join(args.output_dir, f"parameters-rank{args.process_index}.json"), "w") as f:
            json.dump(total, f)


if __name__ == "__main__":
    sys.exit(run.train(sys.argv[1], [], callbacks=(ParameterSum(),)))
