"""What the LLaMA-Factory tests share: a tiny Qwen3 model made from a config with the bundled tokenizer (which
has the qwen template's <|im_start|> / <|im_end|>), generated datasets registered in a dataset_info.json, yaml
files as llamafactory-cli takes them, and the two commands: ``llamafactory-cli train`` and ours.

No network: the model is random-init from a config, the data is generated, HF_HUB_OFFLINE is set."""

from __future__ import annotations

import copy
import json
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")
_WORDS = ("stream resume shard window cursor epoch rank worker sample token batch model data order seed buffer "
          "block parquet arrow train loss step answer question").split()
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "DISABLE_VERSION_CHECK": "1"}


def _words(i: int, n: int) -> str:
    return " ".join(_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(n))


def make_model(directory: str) -> str:
    """A random-init Qwen3 (33k parameters) and the bundled tokenizer, saved as a model directory."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(directory: str) -> str:
    """dataset_dir with dataset_info.json: alpaca (300 rows), a second alpaca (80), two small ones (few: 14,
    fewer: 9), sharegpt (150, some multi-turn, some with a system message), pt text (300)."""
    os.makedirs(directory, exist_ok=True)
    _jsonl(os.path.join(directory, "alpaca.jsonl"), [
        {"instruction": f"Task {i}: {_words(i, 5)}", "input": _words(i + 1, 3) if i % 3 else "",
         "output": f"Answer {i}: {_words(i + 2, 4 + i % 5)}"} for i in range(300)])
    _jsonl(os.path.join(directory, "other.jsonl"), [
        {"instruction": f"Other {i}: {_words(i + 9, 4)}", "input": "", "output": f"Reply {i}: {_words(i, 3)}"}
        for i in range(80)])
    for name, rows in (("few", 14), ("fewer", 9)):     # mixtures whose epochs end within a few batches
        _jsonl(os.path.join(directory, f"{name}.jsonl"), [
            {"instruction": f"{name.title()} {i}: {_words(i + 4, 3 + i % 4)}", "input": "",
             "output": f"Done {i}: {_words(i + 1, 2 + i % 3)}"} for i in range(rows)])
    convs = []
    for i in range(150):
        turns = [{"from": "human", "value": f"Question {i}: {_words(i, 4)}"},
                 {"from": "gpt", "value": f"Reply {i}: {_words(i + 3, 5)}"}]
        if i % 2:
            turns += [{"from": "human", "value": f"And {i}? {_words(i + 5, 3)}"},
                      {"from": "gpt", "value": f"Then {_words(i + 7, 4)}"}]
        if i % 5 == 0:
            turns.insert(0, {"from": "system", "value": f"Be brief {i}."})
        convs.append({"conversations": turns, "id": i})
    _jsonl(os.path.join(directory, "sharegpt.jsonl"), convs)
    _jsonl(os.path.join(directory, "pt.jsonl"), [{"text": f"Doc {i}. {_words(i, 10 + i % 20)}."}
                                                  for i in range(300)])
    info = {"alpaca": {"file_name": "alpaca.jsonl"}, "other": {"file_name": "other.jsonl"},
            "few": {"file_name": "few.jsonl"}, "fewer": {"file_name": "fewer.jsonl"},
            "sharegpt": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt",
                         "columns": {"messages": "conversations"}},
            "pt": {"file_name": "pt.jsonl", "columns": {"prompt": "text"}}}
    info.update(_preference_data(directory))
    with open(os.path.join(directory, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return directory


def _preference_data(directory: str) -> dict:
    """Pairwise alpaca (200 rows) and sharegpt (120, some multi-turn) for dpo / rm, kto feedback (200 rows,
    2 in 3 desirable); their dataset_info.json entries."""
    _jsonl(os.path.join(directory, "pairs.jsonl"), [
        {"instruction": f"Pick {i}: {_words(i, 4)}", "input": _words(i + 4, 2) if i % 4 else "",
         "chosen": f"Good {i}: {_words(i + 1, 3 + i % 4)}", "rejected": f"Bad {i}: {_words(i + 6, 2 + i % 5)}"}
        for i in range(200)])
    chats = []
    for i in range(120):
        turns = [{"from": "human", "value": f"Ask {i}: {_words(i, 3)}"}]
        if i % 3 == 0:
            turns += [{"from": "gpt", "value": f"Sure {_words(i + 2, 2)}"},
                      {"from": "human", "value": f"More {i}: {_words(i + 8, 3)}"}]
        chats.append({"conversations": turns, "chosen": {"from": "gpt", "value": f"Fine {_words(i + 3, 4)}"},
                      "rejected": {"from": "gpt", "value": f"Poor {_words(i + 5, 3)}"}})
    _jsonl(os.path.join(directory, "pairs_sharegpt.jsonl"), chats)
    _jsonl(os.path.join(directory, "feedback.jsonl"), [
        {"instruction": f"Rate {i}: {_words(i, 4)}", "input": "", "output": f"Said {i}: {_words(i + 2, 3 + i % 3)}",
         "label": i % 3 != 0} for i in range(200)])
    return {"pairs": {"file_name": "pairs.jsonl", "ranking": True,
                      "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                  "rejected": "rejected"}},
            "pairs_sharegpt": {"file_name": "pairs_sharegpt.jsonl", "formatting": "sharegpt", "ranking": True,
                               "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
            "feedback": {"file_name": "feedback.jsonl",
                         "columns": {"prompt": "instruction", "query": "input", "response": "output",
                                     "kto_tag": "label"}}}


BASE = {
    "stage": "sft", "do_train": True, "finetuning_type": "full", "dataset": "alpaca", "template": "qwen",
    "cutoff_len": 96, "buffer_size": 1, "preprocessing_batch_size": 16, "logging_steps": 1, "save_steps": 10,
    "plot_loss": False, "overwrite_output_dir": False, "report_to": "none", "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 1, "learning_rate": 1.0e-3, "max_steps": 20, "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.0, "seed": 42, "dataloader_num_workers": 1, "disable_tqdm": True,
}


def write_yaml(directory: str, name: str, model: str, data: str, consumed_log: bool = False,
               **keys) -> tuple[str, str]:
    """(yaml path, output_dir) of a llamafactory-cli training yaml; ``keys`` override :data:`BASE`;
    ``consumed_log``: our section logs the consumed samples to ``output_dir/consumed``."""
    doc = copy.deepcopy(BASE)
    out = os.path.join(directory, name)
    doc.update(model_name_or_path=model, dataset_dir=data, output_dir=out)
    doc.update(keys)
    if consumed_log:
        doc["resumable_stream"] = {"consumed_log": os.path.join(out, "consumed")}
    doc = {k: v for k, v in doc.items() if v is not None}
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path, out


def ours(config: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "resumable_stream", "llamafactory", "train", config, *overrides]


def llamafactory_cli(config: str, *overrides: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "llamafactory-cli"), "train", config, *overrides]


def losses(out: str) -> dict[int, float]:
    """step -> logged loss, from trainer_state.json's log_history (full float precision)."""
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        history = json.load(f)["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def consumed(out: str, rank: int = 0) -> dict[int, list[str]]:
    path = os.path.join(out, "consumed", f"rank-{rank:05d}.jsonl")
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r["samples"] for r in map(json.loads, f)}


def assert_losses_equal(a: dict[int, float], b: dict[int, float], tol: float, note: str = "") -> None:
    assert sorted(a) == sorted(b), f"different steps logged: {sorted(a)} vs {sorted(b)} {note}"
    worst = max(abs(a[s] - b[s]) for s in a)
    first = next((s for s in sorted(a) if abs(a[s] - b[s]) > tol), None)
    assert first is None, f"step {first}: loss {a[first]} vs {b[first]} (max difference {worst}) {note}"


# ------------------------------------------------------------------------------------------------ multimodal
VL_TOKENIZER = os.path.join(ROOT, "examples", "tiny", "vl")     # the tiny tokenizer + Qwen2-VL's vision tokens
_COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
            "white": (245, 245, 245), "black": (20, 20, 20)}


def make_vl_model(directory: str) -> str:
    """A random-init Qwen2-VL (2 text layers of width 32, a 2-block vision tower with 8-px patches, ~100k
    parameters) with its processor: the bundled tokenizer carrying <|vision_start|>, <|vision_end|>,
    <|image_pad|>, <|video_pad|> and Qwen2-VL's image processor (PIL) at 256..4096 pixels per image. Saved
    without a video processor: transformers 5 builds those with torchvision only."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(VL_TOKENIZER)
    ids = tok.convert_tokens_to_ids
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "tie_word_embeddings": True}
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 8,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 256, "longest_edge": 4096}).save_pretrained(directory)
    with open(os.path.join(directory, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "Qwen2VLProcessor"}, f)
    return directory


def _picture(path: str, i: int) -> None:
    from PIL import Image, ImageDraw

    names = list(_COLOURS)
    w, h = [(32, 32), (48, 32), (32, 48), (64, 48)][i % 4]
    img = Image.new("RGB", (w, h), _COLOURS[names[(i + 1) % len(names)]])
    ImageDraw.Draw(img).rectangle([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=_COLOURS[names[i % len(names)]])
    img.save(path)


def vl_rows(n: int) -> list[dict]:
    """mllm_demo-style rows: sharegpt ``messages`` with ``<image>`` placeholders and ``images`` paths relative to
    dataset_dir (``pictures/N.png``); every third row two turns and two images, some with a system message."""
    names = list(_COLOURS)
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"<image>What colour is square {i}?"},
                    {"role": "assistant", "content": f"The square is {names[i % 6]} on {names[(i + 1) % 6]}."}]
        images = [f"pictures/{i}.png"]
        if i % 3 == 0:
            messages += [{"role": "user", "content": f"And this one? <image> {_words(i, 2)}"},
                         {"role": "assistant", "content": f"That one is {names[(i + 7) % 6]}. {_words(i, 3)}"}]
            images.append(f"pictures/{(i + 7) % n}.png")
        if i % 5 == 0:
            messages.insert(0, {"role": "system", "content": "You describe pictures."})
        rows.append({"messages": messages, "images": images})
    return rows


def make_vl_data(directory: str, n: int = 60) -> str:
    """dataset_dir with ``pictures/`` (n PNGs of 32..64 px), ``mllm.json`` (n rows, as LLaMA-Factory's
    mllm_demo.json: one JSON array) and its dataset_info.json entry ``mllm`` (as LLaMA-Factory's own)."""
    os.makedirs(os.path.join(directory, "pictures"), exist_ok=True)
    for i in range(n):
        _picture(os.path.join(directory, "pictures", f"{i}.png"), i)
    with open(os.path.join(directory, "mllm.json"), "w", encoding="utf-8") as f:
        json.dump(vl_rows(n), f, indent=1)
    entry = {"formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                      "system_tag": "system"}}
    with open(os.path.join(directory, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({"mllm": {"file_name": "mllm.json", **entry}}, f, indent=1)
    return directory


def llamafactory_cli_vl(config: str) -> list[str]:
    """``llamafactory-cli train`` with Qwen2-VL's processor built without its video processor (lf_cli_vl.py)."""
    return [sys.executable, os.path.join(HERE, "lf_cli_vl.py"), "train", config]
