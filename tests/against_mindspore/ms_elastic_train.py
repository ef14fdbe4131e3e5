"""A MindSpore data-parallel job of W ranks over MindSporeSource, resumable on another W (data.elastic_determinism).

    python ms_elastic_train.py OUT DATA --ranks W --steps S

Each rank is the adapter's source of rank r of W (``MindSporeSource.from_config(..., rank=r, world_size=W,
gradient_accumulation_steps=12 // W)``) read through its own ``GeneratorDataset``, in this one process: MindSpore's
launcher (msrun) and its collectives are not started here, so the gradient all-reduce of a data-parallel step is
the sum of every rank's micro-batch gradients, taken in rank order as a ring all-reduce would add them. One
model (MindSpore's layers), one Adam; the loss of a step is the summed token cross-entropy of its 12
micro-batches (one of each of the 12 partitions) divided by their labelled tokens, so the gradient is the same
whatever W, up to the order of the float additions.

Every 3 steps ``OUT/checkpoint-N/``: the model, the optimizer, every rank's sidecar plus the manifest
(``stream_state/``), renamed from ``.tmp`` once complete; a restart resumes from the newest complete one (each
rank's source gathers its partitions from the rank files that hold them). ``OUT/steps.jsonl``: per step the
ranks, the sorted sample keys of every rank and the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import mindspore as ms
import numpy as np
from mindspore import nn
from transformers import AutoTokenizer

from resumable_stream import StreamConfig
from resumable_stream.integrations.mindspore import MindSporeSource
from resumable_stream.state.checkpoint import finish
from resumable_stream.transforms import TextProcessor, TransformConfig, collate_numpy

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "tiny")
COLUMNS = ["input_ids", "labels", "attention_mask"]
PARTITIONS, BATCH, HIDDEN = 12, 2, 32


class TinyLM(nn.Cell):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, HIDDEN)
        self.mlp = nn.SequentialCell(nn.Dense(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Dense(2 * HIDDEN, HIDDEN))
        self.head = nn.Dense(HIDDEN, vocab_size)

    def construct(self, input_ids):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def newest(out: str) -> tuple[int, str] | None:
    found = [(int(n.split("-")[1]), os.path.join(out, n)) for n in os.listdir(out)
             if n.startswith("checkpoint-") and n.split("-")[1].isdigit()]
    return max(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(0)
    tok = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    transform = TransformConfig(packing=True, max_seq_len=32)
    config = StreamConfig.from_dict({"dataset_name_or_path": "parquet",
                                     "data_files": os.path.join(args.data, "*.parquet"), "shuffle": True,
                                     "shuffle_seed": 3, "buffer_size": 32, "num_partitions": PARTITIONS,
                                     "elastic": True})
    world = args.ranks
    sources = [MindSporeSource.from_config(config, BATCH, COLUMNS, lambda ex: collate_numpy(ex, tok.pad_token_id),
                                           lambda: TextProcessor(tok, transform), rank=r, world_size=world,
                                           keep_keys=True, gradient_accumulation_steps=PARTITIONS // world)
               for r in range(world)]
    vocab = len(tok)
    net = TinyLM(vocab)
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")

    def forward(input_ids, labels):
        return loss_fn(net(input_ids)[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
    os.makedirs(args.out, exist_ok=True)
    step, log = 0, os.path.join(args.out, "steps.jsonl")
    resumed = newest(args.out)
    if resumed is not None:
        step, path = resumed
        ms.load_param_into_net(net, ms.load_checkpoint(os.path.join(path, "model.ckpt")))
        ms.load_param_into_net(optimizer, ms.load_checkpoint(os.path.join(path, "optimizer.ckpt")))
        for source in sources:
            source.load_sidecar(os.path.join(path, "stream_state"))
        print(f"resumed from {path} on {world} ranks", flush=True)
    if os.path.isfile(log):
        with open(log, encoding="utf-8") as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        with open(log, "w", encoding="utf-8") as f:
            f.writelines(kept)
    rows = [source.iterate(source.dataset()) for source in sources]
    while step < args.steps:
        grads, loss_sum, tokens, keys = None, 0.0, 0, []
        for source, it in zip(sources, rows):
            for _ in range(source.micro_batches_per_step):
                batch = next(it)
                labels = batch["labels"].astype(np.int32)
                loss, g = grad_fn(ms.Tensor(batch["input_ids"].astype(np.int32)), ms.Tensor(labels))
                grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
                loss_sum += float(loss.asnumpy())
                tokens += int((labels[:, 1:] != -100).sum())
            keys += source.pop_consumed_keys()
        optimizer(tuple(g / tokens for g in grads))
        step += 1
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "ranks": world, "keys": sorted(keys), "loss": loss_sum / tokens}) + "\n")
        if step % 3 == 0:
            final = os.path.join(args.out, f"checkpoint-{step}")
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            ms.save_checkpoint(net, os.path.join(tmp, "model.ckpt"))
            ms.save_checkpoint(optimizer, os.path.join(tmp, "optimizer.ckpt"))
            for source in sources:
                source.save_sidecar(os.path.join(tmp, "stream_state"), manifest=False)
            finish(os.path.join(tmp, "stream_state"), world)
            os.rename(tmp, final)
    print(f"done at step {step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
