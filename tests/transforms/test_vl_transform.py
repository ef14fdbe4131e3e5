"""Vision-language transform: labels and image tokens, image sources, bad-sample policies, over-length,
collate (variable images per sample, checked against the tiny model), processor state and fingerprint,
config keys, the processor loader, exact resume through the loader, and the bundled tiny assets."""

from __future__ import annotations

import copy
import errno
import functools
import io
import logging
import os
import pickle
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from http_server import FileServer
from PIL import Image
from repo_paths import REPO_ROOT
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import ConfigError, StreamMismatchError
from resumable_stream.io import net
from resumable_stream.io.net import RetryPolicy
from resumable_stream.loader import StreamLoader
from resumable_stream.transforms import IGNORE_INDEX, TransformConfig, TransformError, VLProcessor, collate_vl
from resumable_stream.transforms import vl as vl_module
from resumable_stream.transforms.vl import load_processor, processor_digest

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
PROC_DIR = os.path.join(TINY, "vl")
TOKENS_PER_16PX = 1   # tiny processor: 8-px patches merged 2x2 -> one image token per 16x16 pixels


@pytest.fixture(scope="module")
def processor():
    return load_processor(PROC_DIR)


def png(w: int = 32, h: int = 32, color=(200, 30, 30), mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format=fmt)
    return buf.getvalue()


def struct(data: bytes | None = None, path: str | None = None) -> dict:
    return {"bytes": data, "path": path}


def chat(*turns: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


def make(processor, **cfg) -> VLProcessor:
    return VLProcessor(processor, TransformConfig(format="vl", **cfg))


def encode(proc: VLProcessor, sample: dict, key="k") -> dict:
    proc.feed(sample, key)
    assert proc.ready() == 1, f"no example made: {proc.stats()}"
    return proc.take()


def label_runs(ex: dict) -> list[list[int]]:
    runs, cur = [], []
    for t, lab in zip(ex["input_ids"].tolist(), ex["labels"].tolist()):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def image_runs(ids: np.ndarray, image_id: int) -> list[int]:
    """Lengths of the runs of image tokens, in order."""
    out, n = [], 0
    for t in ids.tolist() + [-1]:
        if t == image_id:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


# ------------------------------------------------------------------------------------------ labels and tokens
def test_labels_only_assistant_turns_and_image_tokens_expand(processor):
    proc = make(processor)
    sample = {"messages": chat("<image>What shape is this?", "A red square.", "And the colour?", "It is red.",
                               system="You describe pictures."),
              "images": [struct(png(48, 32))]}
    ex = encode(proc, sample)
    tok = processor.tokenizer
    assert [tok.decode(r) for r in label_runs(ex)] == ["A red square.<|im_end|>", "It is red.<|im_end|>"]
    # 48x32 px -> 3x2 image tokens; 6x4 patches of 3*2*8*8 values (HF's own smart_resize keeps the size)
    assert image_runs(ex["input_ids"], proc.image_token_id) == [3 * 2 * TOKENS_PER_16PX]
    assert ex["vision"]["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert ex["vision"]["pixel_values"].shape == (24, 3 * 2 * 8 * 8)
    assert ex["labels"][ex["input_ids"] == proc.image_token_id].tolist() == [IGNORE_INDEX] * 6
    # the model inputs are the processor's own, for the chat-template rendering with structured content
    conv = [{"role": m["role"], "content": [{"type": "text", "text": m["content"].replace("<image>", "")}]}
            for m in sample["messages"]]
    conv[1]["content"].insert(0, {"type": "image"})
    text = processor.apply_chat_template(conv, tokenize=False)
    ref = processor(text=[text], images=[Image.open(io.BytesIO(png(48, 32)))], return_tensors="np")
    assert ex["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert np.allclose(ex["vision"]["pixel_values"], ref["pixel_values"])
    assert ex["token"]["mm_token_type_ids"].tolist() == ref["mm_token_type_ids"][0].tolist()
    assert ex["keys"] == ["k"] and proc.stats()["images"] == 1


def test_placeholders_anywhere_several_images_and_text_only(processor):
    proc = make(processor)
    sample = {"messages": chat("Left <image> and right <image>: same?", "No."),
              "images": [struct(png(32, 32)), struct(png(64, 48))]}
    ex = encode(proc, sample)
    assert image_runs(ex["input_ids"], proc.image_token_id) == [2 * 2, 4 * 3]   # in placeholder order
    assert ex["vision"]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    text = processor.tokenizer.decode(ex["input_ids"])
    assert text.index("Left ") < text.index("<|vision_start|>") < text.index(" and right ")
    plain = encode(proc, {"messages": chat("Hello?", "Hi."), "images": []})
    assert plain["vision"] == {} and proc.image_token_id not in plain["input_ids"]
    assert [processor.tokenizer.decode(r) for r in label_runs(plain)] == ["Hi.<|im_end|>"]


# Qwen2-VL's chat template (transformers' Qwen2VLProcessor): a default system prompt when the conversation
# does not start with one
QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
# a reasoning template in the Qwen3-thinking style: an assistant's <think>...</think> block is not rendered
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif m['role'] == 'assistant' %}"
    "{{ c['text'].split('</think>')[-1] | trim }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(processor, template: str):
    other = copy.deepcopy(processor)
    other.chat_template = template
    return other


@pytest.mark.parametrize("content", ["a", "helpful", "You are", "Hello! Send me a picture."])
def test_a_conversation_opened_by_the_assistant_is_not_matched_in_the_system_prompt(processor, content):
    proc = make(with_template(processor, QWEN2VL_TEMPLATE))
    msgs = [{"role": "assistant", "content": content}, {"role": "user", "content": "<image>ok"},
            {"role": "assistant", "content": "fine"}]
    ex = encode(proc, {"messages": msgs, "images": [struct(png())]})
    text = processor.tokenizer.decode(ex["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n")
    assert [processor.tokenizer.decode(r) for r in label_runs(ex)] == [f"{content}<|im_end|>", "fine<|im_end|>"]


@pytest.mark.parametrize("template", ["bundled", "qwen2-vl"])
def test_images_inside_an_assistant_turn_one_end_of_turn_no_vision_tokens(processor, template):
    proc = make(processor if template == "bundled" else with_template(processor, QWEN2VL_TEMPLATE))
    tok = processor.tokenizer
    vision = {tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")}
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cases = {"here <image> and more": ["here", " and more<|im_end|>"],
             "look: <image>": ["look: ", "<|im_end|>"],
             "<image> then text": [" then text<|im_end|>"],
             "two <image><image>": ["two ", "<|im_end|>"],
             "a <image> b <image>": ["a", " b ", "<|im_end|>"]}
    for content, runs in cases.items():
        n = content.count("<image>") + 1
        ex = encode(proc, {"messages": chat("<image>q", content), "images": [struct(png())] * n})
        assert [tok.decode(r) for r in label_runs(ex)] == runs, content
        labelled = ex["labels"][ex["labels"] != IGNORE_INDEX].tolist()
        assert not vision & set(labelled) and labelled.count(im_end) == 1, content


def test_a_template_that_rewrites_assistant_text_follows_bad_sample(processor, caplog):
    think = with_template(processor, THINK_TEMPLATE)
    row = {"messages": chat("<image>What is it?", "<think>It is red.</think>A red square."),
           "images": [struct(png())]}
    plain = {"messages": chat("<image>What is it?", "A red square."), "images": [struct(png())]}
    with pytest.raises(TransformError) as e:
        make(think).feed(row, "think-row")
    assert e.value.key == "think-row" and "sample 'think-row': assistant message 1 does not appear verbatim" in \
        str(e.value) and "data.bad_sample" in str(e.value)
    proc = make(think, bad_sample="skip")
    with caplog.at_level(logging.WARNING, logger="resumable_stream.transforms.vl"):
        for key, sample in [("a", plain), ("think-row", row), ("b", plain)]:
            proc.feed(sample, key)
    assert [proc.take()["keys"] for _ in range(proc.ready())] == [["a"], ["b"]]
    assert proc.stats()["skipped_processor"] == 1 and "think-row" in caplog.text


def test_collate_variable_images_matches_the_model_sample_by_sample(processor):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from resumable_stream.app.train import _vl_config_fields

    proc = make(processor)
    samples = [
        {"messages": chat("<image>Describe.", "A blue circle on a white background."), "images": [struct(png(48, 48))]},
        {"messages": chat("<image><image>Same shape?", "Yes."), "images": [struct(png(32, 32)), struct(png(32, 64))]},
        {"messages": chat("No picture here.", "Fine."), "images": []},
    ]
    exs = [encode(proc, s, i) for i, s in enumerate(samples)]
    batch = collate_vl(exs, processor.tokenizer.pad_token_id)
    lengths = [len(e["input_ids"]) for e in exs]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["image_grid_thw"].tolist() == [[1, 6, 6], [1, 4, 4], [1, 8, 4]]
    assert batch["pixel_values"].shape[0] == 36 + 16 + 32
    assert torch.equal(batch["pixel_values"][36:52], torch.from_numpy(exs[1]["vision"]["pixel_values"][:16]))
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert "keys" not in batch

    with open(os.path.join(TINY, "train_vl.yaml"), encoding="utf-8") as f:
        fields = dict(yaml.safe_load(f)["model"]["config"])
    model_type = fields.pop("model_type")
    _vl_config_fields(fields, processor)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **fields)).eval()
    with torch.no_grad():
        batched = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for r, ex in enumerate(exs):
            one = model(**{k: v for k, v in collate_vl([ex], processor.tokenizer.pad_token_id).items()
                           if k != "labels"}).logits[0]
            assert torch.allclose(batched[r, :lengths[r]], one, atol=1e-4), f"sample {r} differs when batched"
        loss = model(**batch).loss
    assert torch.isfinite(loss)


# ------------------------------------------------------------------------------------------ image sources
def test_image_sources_give_the_same_pixels(processor, tmp_path):
    data = png(48, 32, (10, 200, 90))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    rgba = io.BytesIO()
    Image.new("RGBA", (48, 32), (10, 200, 90, 255)).save(rgba, format="PNG")
    with FileServer(tmp_path / "imgs") as srv:
        values = {
            "struct bytes": struct(data),
            "struct path": struct(None, str(tmp_path / "imgs" / "a.png")),
            "raw bytes": data,
            "absolute path": str(tmp_path / "imgs" / "a.png"),
            "relative path + image_dir": "a.png",
            "url": srv.url("a.png"),
            "PIL image": Image.open(io.BytesIO(data)),
            "RGBA, opaque": rgba.getvalue(),
            "palette PNG": _palette_png(),
        }
        proc = make(processor, image_dir=str(tmp_path / "imgs"), allow_absolute_image_paths=True)
        got = {name: encode(proc, {"messages": chat("<image>Colour?", "Green."), "images": [v]}, name)
               for name, v in values.items()}
    ref = got["struct bytes"]["vision"]["pixel_values"]
    for name, ex in got.items():
        assert np.array_equal(ex["vision"]["pixel_values"], ref), f"{name}: other pixels"
        assert ex["input_ids"].tolist() == got["struct bytes"]["input_ids"].tolist()


def test_premultiplied_alpha_modes_convert_and_a_failed_conversion_is_a_bad_sample(processor, monkeypatch):
    la = Image.new("LA", (32, 32), (120, 255))
    rgba = Image.new("RGBA", (32, 32), (120, 40, 200, 255))
    proc = make(processor, bad_sample="skip")
    pixels = {name: encode(proc, {"messages": chat("<image>?", "!"), "images": [img]}, name)["vision"]["pixel_values"]
              for name, img in [("LA", la), ("La", la.convert("La")), ("RGBA", rgba), ("RGBa", rgba.convert("RGBa"))]}
    assert np.array_equal(pixels["La"], pixels["LA"]) and np.array_equal(pixels["RGBa"], pixels["RGBA"])

    def boom(*args, **kwargs):
        raise ValueError("conversion not supported")

    monkeypatch.setattr(Image, "alpha_composite", boom)
    proc.feed({"messages": chat("<image>?", "!"), "images": [la]}, "conv")
    assert proc.stats()["skipped_image"] == 1 and proc.ready() == 0
    with pytest.raises(TransformError, match=r"sample 'conv': image 0 cannot be converted from mode 'LA' to RGB"):
        make(processor).feed({"messages": chat("<image>?", "!"), "images": [la]}, "conv")


def _palette_png() -> bytes:
    img = Image.new("P", (48, 32), 0)
    img.putpalette([10, 200, 90] + [0] * 765)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_url_faults_are_retried_and_a_404_is_a_bad_sample(processor, tmp_path, monkeypatch):
    monkeypatch.setattr(net.time, "sleep", lambda s: None)
    (tmp_path / "a.png").write_bytes(png(32, 32))
    proc = make(processor, bad_sample="skip")
    with FileServer(tmp_path) as srv:
        clean = encode(proc, {"messages": chat("<image>?", "!"), "images": [srv.url("a.png")]})
        faults = iter(["truncate", 503])             # a cut body, then a 503, then the real answer
        srv.faults = [lambda record: next(faults, None)]
        again = encode(proc, {"messages": chat("<image>?", "!"), "images": [srv.url("a.png")]})
        assert next(faults, "used") == "used"
        proc.feed({"messages": chat("<image>?", "!"), "images": [srv.url("gone.png")]}, "g")
    assert np.array_equal(clean["vision"]["pixel_values"], again["vision"]["pixel_values"])
    assert proc.stats()["skipped_image"] == 1 and proc.ready() == 0


def test_unreachable_url_is_an_error_even_when_skipping(processor, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed again: connections are refused
    proc = VLProcessor(processor, TransformConfig(format="vl", bad_sample="skip"),
                       RetryPolicy.of(retries=1, retry_backoff_s=0.01))
    url = f"http://127.0.0.1:{port}/a.png"
    with pytest.raises(TransformError, match=r"no answer after 2 attempts \(data.retries: 1.*not skipped") as e:
        proc.feed({"messages": chat("<image>?", "!"), "images": [url]}, "s1")
    assert str(e.value).startswith("sample 's1': image 0 URL ") and e.value.key == "s1"


def _url_policy(**kw) -> RetryPolicy:
    return RetryPolicy(StreamConfig(dataset_name_or_path="parquet", data_files="x.parquet", **kw).source_spec.net,
                       remote=True)


@pytest.mark.parametrize("failures,retries", [(2, 2), (3, 2), (1, 0)])
def test_image_urls_are_fetched_under_data_retries(processor, tmp_path, failures, retries):
    """An image URL that fails ``failures`` times then answers: fetched when data.retries allows that many
    more tries, an error (not a skipped sample) when it does not; the waits are data.retry_backoff_s's."""
    (tmp_path / "a.png").write_bytes(png(32, 32))
    proc = VLProcessor(processor, TransformConfig(format="vl", bad_sample="skip"),
                       _url_policy(retries=retries, retry_backoff_s=0.01))
    with FileServer(tmp_path) as srv:
        faults = iter([503, "reset", "truncate"][:failures])
        srv.faults = [lambda record: next(faults, None)]
        sample = {"messages": chat("<image>?", "!"), "images": [srv.url("a.png")]}
        if failures <= retries:
            encode(proc, sample)
            assert proc.stats()["skipped_image"] == 0
        else:
            with pytest.raises(TransformError, match=rf"no answer after {retries + 1} attempts \(data.retries: "
                                                     rf"{retries}"):
                proc.feed(sample, "k")
        assert srv.stats()["requests"] == min(failures, retries) + 1      # one try each, the last one answered


def test_image_urls_time_out_after_data_timeout_s(processor, tmp_path):
    """A server that sends headers then stalls: the try ends after data.timeout_s (not urllib's 30 s of
    before), and the next one gets the image."""
    import time

    (tmp_path / "a.png").write_bytes(png(32, 32))
    proc = VLProcessor(processor, TransformConfig(format="vl"), _url_policy(timeout_s=0.5, retry_backoff_s=0.01))
    with FileServer(tmp_path) as srv:
        srv.stall_s = 20.0
        stalls = iter(["stall"])
        srv.faults = [lambda record: next(stalls, None)]
        started = time.monotonic()
        encode(proc, {"messages": chat("<image>?", "!"), "images": [srv.url("a.png")]})
        took = time.monotonic() - started
    assert 0.5 <= took < 5.0, took


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EIO, errno.EACCES])
def test_local_io_failure_is_an_error_even_when_skipping(processor, tmp_path, monkeypatch, code):
    """Only a missing file / a directory is a property of the sample; EMFILE, EIO, EACCES depend on the
    machine, and skipping on them would make a resumed run skip other samples."""
    path = tmp_path / "a.png"
    path.write_bytes(png())
    real_read = vl_module.read_regular_file

    def failing_read(file, *args, **kwargs):
        if str(file) == str(path):
            raise OSError(code, os.strerror(code), str(file))
        return real_read(file, *args, **kwargs)

    monkeypatch.setattr(vl_module, "read_regular_file", failing_read)
    proc = make(processor, bad_sample="skip", image_dir=str(tmp_path))
    with pytest.raises(TransformError) as e:
        proc.feed({"messages": chat("<image>?", "!"), "images": ["a.png"]}, "row-9")
    msg = str(e.value)
    assert e.value.key == "row-9" and msg.startswith("sample 'row-9': image 0 file ")
    assert str(path) in msg and f"errno {code} {errno.errorcode[code]}" in msg and "not skipped" in msg
    assert proc.stats()["skipped_image"] == 0


def test_a_directory_in_the_path_is_a_bad_sample(processor, tmp_path):
    (tmp_path / "file.png").write_bytes(png())
    proc = make(processor, bad_sample="skip", image_dir=str(tmp_path))
    for key, value in [("dir", "."), ("under-file", "file.png/x.png")]:
        proc.feed({"messages": chat("<image>?", "!"), "images": [value]}, key)
    assert proc.stats()["skipped_image"] == 2 and proc.ready() == 0


# ------------------------------------------------------------------------------------------ bounded image reads
def test_image_reads_are_bounded_and_confined_to_image_dir(processor, tmp_path):
    """/dev/zero, a FIFO nobody writes to, a directory, files and bytes over data.max_image_bytes, absolute
    paths and ``..`` / symlink escapes out of data.image_dir: each a bad sample naming the reason, no hang."""
    imgs, outside = tmp_path / "imgs", tmp_path / "outside"
    imgs.mkdir()
    outside.mkdir()
    (imgs / "ok.png").write_bytes(GOOD)
    (outside / "secret.png").write_bytes(GOOD)
    os.mkfifo(imgs / "fifo.png")
    (imgs / "link.png").symlink_to(outside / "secret.png")
    (imgs / "zero.png").symlink_to("/dev/zero")
    (imgs / "big.png").write_bytes(GOOD + bytes(2000))
    limit = len(GOOD) + 1000
    cases = {
        "fifo": ("fifo.png", "not a regular file (a FIFO)"),
        "dev-zero": (struct(None, "/dev/zero"), "is absolute"),
        "dev-zero via link": ("zero.png", "leads out of data.image_dir"),
        "absolute": (str(outside / "secret.png"), "is absolute"),
        "dot-dot": ("../outside/secret.png", "leads out of data.image_dir"),
        "symlink out": ("link.png", "leads out of data.image_dir"),
        "directory": (".", "not a regular file (a directory)"),
        "big file": ("big.png", f"over the limit of {limit}"),
        "big bytes": (GOOD + bytes(2000), f"over data.max_image_bytes {limit}"),
        "big struct bytes": (struct(GOOD + bytes(2000)), f"over data.max_image_bytes {limit}"),
    }
    for name, (value, reason) in cases.items():
        proc = make(processor, image_dir=str(imgs), max_image_bytes=limit)
        with pytest.raises(TransformError) as e:
            proc.feed({"messages": chat("<image>?", "!"), "images": [value]}, name)
        assert f"sample {name!r}" in str(e.value) and reason in str(e.value), (name, str(e.value))
    skipping = make(processor, image_dir=str(imgs), max_image_bytes=limit, bad_sample="skip")
    for name, (value, _) in cases.items():
        skipping.feed({"messages": chat("<image>?", "!"), "images": [value]}, name)
    skipping.feed({"messages": chat("<image>?", "!"), "images": ["ok.png"]}, "ok")
    assert skipping.stats()["skipped_image"] == len(cases)
    assert [skipping.take()["keys"] for _ in range(skipping.ready())] == [["ok"]]
    # allowed on purpose: absolute paths and links out of image_dir are read (regular files only, still bounded)
    free = make(processor, image_dir=str(imgs), max_image_bytes=limit, allow_absolute_image_paths=True,
                bad_sample="skip")
    for value in (str(outside / "secret.png"), "../outside/secret.png", "link.png", "zero.png", "fifo.png"):
        free.feed({"messages": chat("<image>?", "!"), "images": [value]}, value)
    assert free.ready() == 3 and free.stats()["skipped_image"] == 2


def test_a_download_over_the_limit_is_a_bad_sample(processor, tmp_path):
    (tmp_path / "big.png").write_bytes(GOOD + bytes(5000))
    proc = make(processor, max_image_bytes=len(GOOD) + 100)
    with FileServer(tmp_path) as srv, pytest.raises(TransformError, match="over data.max_image_bytes"):
        proc.feed({"messages": chat("<image>?", "!"), "images": [srv.url("big.png")]}, "dl")


# ------------------------------------------------------------------------------------------ bad samples
def _mode_image(mode: str, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (32, 32), 7).save(buf, format=fmt)
    return buf.getvalue()


GOOD = png()
BAD_CASES = {
    # name: (messages, images, stats counter, words in the reason)
    "truncated": (chat("<image>?", "!"), [struct(GOOD[: len(GOOD) // 2])], "skipped_image", "truncated"),
    "garbage bytes": (chat("<image>?", "!"), [b"not an image at all"], "skipped_image", "cannot be decoded"),
    "missing file": (chat("<image>?", "!"), [struct(None, "nonexistent/x.png")], "skipped_image", "not found"),
    "no bytes no path": (chat("<image>?", "!"), [struct(None, None)], "skipped_image", "neither bytes nor a path"),
    "null image": (chat("<image>?", "!"), [None], "skipped_image", "image 0 is null"),
    "16-bit mode": (chat("<image>?", "!"), [_mode_image("I;16", "PNG")], "skipped_image", "unsupported mode 'I;16'"),
    "float mode": (chat("<image>?", "!"), [_mode_image("F", "TIFF")], "skipped_image", "unsupported mode 'F'"),
    "more placeholders": (chat("<image><image>?", "!"), [struct(GOOD)], "skipped_mismatch",
                          "2 <image> placeholder(s) in the messages but 1 image(s)"),
    "fewer placeholders": (chat("no placeholder", "!"), [struct(GOOD)], "skipped_mismatch",
                           "0 <image> placeholder(s) in the messages but 1 image(s)"),
    "second image broken": (chat("<image><image>?", "!"), [struct(GOOD), b"junk"], "skipped_image", "image 1"),
    "processor refuses": (chat("<image>?", "!"), [png(1, 300)], "skipped_processor", "processor failed"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_sample_error_names_the_sample_and_the_reason(processor, case):
    messages, images, _, reason = BAD_CASES[case]
    proc = make(processor, bad_sample="error")
    with pytest.raises(TransformError) as e:
        proc.feed({"messages": messages, "images": images}, "row-17")
    assert "sample 'row-17'" in str(e.value) and reason in str(e.value) and "data.bad_sample" in str(e.value)
    assert e.value.key == "row-17"


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_sample_skip_counts_logs_and_moves_on(processor, case, caplog):
    messages, images, counter, reason = BAD_CASES[case]
    proc = make(processor, bad_sample="skip")
    good = {"messages": chat("<image>?", "!"), "images": [struct(GOOD)]}
    with caplog.at_level(logging.WARNING, logger="resumable_stream.transforms.vl"):
        proc.feed(good, "a")
        proc.feed({"messages": messages, "images": images}, "row-17")
        proc.feed(good, "b")
    assert [proc.take()["keys"] for _ in range(proc.ready())] == [["a"], ["b"]]
    stats = proc.stats()
    assert stats[counter] == 1 and stats["samples"] == 3 and stats["examples"] == 2
    assert sum(v for k, v in stats.items() if k.startswith(("skipped", "dropped"))) == 1
    assert any("row-17" in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text


def test_over_length_is_an_error_or_dropped_never_cut(processor):
    big = {"messages": chat("<image>Describe.", "A picture."), "images": [struct(png(64, 64))]}   # 16 image tokens
    small = {"messages": chat("<image>Describe.", "A picture."), "images": [struct(png(32, 32))]}  # 4 image tokens
    n_small = len(encode(make(processor), small)["input_ids"])
    limit = n_small + 4
    with pytest.raises(TransformError, match=rf"sample 'big'.*image tokens.*data.max_seq_len {limit}"):
        make(processor, max_seq_len=limit).feed(big, "big")
    proc = make(processor, max_seq_len=limit, bad_sample="skip")
    for key, s in [("s1", small), ("big", big), ("s2", small)]:
        proc.feed(s, key)
    kept = [proc.take() for _ in range(proc.ready())]
    assert [e["keys"] for e in kept] == [["s1"], ["s2"]] and proc.stats()["dropped_overlong"] == 1
    assert all(image_runs(e["input_ids"], proc.image_token_id) == [4] for e in kept)
    # text alone over the limit: dropped before any image work
    long_text = {"messages": chat("<image>" + "word " * 400, "ok"), "images": [struct(b"never decoded")]}
    proc.feed(long_text, "long")
    assert proc.stats()["dropped_overlong"] == 2 and proc.stats()["skipped_image"] == 0


def test_empty_and_malformed_conversations(processor):
    proc = make(processor)
    proc.feed({"messages": [], "images": []}, "e1")
    proc.feed({"messages": chat("<image>only a question")[:1], "images": [struct(GOOD)]}, "e2")
    assert proc.stats()["skipped_empty"] == 2 and proc.ready() == 0
    with pytest.raises(TransformError, match="sample 'e3'.*no assistant turn"):
        make(processor, empty="error").feed({"messages": chat("q")[:1], "images": []}, "e3")
    with pytest.raises(TransformError, match="sample 'm1'.*data.images_column 'images' holds str"):
        proc.feed({"messages": chat("<image>?", "!"), "images": "x.png"}, "m1")
    with pytest.raises(TransformError, match="sample 'm2'.*message 0"):
        proc.feed({"messages": [{"role": "user", "content": 3}], "images": []}, "m2")


# ------------------------------------------------------------------------------------------ state, fingerprint
def test_state_with_pending_examples_survives_safetensors(processor):
    proc = make(processor, bad_sample="skip")
    samples = [{"messages": chat("<image>?", f"answer {i}"), "images": [struct(png(32 + 16 * i, 32))]}
               for i in range(3)]
    for i, s in enumerate(samples):
        proc.feed(s, i)
    proc.feed({"messages": chat("<image>?", "!"), "images": [b"junk"]}, "bad")
    state = proc.state()
    blob = st_save({k: np.ascontiguousarray(v) for k, v in state["tensors"].items()})
    again = make(processor, bad_sample="skip")
    again.load_state({"tensors": st_load(blob), "meta": state["meta"]})
    assert again.stats() == proc.stats() and again.ready() == 3
    for _ in range(3):
        a, b = proc.take(), again.take()
        assert a["keys"] == b["keys"]
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])
        for group in ("token", "vision"):
            assert sorted(a[group]) == sorted(b[group])
            for name in a[group]:
                assert a[group][name].dtype == b[group][name].dtype
                assert np.array_equal(a[group][name], b[group][name])


def test_state_from_other_settings_is_refused(processor, tmp_path):
    state = make(processor, bad_sample="skip").state()
    with pytest.raises(StreamMismatchError, match="transform.max_seq_len: saved 1024, now 512"):
        make(processor, bad_sample="skip", max_seq_len=512).load_state(state)
    # a run stopped by bad_sample: error resumes with skip to get past the sample (it never skipped before)
    make(processor, bad_sample="skip").load_state(make(processor, bad_sample="error").state())
    other = load_processor(PROC_DIR)
    other.image_processor.size = {"shortest_edge": 256, "longest_edge": 64 * 128}    # other max_pixels
    assert processor_digest(other) != processor_digest(processor)
    with pytest.raises(StreamMismatchError, match="transform.processor"):
        make(other, bad_sample="skip").load_state(state)


def test_processor_loads_saves_and_pickles(processor, tmp_path):
    assert type(processor).__name__ == "Qwen3VLProcessor" and processor.image_token_id is not None
    processor.save_pretrained(str(tmp_path / "saved"))
    again = load_processor(str(tmp_path / "saved"))
    assert processor_digest(again) == processor_digest(processor)
    assert processor_digest(pickle.loads(pickle.dumps(processor))) == processor_digest(processor)
    with pytest.raises(OSError):
        load_processor(str(tmp_path / "nothing-here"))


# ------------------------------------------------------------------------------------------ config keys
@pytest.mark.parametrize("section, message", [
    ({"format": "vl", "packing": True}, "data.packing: got True with data.format 'vl'"),
    ({"format": "vl", "overlong": "truncate"}, "data.overlong: got 'truncate'; not used with data.format 'vl'"),
    ({"format": "vl", "overlong": "drop"}, "follows data.bad_sample"),
    ({"format": "vl", "bad_sample": "ignore"}, "data.bad_sample: got 'ignore'; allowed: one of error, skip"),
    ({"format": "vl", "images_column": ""}, "data.images_column: got ''"),
    ({"format": "vl", "image_dir": 5}, "data.image_dir: got 5"),
    ({"format": "vl", "max_image_bytes": 0}, "data.max_image_bytes: got 0; allowed: an integer from 1"),
    ({"format": "vl", "max_image_bytes": "64MB"}, "data.max_image_bytes: got '64MB'"),
    ({"format": "vl", "max_image_bytes": 2.5}, "data.max_image_bytes: got 2.5"),
    ({"format": "vl", "allow_absolute_image_paths": "yes"}, "data.allow_absolute_image_paths: got 'yes'; allowed: "
                                                            "true or false"),
    ({"format": "video"}, "data.format: got 'video'; allowed: one of text, messages, vl"),
])
def test_bad_vl_config_values(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TransformConfig.from_dict(section)


def test_trainer_config_vl_needs_a_processor_and_resolves_paths(tmp_path):
    from resumable_stream.config.trainer import TrainerConfig

    with open(os.path.join(TINY, "train_vl.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["data"]["image_dir"] = "vl"
    cfg = TrainerConfig.from_dict(doc, base_dir=TINY)
    assert cfg.model.processor == PROC_DIR and cfg.transform.image_dir == PROC_DIR
    assert cfg.transform.format == "vl" and cfg.transform.bad_sample == "skip"
    no_proc = {**doc, "model": {k: v for k, v in doc["model"].items() if k != "processor"}}
    with pytest.raises(ConfigError, match="model.processor: missing"):
        TrainerConfig.from_dict(no_proc, base_dir=TINY)
    text_with_processor = {**doc, "data": {**doc["data"], "format": "messages"}}
    with pytest.raises(ConfigError, match="model.tokenizer: missing"):
        TrainerConfig.from_dict(text_with_processor, base_dir=TINY)


# ------------------------------------------------------------------------------------------ through the loader
def _loader(processor, state=None, workers=0):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(TINY, "data_vl", "*.parquet"),
                       shuffle=True, buffer_size=128, shuffle_seed=7)
    stream = ResumableStream(cfg, rank=0, world_size=1, num_workers=workers)
    factory = functools.partial(VLProcessor, processor, TransformConfig(format="vl", bad_sample="skip"))
    loader = StreamLoader(stream, batch_size=8, processor_factory=factory, num_workers=workers,
                          collate_fn=functools.partial(collate_vl, pad_token_id=processor.tokenizer.pad_token_id),
                          key_fn=lambda sample, where: str(sample["id"]), keep_keys=True)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _take(loader, n: int) -> list[dict]:
    out = []
    for batch in loader:
        out.append({"keys": loader.pop_consumed_keys(), "input_ids": batch["input_ids"],
                    "pixel_values": batch["pixel_values"]})
        if len(out) == n:
            break
    return out


def test_skips_resume_exactly_through_the_loader(processor):
    """40 batches straight vs 17 + resume + 23: the same samples, the same tensors, the same skip counts,
    with broken rows (~1.5% of the bundled data) skipped on both sides of the cut."""
    straight_loader = _loader(processor)
    straight = _take(straight_loader, 40)
    first_loader = _loader(processor)
    first = _take(first_loader, 17)
    state = first_loader.state_dict()
    cut_stats = first_loader.rank_state()["transform"][0]["meta"]["stats"]
    resumed_loader = _loader(processor, state)
    rest = _take(resumed_loader, 23)
    for i, (a, b) in enumerate(zip(straight, first + rest)):
        assert a["keys"] == b["keys"], f"batch {i}: other samples"
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    end = straight_loader.rank_state()["transform"][0]["meta"]["stats"]
    assert resumed_loader.rank_state()["transform"][0]["meta"]["stats"] == end
    skips = lambda s: s["skipped_image"] + s["skipped_mismatch"]  # noqa: E731
    assert 0 < skips(cut_stats) < skips(end), f"no skip on one side of the cut: {cut_stats} -> {end}"


# ------------------------------------------------------------------------------------------ bundled assets
@pytest.mark.slow
def test_bundled_assets_are_reproducible_and_small():
    r = subprocess.run([sys.executable, os.path.join(TINY, "make_vl_assets.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
    size = sum(os.path.getsize(os.path.join(d, f)) for d in (os.path.join(TINY, "vl"), os.path.join(TINY, "data_vl"))
               for f in os.listdir(d))
    assert size < 2_000_000, f"bundled VL assets are {size} bytes"


def test_a_row_the_source_marks_bad_follows_data_bad_sample(processor, caplog):
    """A row a source could not read whole (``__bad_sample__``: a broken tar member) is data.bad_sample's:
    skipped and counted, or an error with the source's reason; an unmarked row (None) is encoded."""
    why = "data file '/d/a.tar': sample 'k7': member .jpg is cut short by the end of the tar (3 of 900 bytes)"
    row = {"messages": chat("<image>Describe.", "A picture."), "images": [None], "__bad_sample__": why}
    skip = make(processor, bad_sample="skip")
    with caplog.at_level(logging.WARNING):
        skip.feed(row, "0:7")
    assert skip.ready() == 0 and skip.stats()["skipped_bad"] == 1 and skip.stats()["skipped_image"] == 0
    assert why in caplog.text
    with pytest.raises(TransformError, match=r"sample '0:7': data file '/d/a.tar': sample 'k7': member \.jpg is cut "
                                             r"short.*data.bad_sample is 'error'"):
        make(processor).feed(row, "0:7")
    good = {**row, "images": [struct(png())], "__bad_sample__": None}
    assert len(encode(make(processor), good)["input_ids"]) > 0


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_nul_path_and_an_image_over_the_pixel_bound_are_bad_samples(processor, tmp_path, monkeypatch):
    """Issue 49: a NUL byte in a path raised a plain ValueError from os.path.realpath and stopped training even
    under bad_sample: skip; a small PNG of many pixels was decoded whole and trained on."""
    (tmp_path / "ok.png").write_bytes(png(32, 32))
    (tmp_path / "wide.png").write_bytes(png(64, 40))
    rows = {"nul": "ok\0.png", "wide": "wide.png", "ok": "ok.png"}
    skipping = make(processor, image_dir=str(tmp_path), bad_sample="skip", max_image_pixels=2048)
    for key, image in rows.items():
        skipping.feed({"messages": chat("<image>?", "!"), "images": [image]}, key)
    assert skipping.stats()["skipped_image"] == 2 and [skipping.take()["keys"] for _ in range(skipping.ready())] \
        == [["ok"]]
    strict = make(processor, image_dir=str(tmp_path), max_image_pixels=2048)
    with pytest.raises(TransformError, match=r"sample 'wide': image 0 is 64x40 = 2560 pixels, over "
                                             r"data.max_image_pixels 2048"):
        strict.feed({"messages": chat("<image>?", "!"), "images": ["wide.png"]}, "wide")
    with pytest.raises(TransformError, match=r"sample 'nul': image 0 path 'ok\\x00.png' holds a NUL byte"):
        strict.feed({"messages": chat("<image>?", "!"), "images": ["ok\0.png"]}, "nul")
    # the key is in the transform's fingerprint only when set: checkpoints of earlier versions still resume
    assert "max_image_pixels" in strict.fingerprint() and "max_image_pixels" not in make(processor).fingerprint()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2048)      # null: Pillow's own bound
    with pytest.raises(TransformError, match=r"over data.max_image_pixels \(null: Pillow's Image.MAX_IMAGE_PIXELS\) "
                                             r"2048"):
        make(processor, image_dir=str(tmp_path)).feed({"messages": chat("<image>?", "!"), "images": ["wide.png"]}, "w")
