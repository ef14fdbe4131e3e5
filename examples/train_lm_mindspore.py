"""Train a tiny causal LM with MindSpore (CPU) from a resumable stream; kill it, rerun it, it continues exactly.

    python examples/train_lm_mindspore.py examples/tiny/train_lm_mindspore.yaml

The model is MindSpore's own layers (embedding, a residual MLP block, LM head). Every ``train.save_steps`` it
writes ``output_dir/checkpoint-N/``: the model and optimizer (``mindspore.save_checkpoint``), the step, and the
stream's sidecar (``stream_state/``: what the loop consumed, not what MindSpore's pipeline prefetched). A
directory is complete once renamed from ``checkpoint-N.tmp``; a restart with the same output_dir resumes from
the newest complete one. ``data.consumed_log`` gets one line per step, ``{"step": s, "samples": [keys]}``.
Needs mindspore, not torch (docs/mindspore.md).
"""

import json
import os
import shutil
import sys

import mindspore as ms
import numpy as np
import yaml
from mindspore import nn
from transformers import AutoTokenizer

from resumable_stream import StreamConfig
from resumable_stream.integrations.mindspore import MindSporeSource
from resumable_stream.transforms import TextProcessor, TransformConfig, collate_numpy

COLUMNS = ["input_ids", "labels", "attention_mask"]


class TinyLM(nn.Cell):
    """Embedding -> LayerNorm + MLP (residual) -> LM head: small enough to train in seconds on a CPU."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.norm = nn.LayerNorm((hidden,))
        self.mlp = nn.SequentialCell(nn.Dense(hidden, 2 * hidden), nn.GELU(), nn.Dense(2 * hidden, hidden))
        self.head = nn.Dense(hidden, vocab_size)

    def construct(self, input_ids):
        h = self.embed(input_ids)
        return self.head(h + self.mlp(self.norm(h)))


def newest_checkpoint(output_dir: str) -> tuple[int, str] | None:
    """(step, dir) of the newest complete checkpoint (``checkpoint-N``; ``.tmp`` ones are unfinished)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        head, _, step = name.partition("-")
        if head == "checkpoint" and step.isdigit():
            found.append((int(step), os.path.join(output_dir, name)))
    return max(found) if found else None


def trim_log(path: str, last_step: int) -> None:
    """Drop the log lines of steps after the resumed checkpoint (a killed run logged them, then lost them)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)


def save(output_dir: str, step: int, net, optimizer, source: MindSporeSource) -> None:
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ms.save_checkpoint(net, os.path.join(tmp, "model.ckpt"))
    ms.save_checkpoint(optimizer, os.path.join(tmp, "optimizer.ckpt"))
    source.save_sidecar(os.path.join(tmp, "stream_state"))
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step}, f)
    os.rename(tmp, final)      # complete only now


def main(config_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    base = os.path.dirname(os.path.abspath(config_path))
    model_cfg, data, train = doc["model"], doc["data"], doc["train"]
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(int(train.get("seed", 42)))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(base, model_cfg["tokenizer"]))
    transform = TransformConfig.from_dict(data)
    source = MindSporeSource.from_config(
        StreamConfig.from_yaml(config_path), int(train["per_device_train_batch_size"]), COLUMNS,
        collate_fn=lambda examples: collate_numpy(examples, tokenizer.pad_token_id),
        processor_factory=lambda: TextProcessor(tokenizer, transform), keep_keys=True)

    vocab = len(tokenizer)
    net = TinyLM(vocab, int(model_cfg.get("config", {}).get("hidden_size", 64)))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=float(train.get("learning_rate", 1e-3)))
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(input_ids, labels):
        logits = net(input_ids)[:, :-1]
        return loss_fn(logits.reshape(-1, vocab), labels[:, 1:].reshape(-1))

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    output_dir = train["output_dir"]
    if not os.path.isabs(output_dir):
        output_dir = os.path.join(os.getcwd(), output_dir)
    os.makedirs(output_dir, exist_ok=True)
    step = 0
    resumed = newest_checkpoint(output_dir)
    if resumed is not None:
        step, ckpt = resumed
        ms.load_param_into_net(net, ms.load_checkpoint(os.path.join(ckpt, "model.ckpt")))
        ms.load_param_into_net(optimizer, ms.load_checkpoint(os.path.join(ckpt, "optimizer.ckpt")))
        source.load_sidecar(os.path.join(ckpt, "stream_state"))
        print(f"resumed from {ckpt}", flush=True)
    log_dir = data.get("consumed_log")   # a path as written; else (true, unset) the run's own output_dir/consumed
    log_dir = log_dir if isinstance(log_dir, str) else os.path.join(output_dir, "consumed")
    log_path = os.path.join(log_dir, "rank-00000.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    trim_log(log_path, step)

    max_steps, save_steps = int(train["max_steps"]), int(train["save_steps"])
    with open(log_path, "a", encoding="utf-8") as log:
        rows = source.iterate(source.dataset()) if step < max_steps else iter(())
        for batch in rows:      # each batch counts as consumed when handed out here
            ids = ms.Tensor(batch["input_ids"].astype(np.int32))
            labels = ms.Tensor(batch["labels"].astype(np.int32))
            loss, grads = grad_fn(ids, labels)
            optimizer(grads)
            step += 1
            log.write(json.dumps({"step": step, "samples": source.pop_consumed_keys(),
                                  "loss": round(float(loss.asnumpy()), 6)}) + "\n")
            log.flush()
            print(f"step {step} loss {float(loss.asnumpy()):.4f}", flush=True)
            if step % save_steps == 0 or step == max_steps:
                save(output_dir, step, net, optimizer, source)
            if step == max_steps:
                break
    print(f"done at step {step}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
