"""What neat packing costs next to concat packing, on the bundled tiny data and a small random-init Qwen2.

    PYTHONPATH=. python benchmarks/packing.py [--seq-len 1024] [--batch 4] [--steps 5] [--attn sdpa,eager]

Prints one JSON line per measurement: the text transform's tokens/s (tokenize + pack) for each mode, and the
median seconds of one forward + backward step on a batch of packed blocks for each mode and attention
implementation. Same tokens in both modes (neat packing cuts the same blocks); only the masks differ.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from resumable_stream.transforms import TextProcessor, TransformConfig, collate

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tiny")


def _blocks(tok, texts, mode, seq_len):
    proc = TextProcessor(tok, TransformConfig(packing=True, packing_mode=mode, max_seq_len=seq_len))
    start = time.perf_counter()
    out = []
    for i, text in enumerate(texts):
        proc.feed({"text": text}, str(i))
        while proc.ready():
            out.append(proc.take())
    seconds = time.perf_counter() - start
    return out, sum(len(e["input_ids"]) for e in out) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attn", default="sdpa,eager")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    texts = []
    for f in sorted(glob.glob(os.path.join(TINY, "data", "*.parquet"))):
        texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
    batches = {}
    for mode in ("concat", "neat"):
        blocks, tokens_per_s = _blocks(tok, texts, mode, a.seq_len)
        docs = sum(e["position_ids"].count(0) for e in blocks) / len(blocks) if mode == "neat" else None
        print(json.dumps({"what": "transform", "mode": mode, "tokens_per_s": round(tokens_per_s),
                          "blocks": len(blocks), "documents_per_block": docs}))
        batches[mode] = collate(blocks[:a.batch], tok.pad_token_id)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq_len)
    for attn in a.attn.split(","):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        for mode, batch in batches.items():
            times = []
            for _ in range(a.steps + 1):   # the first step warms up
                start = time.perf_counter()
                model(**batch).loss.backward()
                times.append(time.perf_counter() - start)
            print(json.dumps({"what": "step", "attn": attn, "mode": mode, "batch": a.batch, "seq_len": a.seq_len,
                              "median_s": round(statistics.median(times[1:]), 4)}))


if __name__ == "__main__":
    main()
