"""Build the tiny offline assets: a byte-level BPE tokenizer and a small SFT (chat) dataset.

Deterministic: running it again rewrites byte-identical files. Outputs (committed):

- ``examples/tiny/tokenizer/``: ``tokenizer.json`` + ``tokenizer_config.json``; loads offline with
  ``transformers.AutoTokenizer.from_pretrained("examples/tiny/tokenizer")`` as a fast tokenizer with
  eos/pad ``<|endoftext|>``, specials ``<|im_start|>`` / ``<|im_end|>`` and a Qwen-style ChatML template.
- ``examples/tiny/data_sft/sft-0000{0,1}.parquet``: generated conversations, columns ``id`` (int64) and
  ``messages`` (list of {role, content}), row groups of 100 rows.

The tokenizer is trained on ``examples/tiny/data/*.parquet`` (column ``text``) plus the SFT texts.

    python examples/tiny/make_assets.py [--check]     # --check: rebuild in a temp dir and compare
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import json
import os
import random
import shutil
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240611
N_CONVERSATIONS = 1000
SFT_FILES = 2
ROW_GROUP_SIZE = 100
VOCAB_SIZE = 1000
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML. The {% generation %} markers let transformers' return_assistant_tokens_mask
# cross-check the label masks the transform computes on its own (they do not change the rendered text).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = (
    "stream resume shard window cursor epoch rank worker sample token step loss batch buffer shuffle seed "
    "checkpoint sidecar manifest partition order data model train config yaml parquet arrow row group file "
    "cache block disk memory network server client request reply answer question system user assistant "
    "apple river mountain forest ocean cloud rain snow wind sun moon star garden flower tree leaf stone "
    "bread water coffee tea milk honey salt sugar lemon orange grape cherry paper pencil book letter "
    "window door house street city village bridge road train ship plane bicycle engine wheel light "
    "red green blue yellow purple black white silver golden small large quick slow bright dark quiet "
    "happy calm brave clever gentle honest careful simple clear fresh warm cold early late open close "
    "read write count sort find keep move start stop build check learn teach share carry measure"
).split()

SYSTEMS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one sentence.",
    "You are a careful data engineer who explains things simply.",
    "You answer questions about streaming data and training.",
)

FACTS = (
    ("What is a shuffle window?",
     "A shuffle window is a block of rows that is read together and yielded in a random order."),
    ("Why save a cursor in a checkpoint?",
     "The cursor says which sample comes next, so training can resume without replaying data."),
    ("What is a shard?", "A shard is one piece of a dataset, such as a parquet row group."),
    ("What does packing do?",
     "Packing joins tokenized documents and cuts them into blocks of the same length."),
    ("What is an epoch?", "An epoch is one full pass over the dataset."),
    ("Why use a fixed seed?", "A fixed seed makes every shuffle repeat exactly."),
    ("What is a sidecar file?",
     "A sidecar file stores the stream state next to the model checkpoint."),
    ("What does a rank do?", "Each rank is one training process that reads its own part of the data."),
)


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        return f"Multiply {a} by {b}.", f"{a} times {b} is {a * b}."
    if kind == 2:
        ws = rng.sample(WORDS, rng.randrange(3, 6))
        return "Reverse the words: " + " ".join(ws), " ".join(reversed(ws))
    if kind == 3:
        w = rng.choice(WORDS)
        return f"How many letters are in the word '{w}'?", f"The word '{w}' has {len(w)} letters."
    if kind == 4:
        ws = rng.sample(WORDS, rng.randrange(2, 5))
        return "Write in capitals: " + " ".join(ws), " ".join(ws).upper()
    if kind == 5:
        ns = [rng.randrange(50) for _ in range(rng.randrange(3, 7))]
        return ("Sort these numbers: " + ", ".join(map(str, ns)),
                ", ".join(map(str, sorted(ns))))
    return rng.choice(FACTS)


def conversations(n: int = N_CONVERSATIONS, seed: int = SEED) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(rng.randrange(1, 4)):
            q, a = _task(rng)
            msgs.append({"role": "user", "content": q})
            msgs.append({"role": "assistant", "content": a})
        out.append(msgs)
    return out


def write_sft(out_dir: str, convs: list[list[dict[str, str]]]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    per_file = (len(convs) + SFT_FILES - 1) // SFT_FILES
    for i in range(SFT_FILES):
        lo, hi = i * per_file, min(len(convs), (i + 1) * per_file)
        table = pa.table({"id": pa.array(range(lo, hi), pa.int64()), "messages": pa.array(convs[lo:hi], msg_type)})
        pq.write_table(table, os.path.join(out_dir, f"sft-{i:05d}.parquet"), row_group_size=ROW_GROUP_SIZE)


def train_tokenizer(out_dir: str, convs: list[list[dict[str, str]]]) -> None:
    texts: list[str] = []
    for f in sorted(glob.glob(os.path.join(HERE, "data", "*.parquet"))):
        texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
    for msgs in convs:
        texts += [m["role"] + "\n" + m["content"] for m in msgs]
    if not texts:
        sys.exit("no training text found under examples/tiny/data")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def build(root: str) -> None:
    convs = conversations()
    write_sft(os.path.join(root, "data_sft"), convs)
    train_tokenizer(os.path.join(root, "tokenizer"), convs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the committed files")
    args = ap.parse_args()
    if not args.check:
        build(HERE)
        print(f"wrote {HERE}/tokenizer and {HERE}/data_sft")
        return
    tmp = tempfile.mkdtemp(prefix="tiny-assets-")
    try:
        build(tmp)
        bad = []
        for sub in ("tokenizer", "data_sft"):
            names = sorted(os.listdir(os.path.join(tmp, sub)))
            _, mismatch, errors = filecmp.cmpfiles(os.path.join(HERE, sub), os.path.join(tmp, sub), names, shallow=False)
            bad += [f"{sub}/{n}" for n in mismatch + errors]
        if bad:
            sys.exit("differs from the committed assets: " + ", ".join(bad))
        print("assets are up to date")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
