"""What the MindSpore tests and their PyTorch side share: the tiny text stream (bundled tokenizer and data),
its source, and reading batches from a MindSporeSource or a StreamLoader."""

import json
import os

from transformers import AutoTokenizer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader
from resumable_stream.transforms import TextProcessor, TransformConfig, collate_numpy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny")
COLUMNS = ["input_ids", "labels", "attention_mask"]
BATCH = 4
DATA = {"dataset_name_or_path": "parquet", "data_files": os.path.join(TINY, "data", "*.parquet"), "shuffle": True,
        "shuffle_seed": 7, "buffer_size": 64, "format": "text", "text_column": "text", "max_seq_len": 32,
        "packing": True}


def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


def stream_config(**overrides) -> StreamConfig:
    return StreamConfig.from_dict({**{k: v for k, v in DATA.items() if k not in TransformConfig.KEYS}, **overrides})


def processor_factory(tok):
    cfg = TransformConfig.from_dict(DATA)
    return lambda: TextProcessor(tok, cfg)


def mindspore_source(tok=None):
    from resumable_stream.integrations.mindspore import MindSporeSource

    tok = tok or tokenizer()
    return MindSporeSource(ResumableStream(stream_config(), rank=0, world_size=1), BATCH, COLUMNS,
                           lambda ex: collate_numpy(ex, tok.pad_token_id), processor_factory(tok), keep_keys=True)


def torch_loader(tok=None):
    """The PyTorch side: a StreamLoader with the torch collate (tensors), as a PyTorch loop reads it."""
    from resumable_stream.transforms import collate

    tok = tok or tokenizer()
    return StreamLoader(ResumableStream(stream_config(), rank=0, world_size=1), BATCH,
                        collate_fn=lambda ex: collate(ex, tok.pad_token_id), processor_factory=processor_factory(tok),
                        keep_keys=True)


def take(batches, n: int) -> list[list[list[int]]]:
    """The input_ids of the next ``n`` batches (as lists, whatever the framework)."""
    out = []
    if n == 0:
        return out
    for batch in batches:
        out.append(batch["input_ids"].tolist())     # a numpy array or a torch tensor
        if len(out) == n:
            break
    return out


def dump(path: str, batches) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(batches, f)
