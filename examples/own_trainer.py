"""Your own transformers Trainer over a resumable stream: ``patch_trainer`` and a ``TrainingStream``.

    python examples/own_trainer.py OUTPUT_DIR MAX_STEPS     # run it again with more steps: it resumes exactly
    torchrun --nproc_per_node 2 examples/own_trainer.py OUTPUT_DIR MAX_STEPS

A tiny random-init Qwen3-style model, the bundled tokenizer and data (examples/tiny), packed text.
"""

import functools
import os
import sys

from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments, set_seed

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.integrations.transformers import TrainingStream, patch_trainer
from resumable_stream.transforms import TextProcessor, TransformConfig, collate

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")

if __name__ == "__main__":
    output_dir, max_steps = sys.argv[1], int(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    set_seed(42)                             # the same random-init model in every run
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, tie_word_embeddings=True))
    args = TrainingArguments(output_dir, max_steps=max_steps, per_device_train_batch_size=8, save_steps=3,
                             learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, seed=42)

    patch_trainer(Trainer)                   # once; pass your subclass if it overrides get_train_dataloader
    config = StreamConfig.from_yaml(os.path.join(TINY, "stream.yaml"))
    stream = ResumableStream(config, rank=args.process_index, world_size=args.world_size,
                             num_workers=args.dataloader_num_workers)
    transform = TransformConfig(max_seq_len=64, packing=True)
    dataset = TrainingStream(stream, collate_fn=functools.partial(collate, pad_token_id=tokenizer.pad_token_id),
                             processor_factory=functools.partial(TextProcessor, tokenizer, transform))
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=True)   # the newest complete checkpoint in output_dir (none: from the start)
    for record in trainer.state.log_history:
        if "loss" in record:
            print(record["step"], record["loss"])
