"""What the VeOmni tests share: a tiny random-init Qwen3 model config with the bundled tokenizer, generated parquet
data, a resumable-stream yaml and VeOmni's yaml pointing at it, the torchrun command of veomni_launch.py, and
the per-step records it writes.

No network: the model is random-init from a config (VeOmni initialises weights when model_path is unset), the
data is generated, HF_HUB_OFFLINE is set."""

from __future__ import annotations

import json
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
LAUNCH = os.path.join(HERE, "veomni_launch.py")
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


def make_model(directory: str) -> str:
    """A Qwen3 config (33k parameters once initialised) and the bundled tokenizer in one directory."""
    from transformers import AutoTokenizer, Qwen3Config

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    os.makedirs(directory, exist_ok=True)
    cfg.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def make_data(directory: str, rows: int = 480) -> str:
    """``rows`` generated rows (``id``, ``text``) in 4 parquet files of row groups of 30."""
    from resumable_stream.testing import write_parquet_dataset

    write_parquet_dataset(directory, rows=rows, files=4, row_group_size=30)
    return directory


EXAMPLE = os.path.join(ROOT, "examples", "veomni")


def write_stream_yml(directory: str, data_dir: str, buffer_size: int = 64) -> str:
    """examples/veomni/stream.yml reading ``data_dir`` through a ``buffer_size``-row window (*.yml: VeOmni
    takes a ``*.yaml`` train_path for its multi-source yaml)."""
    with open(os.path.join(EXAMPLE, "stream.yml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].update(data_files=os.path.join(data_dir, "*.parquet"), buffer_size=buffer_size, num_partitions=4)
    path = os.path.join(directory, "stream.yml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path


def write_veomni_yaml(directory: str, name: str, model: str, train_path: str, out: str, *, max_steps: int,
                      save_steps: int, num_workers: int = 2, load_path: str | None = None, nproc: int = 1) -> str:
    """examples/veomni/train.yml with the test's model, data, sizes and output; the ops are VeOmni's eager
    ones (its defaults are CUDA kernels: liger / triton / flash attention), and no HF weights are exported."""
    with open(os.path.join(EXAMPLE, "train.yml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["model"] = {"config_path": model, "tokenizer_path": model,
                    "ops_implementation": {"attn_implementation": "sdpa", "moe_implementation": "eager",
                                           "cross_entropy_loss_implementation": "eager",
                                           "rms_norm_implementation": "eager", "swiglu_mlp_implementation": "eager",
                                           "rotary_pos_emb_implementation": "eager",
                                           "load_balancing_loss_implementation": "eager"}}
    doc["data"].update(train_path=train_path, max_seq_len=32)
    doc["data"]["dataloader"].update(num_workers=num_workers, pin_memory=False,
                                     prefetch_factor=2 if num_workers else None)
    doc["train"].update(micro_batch_size=2, global_batch_size=4 * nproc, max_steps=max_steps, seed=3,
                        wandb={"enable": False})
    doc["train"]["optimizer"].update(lr=1.0e-3, lr_warmup_ratio=0.0)
    doc["train"]["checkpoint"].update(output_dir=out, save_steps=save_steps, save_hf_weights=False,
                                      load_path=load_path)
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path


def torchrun(config: str, log_dir: str, nproc: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            LAUNCH, config, log_dir]


def records(log_dir: str, rank: int = 0) -> dict[int, dict]:
    """Step -> {"loss", "keys"} of one rank's log (a resumed run appends after the kill)."""
    out = {}
    path = os.path.join(log_dir, f"rank-{rank}.jsonl")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec
    return out
