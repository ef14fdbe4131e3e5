"""Vision-language transform: rows with ``messages`` + ``images`` -> processor outputs labelled as the text
transform's (:mod:`.chat`), vision tokens never (docs/vl.md). Images are decoded here, not by ``datasets``, so
``data.bad_sample`` can act on a broken one; a failure of the machine (a URL, EMFILE, EIO) is a TransformError
whatever the policy, so a resumed run skips the same samples."""

from __future__ import annotations

import errno
import functools
import http.client
import io
import json
import os
import re
from collections import deque
from typing import Any

import numpy as np

from ..config.transforms import TransformConfig
from ..errors import SidecarError, SourceError, shown
from ..io.net import HttpAnswer, RetryPolicy, fetch_url
from ..io.safe_files import FileRefused, read_regular_file
from .chat import IGNORE_INDEX, ChatTemplate, NotVerbatim, checked_messages
from .errors import BadSample, TransformError
from .protocol import Example, QueuedProcessor, checked_state, saved_stats
from .row_map import RowMap
from .text import collate_numpy, labelled_digest, tokenizer_digest

_CONTROL = re.compile(r"[\x00-\x20\x7f]")

PLACEHOLDER = "<image>"
STATE_VERSION = 1
STAT_KEYS = ("samples", "examples", "images", "skipped_empty", "skipped_image", "skipped_mismatch",
             "skipped_processor", "dropped_overlong", "skipped_map", "dropped_by_map", "skipped_bad")
# absent from the states of earlier versions
_LATER_STATS = ("skipped_map", "dropped_by_map", "skipped_bad")
# PIL modes that convert to RGB without losing what the image shows; 16-bit / float / other colour spaces
# would be clipped or reinterpreted, so they are refused instead.
SUPPORTED_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


# ---------------------------------------------------------------------------------------------- processor loading
def load_processor(name: str, trust_remote_code: bool = False, **kwargs):
    """``AutoProcessor.from_pretrained(name, **kwargs)``; where only its *video* processor fails (torchvision missing,
    or saved without one), the same class without it: images go through the image processor (PIL)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (ImportError, OSError) as e:
        # the video processor needs torchvision, or its config is missing (a processor saved by this fallback)
        if not any(w in str(e).lower() for w in ("torchvision", "video processor", "video_preprocessor")):
            raise
    cls = _image_only(_processor_class(name, trust_remote_code), name, trust_remote_code)
    return cls.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)


def _processor_class(name: str, trust_remote_code: bool):
    import transformers
    from transformers.utils import cached_file

    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = cached_file(name, file, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
        if path:
            with open(path, encoding="utf-8") as f:
                cls_name = json.load(f).get("processor_class")
            if cls_name and hasattr(transformers, cls_name):
                return getattr(transformers, cls_name)
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code).model_type
    cls_name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if not cls_name:
        raise ValueError(f"no processor class known for {name!r} (model_type {model_type!r})")
    return getattr(transformers, cls_name)


@functools.cache
def _image_only(cls, name: str, trust_remote_code: bool):
    """``cls`` without its video processor attribute (under ``cls``'s own name); a class made at run time cannot be
    pickled by name, so its instances pickle as ``load_processor(name, trust_remote_code)``."""

    def get_attributes(klass):
        return [a for a in cls.get_attributes() if "video" not in a]

    def __reduce__(self):
        return load_processor, (name, trust_remote_code)

    members = {"get_attributes": classmethod(get_attributes), "__reduce__": __reduce__,
               "__module__": cls.__module__, "__doc__": cls.__doc__}
    if isinstance(getattr(cls, "attributes", None), list):   # transformers 4.x: a class list, no get_attributes
        members["attributes"] = [a for a in cls.attributes if "video" not in a]
    return type(cls.__name__, (cls,), members)


def processor_digest(processor: Any) -> str:
    """blake2b of what decides the outputs: the tokenizer, the chat template and the image processor's
    settings (not its backend class: the PIL and torchvision image processors are interchangeable)."""
    settings = {k: v for k, v in processor.image_processor.to_dict().items()
                if k not in ("image_processor_type", "processor_class", "_processor_class", "backend")}
    return labelled_digest(tokenizer_digest(processor.tokenizer),
                           chat_template=json.dumps(getattr(processor, "chat_template", None), sort_keys=True),
                           image_processor=json.dumps(settings, sort_keys=True, default=str),
                           processor=type(processor).__name__)


# ---------------------------------------------------------------------------------------------- images
def read_image_bytes(value: Any, i: int, cfg: TransformConfig, retry: RetryPolicy | None) -> bytes:
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if not (data or path):
            raise BadSample("skipped_image", f"image {i} has neither bytes nor a path")
        value = bytes(data) if data else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(data := bytes(value)) > cfg.max_image_bytes:
            raise BadSample("skipped_image", f"image {i} bytes: {len(data)} bytes, over data.max_image_bytes "
                                             f"{cfg.max_image_bytes}")
        return data
    if not isinstance(value, str):
        raise BadSample("skipped_image",
                   f"image {i} is {type(value).__name__}; expected an Image struct, bytes, a path or a URL")
    if value.startswith(("http://", "https://")):
        if _CONTROL.search(value):     # urllib refuses it, and the retries would take that for a network fault
            raise BadSample("skipped_image", f"image {i} URL {shown(value)} holds a control character or a space; "
                                             "allowed: a URL as RFC 3986 writes it (percent-encoded)")
        return _fetch(value, i, cfg.max_image_bytes, retry or RetryPolicy.of())
    path = local_image_path(value, i, cfg)
    try:
        return read_regular_file(path, cfg.max_image_bytes)   # never a FIFO, a device or more than the limit
    except FileNotFoundError:
        raise BadSample("skipped_image", f"image {i} file {path!r} not found") from None
    except FileRefused as e:
        raise BadSample("skipped_image", f"image {i} file {path!r} refused: {e} (data.max_image_bytes "
                                    f"{cfg.max_image_bytes})") from None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise BadSample("skipped_image", f"image {i} file {path!r} cannot be read ({e.strerror})") from None
    except OSError as e:
        # EMFILE, EIO, EACCES, ESTALE, ...: a property of the machine, not of the sample; skipping on it would
        # make the skipped samples depend on the environment, and a resumed run could differ
        code = errno.errorcode.get(e.errno, "?") if e.errno is not None else "no errno"
        raise TransformError(f"image {i} file {path!r} cannot be read (errno {e.errno} {code}: {e.strerror or e}); "
                             "a local I/O failure is not skipped by data.bad_sample") from None


def local_image_path(value: str, i: int, cfg: TransformConfig) -> str:
    """A path named by a row, resolved against data.image_dir (the working directory when null) and confined
    to it: no absolute path, no ``..`` or symlink out of it, unless data.allow_absolute_image_paths."""
    if "\0" in value:    # os.path.realpath and open() raise ValueError on it: the sample's fault, not the run's
        raise BadSample("skipped_image", f"image {i} path {shown(value)} holds a NUL byte; allowed: a file path")
    base = os.path.realpath(cfg.image_dir or os.getcwd())
    if cfg.allow_absolute_image_paths:
        return value if os.path.isabs(value) else os.path.join(base, value)
    where = f"data.image_dir {cfg.image_dir!r}" if cfg.image_dir else f"the working directory {base!r}"
    if os.path.isabs(value):
        raise BadSample("skipped_image", f"image {i} path {value!r} is absolute; paths are relative to {where} (set "
                                    "data.allow_absolute_image_paths: true to allow any path)")
    path = os.path.realpath(os.path.join(base, value))
    if os.path.commonpath([path, base]) != base:
        raise BadSample("skipped_image", f"image {i} path {value!r} leads out of {where} (through '..' or a symlink); "
                                    "set data.allow_absolute_image_paths: true to allow any path")
    return path


def _fetch(url: str, i: int, max_bytes: int, retry: RetryPolicy) -> bytes:
    """GET under the data's retry policy. A status that describes the resource (404, 403, ...) makes the sample bad; a
    network failure past the retries is an error whatever the policy (skips must not depend on the network)."""
    try:
        return fetch_url(url, lambda r: _read_body(r, i, url, max_bytes), retry, f"image {i} URL {url}")
    except HttpAnswer as e:
        raise BadSample("skipped_image", f"image {i} URL {url} answered HTTP {e.status}") from None
    except SourceError as e:
        raise TransformError(f"{e}; a network failure is not skipped by data.bad_sample") from None


def _read_body(response, i: int, url: str, max_bytes: int) -> bytes:
    """The body, never more than ``max_bytes`` of it whatever Content-Length says; a cut body is a fault."""
    chunks, total = [], 0
    while chunk := response.read(min(1 << 20, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise BadSample("skipped_image", f"image {i} URL {url}: over data.max_image_bytes {max_bytes}")
    if response.length:     # bytes the server announced but never sent
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)


def check_pixels(img, i: int, cfg: TransformConfig) -> None:
    """BadSample when ``img`` (header read, pixels not decoded) has more pixels than ``data.max_image_pixels``, or when
    null Pillow's own bound (``PIL.Image.MAX_IMAGE_PIXELS``; above it Pillow only warns of a decompression bomb)."""
    from PIL import Image  # Pillow: the vl extra, imported when used

    limit = cfg.max_image_pixels if cfg.max_image_pixels is not None else Image.MAX_IMAGE_PIXELS
    if limit is not None and img.width * img.height > limit:
        key = "data.max_image_pixels" if cfg.max_image_pixels is not None else \
            "data.max_image_pixels (null: Pillow's Image.MAX_IMAGE_PIXELS)"
        raise BadSample("skipped_image", f"image {i} is {img.width}x{img.height} = {img.width * img.height} pixels, "
                                         f"over {key} {limit}")


def open_image(data: bytes, i: int, cfg: TransformConfig):
    """The image in ``data``, decoded only once its header says it has at most the pixels allowed (a 100 KB PNG
    can hold 10000x10000 pixels: 300 MB decoded); BadSample when it is too large or cannot be decoded."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))      # reads the header only
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, EOFError, ...
        raise BadSample("skipped_image", f"image {i} cannot be decoded ({type(e).__name__}: {e})") from None
    check_pixels(img, i, cfg)
    try:
        img.load()
    except Exception as e:  # noqa: BLE001
        raise BadSample("skipped_image", f"image {i} cannot be decoded ({type(e).__name__}: {e})") from None
    return img


def decode_image(value: Any, i: int, cfg: TransformConfig, retry: RetryPolicy | None = None):
    """One image value -> an RGB PIL image; raises ``BadSample`` with the reason when it cannot be used. Local
    paths and sizes are bounded by ``cfg`` (image_dir, max_image_bytes, allow_absolute_image_paths)."""
    from PIL import Image

    if value is None:
        raise BadSample("skipped_image", f"image {i} is null")
    if isinstance(value, Image.Image):
        img = value
        check_pixels(img, i, cfg)
    else:
        img = open_image(read_image_bytes(value, i, cfg, retry), i, cfg)
    if img.mode not in SUPPORTED_MODES:
        raise BadSample("skipped_image",
                   f"image {i} has the unsupported mode {img.mode!r}; supported: {', '.join(SUPPORTED_MODES)}")
    if img.width < 1 or img.height < 1:
        raise BadSample("skipped_image", f"image {i} is empty ({img.width}x{img.height})")
    if img.mode == "RGB":
        return img
    try:
        if img.mode == "La":     # premultiplied alpha: PIL converts it to RGBA only through LA
            img = img.convert("LA")
        # transparency over white, as the HF image processors' convert_to_rgb does
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises ValueError, OSError, ... on a conversion it cannot do
        raise BadSample("skipped_image", f"image {i} cannot be converted from mode {img.mode!r} to RGB "
                                    f"({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------- the transform
def _as_messages(value: Any, images: int) -> Any:
    """A WebDataset sample's text as messages: a ``.txt`` caption (or a ``.json`` with ``messages``, ``caption`` or
    ``text``) becomes a user turn of the images' placeholders and an assistant turn; anything else as it is."""
    if isinstance(value, dict):
        if isinstance(value.get("messages"), list):
            return value["messages"]
        value = next((value[k] for k in ("caption", "text") if isinstance(value.get(k), str)), value)
    if isinstance(value, str):
        return [{"role": "user", "content": PLACEHOLDER * images}, {"role": "assistant", "content": value}]
    return value


class VLProcessor(QueuedProcessor):
    """Raw VL rows -> examples: ``input_ids``, ``labels`` (int64 arrays), ``token`` (other per-token arrays, e.g.
    ``mm_token_type_ids``), ``vision`` (e.g. ``pixel_values``, ``image_grid_thw``), ``keys``."""

    def __init__(self, processor: Any, cfg: TransformConfig, retry: RetryPolicy | None = None):
        """``retry``: the policy image URLs are fetched under (``RetryPolicy(stream_config, remote=True)``;
        None: the data defaults)."""
        if not isinstance(cfg, TransformConfig):
            raise TypeError(f"cfg: expected a TransformConfig, got {type(cfg).__name__}")
        if cfg.format != "vl":
            raise TransformError(f"data.format: {cfg.format!r}; VLProcessor needs 'vl'")
        try:
            import PIL  # noqa: F401
        except ImportError:
            raise TransformError("data.format 'vl' decodes images with Pillow, which is not installed: "
                                 "pip install 'resumable-stream[vl]'") from None
        self.processor, self.cfg = processor, cfg
        self.retry = retry or RetryPolicy.of()
        self.tokenizer = getattr(processor, "tokenizer", None)
        if self.tokenizer is None or getattr(processor, "image_processor", None) is None:
            raise TransformError(f"processor {type(processor).__name__}: needs a tokenizer and an image processor "
                                 "(load it with AutoProcessor.from_pretrained)")
        if not getattr(processor, "chat_template", None):
            raise TransformError(f"processor {type(processor).__name__}: has no chat_template; data.format 'vl' "
                                 "renders conversations with it")
        self.image_token_id = _image_token_id(processor)
        # bad_sample / empty are left out: a run under 'error' never skipped, so switching it to 'skip' to get
        # past a broken sample resumes exactly like a run that skipped from the start (and back again)
        self._fingerprint = {"processor": processor_digest(processor), "format": cfg.format,
                             "max_seq_len": cfg.max_seq_len, "messages_column": cfg.messages_column,
                             "images_column": cfg.images_column, "image_dir": cfg.image_dir,
                             "id_column": cfg.id_column}
        self._row_map = RowMap(cfg.map, cfg.map_version) if cfg.map else None
        if self._row_map is not None:
            self._fingerprint["map"] = self._row_map.identity
        # they decide which images are bad; only when set, so that checkpoints of earlier versions still resume
        for key in ("max_image_bytes", "allow_absolute_image_paths", "max_image_pixels"):
            if getattr(cfg, key) != TransformConfig.DEFAULTS[key]:
                self._fingerprint[key] = getattr(cfg, key)
        self._chat = ChatTemplate(processor.apply_chat_template, self.tokenizer, self._tokenize,
                                  lambda role, text: {"role": role, "content": [{"type": "text", "text": text}]})
        self._vision_ids = self._find_vision_ids()
        self._pending: deque[Example] = deque()
        self._stats = dict.fromkeys(STAT_KEYS, 0)

    # ------------------------------------------------------------------ public API
    def feed(self, sample: dict, key: str) -> None:
        """Take one raw row; a finished example becomes available through ``ready`` / ``take``. ``data.map``
        runs first; every row it returns is encoded now (so what is not yet taken is in ``state()``)."""
        self._feed_mapped(sample, key, self._row_map, self._feed_row, "skipped_map")

    def _feed_row(self, sample: dict, key: str) -> None:
        try:
            example = self._encode(sample, key)
        except TransformError as e:
            if e.key is None:   # raised below the sample level (a URL, a file, the template): name the sample
                raise TransformError(f"sample {key!r}: {e}", key) from e.__cause__
            raise
        except BadSample as bad:
            self._bad(key, bad.reason, bad.kind)
            return
        if example is not None:
            self._pending.append(example)
            self._stats["examples"] += 1

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """``{"tensors": {name: ndarray}, "meta": JSON-able}``: examples made but not taken, and counters."""
        tensors: dict[str, np.ndarray] = {}
        layout = []
        for i, ex in enumerate(self._pending):
            tensors[f"{i}.input_ids"] = ex["input_ids"]
            tensors[f"{i}.labels"] = ex["labels"]
            for group in ("token", "vision"):
                for name, arr in ex[group].items():
                    tensors[f"{i}.{group}.{name}"] = np.ascontiguousarray(arr)
            layout.append({"keys": ex["keys"], "token": sorted(ex["token"]), "vision": sorted(ex["vision"])})
        meta = {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "pending": layout,
                "stats": self.stats()}
        return {"tensors": tensors, "meta": meta}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a ``state()``: ``StreamMismatchError`` if it was made with another processor or other
        output-changing settings, ``SidecarError`` if it is malformed."""
        tensors, meta = checked_state(state, STATE_VERSION, self.fingerprint())
        try:
            pending = deque()
            for i, entry in enumerate(meta["pending"]):
                ex = {"input_ids": np.asarray(tensors[f"{i}.input_ids"], dtype=np.int64),
                      "labels": np.asarray(tensors[f"{i}.labels"], dtype=np.int64),
                      "keys": [str(k) for k in entry["keys"]],
                      "token": {n: np.asarray(tensors[f"{i}.token.{n}"]) for n in entry["token"]},
                      "vision": {n: np.asarray(tensors[f"{i}.vision.{n}"]) for n in entry["vision"]}}
                if ex["labels"].shape != ex["input_ids"].shape:
                    raise ValueError(f"example {i}: labels and input_ids differ in length")
                pending.append(ex)
            stats = saved_stats(meta, STAT_KEYS, _LATER_STATS)
        except (KeyError, TypeError, ValueError) as e:
            raise SidecarError(f"transform state: missing or malformed field ({e})") from None
        self._pending, self._stats = pending, stats

    # ------------------------------------------------------------------ internals
    def _find_vision_ids(self) -> set[int]:
        """Tokens the template renders for an image part and the processor's vision token ids: never labelled, stepped
        over on the way to an assistant message's end-of-turn token."""
        out = {self.image_token_id}
        for name in ("vision_start_token_id", "vision_end_token_id", "video_token_id"):
            value = getattr(self.processor, name, None)
            if isinstance(value, int) and value >= 0:
                out.add(value)
        return out | self._chat.part_ids({"type": "image"})

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # the fast tokenizer's core (processor_digest made sure there is one): same ids, less per-call overhead
        enc = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def _conversation(self, sample: dict, key: str) -> tuple[list[dict], list[Any]] | None:
        """Checked messages in HF's structured content form, and the raw image values."""
        col, icol = self.cfg.messages_column, self.cfg.images_column
        msgs = sample.get(col) if isinstance(sample, dict) else None
        images = sample.get(icol) if isinstance(sample, dict) else None
        if isinstance(images, (dict, bytes)):
            images = [images]            # one image value: a WebDataset member (.jpg / .png / .webp)
        msgs = _as_messages(msgs, 0 if images is None else len(images))
        if msgs is None or (isinstance(msgs, (list, tuple)) and len(msgs) == 0):
            self._empty(key, f"column data.messages_column {col!r} is {'missing' if msgs is None else 'empty'}")
            return None
        conversation, placeholders = [], 0
        for m in checked_messages(msgs, key, col):
            pieces = (m.get("content") or "").split(PLACEHOLDER)
            placeholders += len(pieces) - 1
            parts: list[dict] = []
            for j, piece in enumerate(pieces):
                if j:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            conversation.append({"role": m["role"], "content": parts})
        if not any(m["role"] == "assistant" and any(p.get("text", "").strip() for p in m["content"])
                   for m in conversation):
            self._empty(key, f"column data.messages_column {col!r} has no assistant turn with content")
            return None
        images = [] if images is None else images
        if not isinstance(images, (list, tuple)):
            raise TransformError(f"sample {key!r}: column data.images_column {icol!r} holds {type(images).__name__}, "
                                 "expected a list of images", key)
        if placeholders != len(images):
            raise BadSample("skipped_mismatch", f"{placeholders} {PLACEHOLDER} placeholder(s) in the messages but "
                                           f"{len(images)} image(s) in column data.images_column {icol!r}")
        return conversation, list(images)

    def _encode(self, sample: dict, key: str) -> Example | None:
        got = self._conversation(sample, key)
        if got is None:
            return None
        conversation, raw_images = got
        try:
            full = self._chat.render(conversation, False)
        except TransformError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors of a template that cannot render this sample
            raise BadSample("skipped_processor",
                       f"the chat template failed on this conversation ({type(e).__name__}: {e})") from None
        ids0, labels0 = self._label(full, conversation, key)
        L = self.cfg.max_seq_len
        text_tokens = len(ids0) - sum(1 for t in ids0 if t == self.image_token_id)
        if text_tokens > L:   # image tokens only add to this: over-length before any image is decoded
            raise BadSample("dropped_overlong", f"{text_tokens} tokens before image tokens, longer than "
                                           f"data.max_seq_len {L}")
        images = [decode_image(v, i, self.cfg, self.retry) for i, v in enumerate(raw_images)]
        try:
            out = self.processor(text=[full], images=images or None, return_tensors="np", add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - processors raise ValueError, TypeError, ... on a sample they refuse
            raise BadSample("skipped_processor", f"the processor failed ({type(e).__name__}: {e})") from None
        ids = np.asarray(out["input_ids"], dtype=np.int64).reshape(-1)
        labels = self._expand_labels(ids0, labels0, ids, key)
        if len(ids) > L:
            n_img = int((ids == self.image_token_id).sum())
            raise BadSample("dropped_overlong", f"{len(ids)} tokens ({n_img} of them image tokens), longer than "
                                           f"data.max_seq_len {L} (raise it, or lower the image processor's max_pixels)")
        shape = np.asarray(out["input_ids"]).shape
        example: Example = {"input_ids": ids, "labels": labels, "keys": [key], "token": {}, "vision": {}}
        for name, value in out.items():
            if name in ("input_ids", "attention_mask"):
                continue
            arr = np.asarray(value)
            if arr.shape == shape:          # one value per token (mm_token_type_ids, token_type_ids)
                example["token"][name] = arr.reshape(-1)
            else:                           # per image / per patch (pixel_values, image_grid_thw, ...)
                example["vision"][name] = arr
        self._stats["images"] += len(images)
        return example

    def _label(self, full: str, conversation: list[dict], key: str) -> tuple[list[int], list[int]]:
        """Token ids of the rendering (image slots unexpanded) and labels on assistant text only, plus each message's
        end-of-turn token; vision tokens never."""
        texts = [[t for p in m["content"] if p["type"] == "text" and (t := p["text"].strip())] for m in conversation]
        try:
            return self._chat.label(full, conversation, texts, self._vision_ids)
        except NotVerbatim as e:
            raise BadSample("skipped_processor", str(e)) from None

    def _expand_labels(self, ids0: list[int], labels0: list[int], ids: np.ndarray, key: str) -> np.ndarray:
        """Labels for the processor's ids: ``ids0`` with every run of image tokens expanded must give
        ``ids``; each non-image token keeps its label, image tokens get -100."""
        a, b = np.asarray(ids0, dtype=np.int64), ids
        img_a, img_b = a == self.image_token_id, b == self.image_token_id
        if _runs(img_a) != _runs(img_b) or not np.array_equal(a[~img_a], b[~img_b]):
            raise TransformError(
                f"sample {key!r}: the processor's input_ids are not the chat template's tokens with image tokens "
                f"expanded ({len(b)} vs {len(a)} tokens); processor {type(self.processor).__name__} is not supported "
                "by the vl transform", key)
        labels = np.full(len(b), IGNORE_INDEX, dtype=np.int64)
        labels[~img_b] = np.asarray(labels0, dtype=np.int64)[~img_a]
        return labels


def _runs(mask: np.ndarray) -> int:
    """Number of runs of True in a 1-d bool array."""
    if mask.size == 0:
        return 0
    return int(mask[0]) + int(np.count_nonzero(mask[1:] & ~mask[:-1]))


def _image_token_id(processor: Any) -> int:
    tid = getattr(processor, "image_token_id", None)
    if isinstance(tid, int) and tid >= 0:
        return tid
    token = getattr(processor, "image_token", None)
    if isinstance(token, str):
        tid = processor.tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid != processor.tokenizer.unk_token_id:
            return tid
    raise TransformError(f"processor {type(processor).__name__}: no image_token / image_token_id; the vl "
                         "transform needs the token the processor expands into image features")


def collate_vl_numpy(examples: list[Example], pad_token_id: int) -> dict[str, np.ndarray]:
    """``collate_vl`` as numpy arrays (no torch needed): ``collate_numpy``'s fields, per-token fields padded with 0,
    per-image fields concatenated along their first axis in sample order."""
    batch = collate_numpy(examples, pad_token_id)
    rows, width = batch["input_ids"].shape
    for name in sorted({n for ex in examples for n in ex.get("token", {})}):
        first = next(ex["token"][name] for ex in examples if name in ex.get("token", {}))
        out = np.zeros((rows, width), dtype=np.asarray(first).dtype)
        for r, ex in enumerate(examples):
            arr = ex.get("token", {}).get(name)
            if arr is not None:
                out[r, :len(arr)] = np.asarray(arr)
        batch[name] = out
    for name in sorted({n for ex in examples for n in ex.get("vision", {})}):
        batch[name] = np.concatenate([np.asarray(ex["vision"][name]) for ex in examples
                                      if name in ex.get("vision", {})], axis=0)
    return batch


def collate_vl(examples: list[Example], pad_token_id: int) -> dict[str, Any]:
    """``collate_vl_numpy`` as torch tensors: any number of images and patches per sample."""
    import torch

    return {name: torch.from_numpy(np.ascontiguousarray(arr))
            for name, arr in collate_vl_numpy(examples, pad_token_id).items()}
