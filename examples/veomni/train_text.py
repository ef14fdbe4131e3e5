"""VeOmni's text training (as its tasks/train_text.py runs it) with the resumable_stream dataset registered:

    torchrun --nproc_per_node 8 examples/veomni/train_text.py examples/veomni/train.yml
"""

from veomni.arguments import VeOmniArguments, parse_args
from veomni.trainer.text_trainer import TextTrainer

import resumable_stream.integrations.veomni  # noqa: F401  (registers datasets_type / dataloader.type resumable_stream)

if __name__ == "__main__":
    TextTrainer(parse_args(VeOmniArguments)).train()
