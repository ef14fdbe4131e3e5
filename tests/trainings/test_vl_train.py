"""``resumable-stream train`` picks the vision-language path from ``data.format: vl``: the tiny Qwen3-VL-style
model trains on the bundled pictures, checkpoints carry the processor and the stream state, ``train_log``
carries the transform's counters; a broken image under ``bad_sample: error`` and a wrong column stop the
run with one readable line, and a run stopped that way resumes with ``bad_sample: skip``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from training_helpers import TINY, TRAIN_VL, write_vl_config

from resumable_stream.app.cli import main

pytestmark = pytest.mark.timeout(300)


def _png(w: int = 32, h: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _edit(path: str, **data) -> None:
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"].update(data)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)


@pytest.mark.slow          # trains a tiny model
def test_cli_train_picks_vl_from_the_config(tmp_path, capsys):
    config, out = write_vl_config(str(tmp_path), "run", max_steps=6, save_steps=3, per_device_train_batch_size=4)
    assert main(["train", config]) == 0, capsys.readouterr().err
    with open(os.path.join(out, "checkpoint-6", "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["Qwen3VLForConditionalGeneration"]
    ckpt = os.path.join(out, "checkpoint-6")
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json", "stream_state/manifest.json",
                 "stream_state/rank-00000.safetensors"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(1, 7))
    last = log[-1]
    skipped = sum(v for k, v in last.items() if k.startswith(("data_skipped", "data_dropped")))
    assert last["data_examples"] == 6 * 4 and last["data_samples"] == last["data_examples"] + skipped
    assert last["data_images"] >= last["data_examples"]
    with open(os.path.join(out, "consumed", "rank-00000.jsonl"), encoding="utf-8") as f:
        assert sum(len(json.loads(line)["samples"]) for line in f) == 6 * 4


def _broken_dataset(directory: str) -> str:
    images = [[{"bytes": _png(), "path": None}] for _ in range(6)]
    images[3] = [{"bytes": _png()[:60], "path": None}]
    messages = [[{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Blue."}]] * 6
    table = pa.table({"id": list(range(6)), "messages": messages, "images": images})
    os.makedirs(directory, exist_ok=True)
    pq.write_table(table, os.path.join(directory, "part-0.parquet"))
    return os.path.join(directory, "*.parquet")


@pytest.mark.slow          # trains a tiny model
def test_a_run_stopped_by_a_bad_sample_resumes_with_skip(tmp_path):
    """bad_sample: error stops at row 3 after checkpoint-2, through the real entry point in its own process:
    one line on stderr naming the sample, exit 2, no traceback, nothing saved past the sample. Switched to
    skip, the restart resumes from the checkpoint, skips row 3 and goes on: rows 0, 1 | 2, (3 skipped), 4, 5,
    then the next epoch. (test_bad_sample_error_stops_the_run_naming_the_sample, merged here, trained the same
    stop in a process of its own.)"""
    config, out = write_vl_config(str(tmp_path), "fix", max_steps=7, save_steps=2, per_device_train_batch_size=1)
    _edit(config, data_files=_broken_dataset(str(tmp_path / "data")), shuffle=False, bad_sample="error")
    run = subprocess.run([sys.executable, TRAIN_VL, config], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2, run.stderr[-3000:]
    line = "resumable-stream: error: sample '3': image 0 cannot be decoded (OSError: image file is truncated) " \
           "(data.bad_sample is 'error'; 'skip' skips such samples)"
    assert line in run.stderr.splitlines() and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert os.path.isdir(os.path.join(out, "checkpoint-2")) and not os.path.isdir(os.path.join(out, "checkpoint-4"))
    _edit(config, bad_sample="skip")
    assert main(["train", config]) == 0
    with open(os.path.join(out, "consumed", "rank-00000.jsonl"), encoding="utf-8") as f:
        steps = [json.loads(line) for line in f]
    assert [r["step"] for r in steps] == list(range(1, 8))
    assert [k for r in steps for k in r["samples"]] == ["0", "1", "2", "4", "5", "0", "1"]
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        last = [json.loads(line) for line in f][-1]
    assert last["step"] == 7 and last["data_skipped_image"] == 1


def test_wrong_images_column_is_a_config_error(tmp_path, capsys):
    config, _ = write_vl_config(str(tmp_path), "cols", max_steps=2, save_steps=100)
    _edit(config, images_column="pictures")
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert "data.images_column: got 'pictures'; the dataset's columns are: id, messages, images" in err


def test_shipped_vl_yamls_are_valid():
    from resumable_stream.config.trainer import TrainerConfig

    cfg = TrainerConfig.from_yaml(os.path.join(TINY, "train_vl.yaml"))
    assert cfg.transform.format == "vl" and cfg.model.processor == os.path.join(TINY, "vl")
    assert cfg.model.config["model_type"] == "qwen3_vl" and cfg.transform.bad_sample == "skip"
    real = TrainerConfig.from_yaml(os.path.join(os.path.dirname(TINY), "qwen3_vl_2b", "train_vl.yaml"))
    assert real.model.name_or_path == "Qwen/Qwen3-VL-2B-Instruct" and real.transform.format == "vl"
    assert real.train["bf16"] and real.stream.name == "en"


@pytest.mark.slow   # builds and saves a model
def test_vl_with_a_text_only_checkpoint_is_a_config_error(tmp_path):
    """format vl loads the model with AutoModelForImageTextToText: a text-only checkpoint (or a directory
    that holds no model) is a ConfigError naming model.name_or_path, not an unexpected ValueError."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from resumable_stream.app.train import _load_model
    from resumable_stream.config.trainer import TrainerConfig
    from resumable_stream.errors import ConfigError
    from resumable_stream.transforms.vl import load_processor

    processor = load_processor(os.path.join(TINY, "vl"))
    text_dir = str(tmp_path / "text-model")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3", vocab_size=len(processor.tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(text_dir)
    (tmp_path / "no-model").mkdir()
    for name, why in [(text_dir, "cannot be loaded as an AutoModelForImageTextToText model (ValueError: "),
                      (str(tmp_path / "no-model"), "is a directory without config.json")]:
        config, _ = write_vl_config(str(tmp_path), "m", max_steps=1, save_steps=100)
        with open(config, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        doc["model"] = {"name_or_path": name, "processor": os.path.join(TINY, "vl")}
        with open(config, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f)
        cfg = TrainerConfig.from_yaml(config)
        with pytest.raises(ConfigError) as e:
            _load_model(cfg, processor.tokenizer, 0, processor)
        msg = str(e.value)
        assert msg.startswith(f"model.name_or_path: {name!r} ") and why in msg, msg
        assert "data.format vl needs an image-text-to-text model" in msg, msg
