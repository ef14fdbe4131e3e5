"""Transform keys of the ``data:`` section, validated into a frozen dataclass.

The caller splits a ``data:`` mapping into stream keys and transform keys (``TransformConfig.KEYS``);
``from_dict`` reads only its own keys and ignores the rest. Every bad value raises ``ConfigError``
naming ``data.<key>``, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError

FORMATS = ("text", "messages", "vl")
PACKING_MODES = ("concat", "neat")
OVERLONG = ("truncate", "drop", "error")
EMPTY = ("skip", "error")
BAD_SAMPLE = ("error", "skip")
MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 1_000_000
MAX_IMAGE_BYTES = 1 << 40


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


# key -> (check, what is allowed)
_RULES: dict[str, tuple[Any, str]] = {
    "format": (lambda v: v in FORMATS, f"one of {', '.join(FORMATS)}"),
    "text_column": (_name, "a non-empty column name"),
    "messages_column": (_name, "a non-empty column name"),
    "max_seq_len": (lambda v: _is_int(v) and MIN_SEQ_LEN <= v <= MAX_SEQ_LEN,
                    f"an integer from {MIN_SEQ_LEN} to {MAX_SEQ_LEN} (tokens)"),
    "packing": (lambda v: isinstance(v, bool), "true or false"),
    "packing_mode": (lambda v: v in PACKING_MODES, f"one of {', '.join(PACKING_MODES)}"),
    "overlong": (lambda v: v in OVERLONG, f"one of {', '.join(OVERLONG)}"),
    "empty": (lambda v: v in EMPTY, f"one of {', '.join(EMPTY)}"),
    "add_eos": (lambda v: isinstance(v, bool), "true or false"),
    "id_column": (lambda v: v is None or _name(v), "null or a non-empty column name"),
    "consumed_log": (lambda v: v is None or _name(v), "null or a file path"),
    "images_column": (_name, "a non-empty column name"),
    "image_dir": (lambda v: v is None or _name(v), "null or a directory"),
    "bad_sample": (lambda v: v in BAD_SAMPLE, f"one of {', '.join(BAD_SAMPLE)}"),
    "max_image_bytes": (lambda v: _is_int(v) and 1 <= v <= MAX_IMAGE_BYTES,
                        f"an integer from 1 to {MAX_IMAGE_BYTES} (bytes per image file, download or bytes value)"),
    "allow_absolute_image_paths": (lambda v: isinstance(v, bool), "true or false"),
}


@dataclass(frozen=True)
class TransformConfig:
    """How raw rows become training examples.

    - ``format``: ``text`` (one string column) or ``messages`` (a list of {role, content}, rendered with
      the tokenizer's chat template; only assistant turns are labelled).
    - ``max_seq_len``: tokens per example (packing: exactly this many per block).
    - ``packing``: concatenate consecutive examples and cut blocks of ``max_seq_len``; leftovers carry
      over (and are part of the saved state). ``overlong`` does not apply with packing.
    - ``packing_mode``: ``concat`` (one token stream, attention and loss across documents) or ``neat``
      (position ids restart at every document, no token attends to or is predicted from another document;
      see docs/packing.md). Only with ``packing: true``.
    - ``overlong``: an example longer than ``max_seq_len`` is truncated (its head is kept), dropped, or an error.
    - ``empty``: empty/whitespace/missing text, or a conversation without an assistant turn: skip or error.
    - ``add_eos``: append the tokenizer's EOS to every ``text`` document (``messages`` end with the
      template's own end-of-turn token).
    - ``id_column``: column the loader takes sample keys from (null: the stream's (shard, row) key).
    - ``consumed_log``: file the loader logs consumed sample keys to (null: off); never changes outputs.
    - ``format: vl``: ``messages`` with ``<image>`` placeholders plus ``images_column`` (a list of images:
      HF ``Image`` structs, bytes, local paths relative to ``image_dir``, or http(s) URLs), run through the
      model's processor. ``bad_sample`` decides what an undecodable / missing / unsupported image, a
      placeholder count that differs from the image count, a processor failure or an over-length sample
      does: ``error`` (``TransformError`` naming the sample) or ``skip`` (counted and logged). VL samples
      are never truncated (``overlong`` does not apply) and never packed. Image reads are bounded: regular
      files only (a FIFO or device is a bad sample, never a hang), at most ``max_image_bytes`` per file,
      download or bytes value, and local paths confined to ``image_dir`` (the working directory when null:
      no absolute path, no ``..`` or symlink out of it) unless ``allow_absolute_image_paths``.
    """

    KEYS: ClassVar[tuple[str, ...]] = tuple(_RULES)
    DEFAULTS: ClassVar[dict[str, Any]]

    format: str = "text"
    text_column: str = "text"
    messages_column: str = "messages"
    max_seq_len: int = 1024
    packing: bool = False
    packing_mode: str = "concat"
    overlong: str = "truncate"
    empty: str = "skip"
    add_eos: bool = True
    id_column: str | None = None
    consumed_log: str | None = None
    images_column: str = "images"
    image_dir: str | None = None
    bad_sample: str = "error"
    max_image_bytes: int = 64 << 20
    allow_absolute_image_paths: bool = False

    def __post_init__(self) -> None:
        for key, (check, allowed) in _RULES.items():
            value = getattr(self, key)
            if not check(value):
                raise ConfigError(f"data.{key}: got {value!r}; allowed: {allowed}")
        if self.packing_mode != "concat" and not self.packing:
            raise ConfigError(f"data.packing_mode: got {self.packing_mode!r} with data.packing false; allowed: "
                              "set data.packing: true, or remove data.packing_mode")
        if self.format == "vl":
            if self.packing:
                raise ConfigError("data.packing: got True with data.format 'vl'; allowed: false (image samples "
                                  "are not packed)")
            if self.overlong != "truncate":
                raise _vl_overlong(self.overlong)

    @classmethod
    def from_dict(cls, section: Any) -> TransformConfig:
        """Build from a ``data:`` mapping, taking only the transform keys (others are ignored)."""
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ConfigError(f"data: got {type(section).__name__} {section!r}; allowed: a mapping of data keys")
        if section.get("format") == "vl" and "overlong" in section:
            raise _vl_overlong(section["overlong"])
        return cls(**{k: section[k] for k in cls.KEYS if k in section})

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    def replace(self, **changes: Any) -> TransformConfig:
        return dataclasses.replace(self, **changes)


TransformConfig.DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformConfig)}


def _vl_overlong(value: Any) -> ConfigError:
    return ConfigError(f"data.overlong: got {value!r}; not used with data.format 'vl': a VL sample is never cut "
                       "(that would split image tokens); one longer than data.max_seq_len follows data.bad_sample "
                       "(error or skip). Remove data.overlong")
