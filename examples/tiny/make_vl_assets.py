"""Build the tiny offline vision-language assets: a Qwen3-VL-style processor and a small image dataset.

Deterministic: running it again rewrites identical files (with the same Pillow / zlib). Outputs (committed):

- ``examples/tiny/vl/``: a processor that ``AutoProcessor.from_pretrained`` (or, without torchvision,
  ``resumable_stream.transforms.load_processor``) loads offline: the bundled tiny tokenizer
  (``examples/tiny/tokenizer``) plus the vision special tokens ``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>``, ``<|video_pad|>``; a Qwen-style chat template that renders ``{"type": "image"}`` parts
  as ``<|vision_start|><|image_pad|><|vision_end|>``; a Qwen2-VL image processor with 8-px patches,
  merge 2 (one image token per 16x16 pixels) and 256..4096 pixels per image.
- ``examples/tiny/data_vl/vl-0000{0,1}.parquet``: 2000 generated rows (row groups of 100) with columns
  ``id`` (int64), ``messages`` (list of {role, content}, ``<image>`` placeholders) and ``images`` (HF
  ``List(Image())``: PNG bytes of 32..64-px pictures of a coloured shape on a coloured background).
  Captions, questions about shape / colour / background, comparisons of two pictures, two-turn chats.
  About 1.5% of the rows are broken on purpose (truncated or garbage PNG bytes, a missing file, a 16-bit
  image, one ``<image>`` placeholder too many), to exercise ``data.bad_sample``.

    python examples/tiny/make_vl_assets.py [--check]     # --check: rebuild in a temp dir and compare
"""

from __future__ import annotations

import argparse
import filecmp
import io
import json
import os
import random
import shutil
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240612
ROWS = 2000
FILES = 2
ROW_GROUP_SIZE = 100
BAD_RATE = 0.015
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, TEMPORAL = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64
SIZES = [(32, 32), (48, 32), (32, 48), (48, 48), (64, 48), (48, 64)]
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40),
          "purple": (140, 60, 180), "white": (245, 245, 245), "black": (20, 20, 20), "orange": (240, 140, 30)}
SHAPES = ("square", "circle", "triangle", "cross")
SYSTEMS = ("You are a helpful assistant.", "You describe pictures briefly.")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ------------------------------------------------------------------------------------------------- processor
def write_processor(out_dir: str) -> None:
    from tokenizers import AddedToken, Tokenizer

    base = os.path.join(HERE, "tokenizer")
    tok = Tokenizer.from_file(os.path.join(base, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    with open(os.path.join(base, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["additional_special_tokens"] = config["additional_special_tokens"] + VISION_TOKENS
    config["model_max_length"] = 1024
    config["processor_class"] = "Qwen3VLProcessor"
    config.pop("chat_template", None)   # the processor's template (chat_template.jinja) is the one used
    _dump(os.path.join(out_dir, "tokenizer_config.json"), config)
    norm = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    vision = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
              "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "do_resize": True,
              "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, **norm}
    _dump(os.path.join(out_dir, "preprocessor_config.json"),
          {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor", **vision})
    # for loaders with torchvision, which build the video processor too (it is never used here)
    _dump(os.path.join(out_dir, "video_preprocessor_config.json"),
          {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor", **vision})
    _dump(os.path.join(out_dir, "processor_config.json"), {"processor_class": "Qwen3VLProcessor"})
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)


def _dump(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


# ------------------------------------------------------------------------------------------------- data
def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


def _picture(rng: random.Random) -> tuple[bytes, dict]:
    from PIL import Image, ImageDraw

    w, h = rng.choice(SIZES)
    bg, fg = rng.sample(sorted(COLORS), 2)
    shape = rng.choice(SHAPES)
    img = Image.new("RGB", (w, h), COLORS[bg])
    draw = ImageDraw.Draw(img)
    s = rng.randint(min(w, h) // 2, min(w, h) - 4)
    x, y = rng.randint(0, w - s), rng.randint(0, h - s)
    if shape == "square":
        draw.rectangle([x, y, x + s - 1, y + s - 1], fill=COLORS[fg])
    elif shape == "circle":
        draw.ellipse([x, y, x + s - 1, y + s - 1], fill=COLORS[fg])
    elif shape == "triangle":
        draw.polygon([(x + s // 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=COLORS[fg])
    else:
        t = max(2, s // 4)
        draw.rectangle([x + (s - t) // 2, y, x + (s + t) // 2, y + s - 1], fill=COLORS[fg])
        draw.rectangle([x, y + (s - t) // 2, x + s - 1, y + (s + t) // 2], fill=COLORS[fg])
    return _png(img), {"shape": shape, "color": fg, "background": bg}


def _turns(rng: random.Random, facts: list[dict]) -> list[tuple[str, str]]:
    """(user, assistant) turns about the pictures; the first user turn carries the placeholders."""
    f = facts[0]
    if len(facts) == 2:
        g = facts[1]
        q = rng.choice(["Do the two pictures show the same shape?", "Compare the two pictures."])
        if f["shape"] == g["shape"]:
            a = f"Yes, both show a {f['shape']}."
        else:
            a = f"No, the first shows a {f['shape']} and the second a {g['shape']}."
        return [("<image><image>" + q, a)]
    kind = rng.randrange(5)
    if kind == 0:
        return [("<image>Describe the picture.", f"A {f['color']} {f['shape']} on a {f['background']} background.")]
    if kind == 1:
        return [("<image>What shape is in the picture?", f"A {f['shape']}.")]
    if kind == 2:
        return [(f"<image>What color is the {f['shape']}?", f"The {f['shape']} is {f['color']}.")]
    if kind == 3:
        return [("What color is the background here?<image>", f"{f['background'].capitalize()}.")]
    return [("<image>What shape is this?", f"A {f['shape']}."), ("And its color?", f"It is {f['color']}.")]


def _break(rng: random.Random, row: int, images: list[dict], messages: list[dict]) -> None:
    """Damage one row in one of the ways data.bad_sample handles."""
    from PIL import Image

    kind = rng.randrange(5)
    if kind == 0:
        images[0]["bytes"] = images[0]["bytes"][: len(images[0]["bytes"]) // 2]        # truncated PNG
    elif kind == 1:
        images[0]["bytes"] = b"this is not an image " + str(row).encode()               # garbage bytes
    elif kind == 2:
        images[0] = {"bytes": None, "path": f"missing/picture-{row:05d}.png"}           # missing file
    elif kind == 3:
        images[0]["bytes"] = _png(Image.new("I;16", (32, 32), 4000))                   # 16-bit grey
    else:
        user = next(m for m in messages if m["role"] == "user")
        user["content"] = "<image>" + user["content"]                                   # one placeholder too many


def rows(n: int = ROWS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_images = 2 if rng.random() < 0.2 else 1
        pictures = [_picture(rng) for _ in range(n_images)]
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for user, assistant in _turns(rng, [p[1] for p in pictures]):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        images = [{"bytes": p[0], "path": None} for p in pictures]
        if rng.random() < BAD_RATE:
            _break(rng, i, images, messages)
        out.append({"id": i, "messages": messages, "images": images})
    return out


def write_data(out_dir: str, data: list[dict]) -> None:
    from datasets import Features, Image, List, Value

    features = Features({"id": Value("int64"),
                         "messages": List({"role": Value("string"), "content": Value("string")}),
                         "images": List(Image())})
    schema = features.arrow_schema   # carries the HF features, so `datasets` sees an Image column
    os.makedirs(out_dir, exist_ok=True)
    per_file = (len(data) + FILES - 1) // FILES
    for k in range(FILES):
        part = data[k * per_file:(k + 1) * per_file]
        table = pa.Table.from_pylist(part, schema=schema)
        pq.write_table(table, os.path.join(out_dir, f"vl-{k:05d}.parquet"), row_group_size=ROW_GROUP_SIZE)


def build(root: str) -> None:
    write_processor(os.path.join(root, "vl"))
    write_data(os.path.join(root, "data_vl"), rows())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the committed files")
    args = ap.parse_args()
    if not args.check:
        build(HERE)
        print(f"wrote {HERE}/vl and {HERE}/data_vl")
        return
    tmp = tempfile.mkdtemp(prefix="tiny-vl-assets-")
    try:
        build(tmp)
        bad = []
        for sub in ("vl", "data_vl"):
            names = sorted(os.listdir(os.path.join(tmp, sub)))
            _, mismatch, errors = filecmp.cmpfiles(os.path.join(HERE, sub), os.path.join(tmp, sub), names,
                                                   shallow=False)
            bad += [f"{sub}/{n}" for n in mismatch + errors]
        if bad:
            sys.exit("differs from the committed assets: " + ", ".join(bad))
        print("assets are up to date")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
