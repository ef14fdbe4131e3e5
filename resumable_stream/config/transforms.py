"""Transform keys of the ``data:`` section (``TransformConfig.KEYS``), validated into a frozen dataclass;
every bad value raises ``ConfigError`` naming ``data.<key>``, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError, shown
from ..limits import is_int
from .chat_formats import COLUMN_KEYS, SHAREGPT_TAGS, resolved_columns, same_role_tags
from .user_function import function_identity, load_function

FORMATS = ("text", "messages", "vl", "alpaca", "sharegpt")
CHAT_FORMATS = ("messages", "alpaca", "sharegpt")   # rendered with the chat template, assistant turns labelled
PACKING_MODES = ("concat", "neat")
OVERLONG = ("truncate", "drop", "error")
EMPTY = ("skip", "error")
BAD_SAMPLE = ("error", "skip")
MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 1_000_000
MAX_IMAGE_BYTES = 1 << 40
MAX_IMAGE_PIXELS = 1 << 40
# Transform keys a source of a mixture may set for itself (over the data section's), so that e.g. a text corpus
# and a chat corpus are mixed into one run; the transform reads them (TransformConfig.from_dict), the stream not.
SOURCE_TRANSFORM_KEYS = ("format", "text_column", "messages_column", "columns", "tags", "map", "map_version")


def _name(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def _mapping_of_names(v: Any, keys: tuple[str, ...] | dict, nullable: bool) -> bool:
    return v is None or (isinstance(v, dict) and all(
        k in keys and (_name(x) or (nullable and x is None)) for k, x in v.items()))


# key -> (check, what is allowed)
_RULES: dict[str, tuple[Any, str]] = {
    "format": (lambda v: v in FORMATS, f"one of {', '.join(FORMATS)}"),
    "text_column": (_name, "a non-empty column name"),
    "messages_column": (_name, "a non-empty column name"),
    "max_seq_len": (lambda v: is_int(v, MIN_SEQ_LEN, MAX_SEQ_LEN),
                    f"an integer from {MIN_SEQ_LEN} to {MAX_SEQ_LEN} (tokens)"),
    "packing": (lambda v: isinstance(v, bool), "true or false"),
    "packing_mode": (lambda v: v in PACKING_MODES, f"one of {', '.join(PACKING_MODES)}"),
    "overlong": (lambda v: v in OVERLONG, f"one of {', '.join(OVERLONG)}"),
    "empty": (lambda v: v in EMPTY, f"one of {', '.join(EMPTY)}"),
    "add_eos": (lambda v: isinstance(v, bool), "true or false"),
    "id_column": (lambda v: v is None or _name(v), "null or a non-empty column name"),
    "consumed_log": (lambda v: v is None or isinstance(v, bool) or _name(v),
                     "null or false (off), true (train.output_dir/consumed) or a directory"),
    "images_column": (_name, "a non-empty column name"),
    "image_dir": (lambda v: v is None or _name(v), "null or a directory"),
    "bad_sample": (lambda v: v in BAD_SAMPLE, f"one of {', '.join(BAD_SAMPLE)}"),
    "max_image_bytes": (lambda v: is_int(v, 1, MAX_IMAGE_BYTES),
                        f"an integer from 1 to {MAX_IMAGE_BYTES} (bytes per image file, download or bytes value)"),
    "allow_absolute_image_paths": (lambda v: isinstance(v, bool), "true or false"),
    "max_image_pixels": (lambda v: v is None or is_int(v, 1, MAX_IMAGE_PIXELS),
                         f"null (Pillow's own bound, PIL.Image.MAX_IMAGE_PIXELS: 89478485 unless changed) or an "
                         f"integer from 1 to {MAX_IMAGE_PIXELS} (width x height, read from the image's header "
                         "before it is decoded)"),
    "columns": (lambda v: _mapping_of_names(v, COLUMN_KEYS, nullable=True),
                f"null or a mapping from {', '.join(COLUMN_KEYS)} to column names (LLaMA-Factory's names)"),
    "tags": (lambda v: _mapping_of_names(v, SHAREGPT_TAGS, nullable=False),
             f"null or a mapping from {', '.join(SHAREGPT_TAGS)} to non-empty strings"),
    "map": (lambda v: v is None or isinstance(v, str) or callable(v),
            "null, 'package.module:function', or (from Python) a function"),
    "map_version": (lambda v: v is None or _name(v) or is_int(v, -math.inf, math.inf), "null, a non-empty string or an integer"),
}


@dataclass(frozen=True)
class TransformConfig:
    """How raw rows become training examples: ``format`` (text, messages, vl, alpaca, sharegpt), ``max_seq_len``,
    ``packing`` / ``packing_mode``, ``overlong``, ``empty``, ``bad_sample``, the image bounds of ``format: vl``,
    ``map`` and ``sources`` (per-source settings by label). Each key is documented in docs/configuration.md;
    ``consumed_log: true`` is resolved to ``train.output_dir/consumed`` by the trainer config."""

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
    consumed_log: str | bool | None = None
    images_column: str = "images"
    image_dir: str | None = None
    bad_sample: str = "error"
    max_image_bytes: int = 64 << 20
    allow_absolute_image_paths: bool = False
    max_image_pixels: int | None = None     # None: Pillow's Image.MAX_IMAGE_PIXELS (transforms.vl.check_pixels)
    columns: dict[str, str | None] | None = None
    tags: dict[str, str] | None = None
    map: str | Callable | None = None
    map_version: str | int | None = None
    # data.sources[i]'s own settings (SOURCE_TRANSFORM_KEYS over the data section's): (label, config) pairs
    sources: tuple[tuple[str, TransformConfig], ...] = ()

    def __post_init__(self) -> None:
        for key, (check, allowed) in _RULES.items():
            value = getattr(self, key)
            if not check(value):
                raise ConfigError(f"data.{key}: got {shown(value)}; allowed: {allowed}")
        if self.packing_mode != "concat" and not self.packing:
            raise ConfigError(f"data.packing_mode: got {shown(self.packing_mode)} with data.packing false; allowed: "
                              "set data.packing: true, or remove data.packing_mode")
        self._check_format_keys()
        if self.map is not None:      # import it now: a bad data.map fails at config time, not in a worker
            function_identity(self.map, load_function(self.map), self.map_version)
        elif self.map_version is not None:
            raise ConfigError(f"data.map_version: got {shown(self.map_version)} without data.map; remove it or set data.map")
        if self.format == "vl":
            if self.packing:
                raise ConfigError("data.packing: got True with data.format 'vl'; allowed: false (image samples "
                                  "are not packed)")
            if self.overlong != "truncate":
                raise _vl_overlong(self.overlong)

    def _check_format_keys(self) -> None:
        """data.columns / data.tags only where the format reads them, with the format's column keys."""
        if self.columns is not None:
            if self.format not in ("alpaca", "sharegpt"):
                raise ConfigError(f"data.columns: got {shown(self.columns)} with data.format {shown(self.format)}; allowed only "
                                  "with format alpaca or sharegpt (text / messages use data.text_column / "
                                  "data.messages_column)")
            own = tuple(resolved_columns(self.format, None))
            wrong = [k for k in self.columns if k not in own]
            if wrong:
                raise ConfigError(f"data.columns.{wrong[0]}: not a column of format {shown(self.format)}; allowed: "
                                  f"{', '.join(own)}")
        if self.tags is not None and self.format != "sharegpt":
            raise ConfigError(f"data.tags: got {shown(self.tags)} with data.format {shown(self.format)}; allowed only with "
                              "format sharegpt")
        clash = same_role_tags(self.tags) if self.tags else []
        if clash:
            raise ConfigError(f"data.tags: got {shown(self.tags)}; {', '.join(clash)} have the same value (with the "
                              "defaults); allowed: a different value for each role")

    @property
    def is_chat(self) -> bool:
        """Rendered with the chat template (messages, alpaca, sharegpt)."""
        return self.format in CHAT_FORMATS

    def all_configs(self) -> list[TransformConfig]:
        """This config and every source's own."""
        return [self] + [c for _, c in self.sources]

    def for_source(self, label: str | None) -> TransformConfig:
        """The settings of the source labelled ``label`` (this config where it has none of its own)."""
        for name, cfg in self.sources:
            if name == label:
                return cfg
        return self

    @classmethod
    def from_dict(cls, section: Any) -> TransformConfig:
        """Build from a ``data:`` mapping, taking only the transform keys (others are ignored); with
        ``sources``, each source's own transform keys (``SOURCE_TRANSFORM_KEYS``) too."""
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ConfigError(f"data: got {type(section).__name__} {shown(section)}; allowed: a mapping of data keys")
        if section.get("format") == "vl" and "overlong" in section:
            raise _vl_overlong(section["overlong"])
        base = cls(**{k: section[k] for k in cls.KEYS if k in section})
        entries = section.get("sources")
        if not isinstance(entries, list):
            return base
        sources = []
        for i, entry in enumerate(entries):
            own = {k: entry[k] for k in SOURCE_TRANSFORM_KEYS if isinstance(entry, dict) and k in entry}
            if not own:
                continue
            at = f"data.sources[{i}]"
            if base.format == "vl" or own.get("format") == "vl":
                raise ConfigError(f"{at}: sets {', '.join(own)}; per-source transform settings are for text, "
                                  "messages, alpaca and sharegpt sources, not with format 'vl'")
            if "map" in own and "map_version" not in own:    # the data section's version is its own map's
                own["map_version"] = None
            if "format" in own and own["format"] != base.format:
                # the data section's columns / tags belong to its own format
                own = {**{k: None for k in ("columns", "tags") if k not in own}, **own}
            try:
                cfg = dataclasses.replace(base, **own)
            except ConfigError as e:
                raise e.in_source(at, own) from None
            label = entry.get("label", f"source{i}")
            sources.append((label, cfg))
        return dataclasses.replace(base, sources=tuple(sources)) if sources else base

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    def replace(self, **changes: Any) -> TransformConfig:
        return dataclasses.replace(self, **changes)


TransformConfig.DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformConfig)}


def _vl_overlong(value: Any) -> ConfigError:
    return ConfigError(f"data.overlong: got {shown(value)}; not used with data.format 'vl': a VL sample is never cut "
                       "(that would split image tokens); one longer than data.max_seq_len follows data.bad_sample "
                       "(error or skip). Remove data.overlong")
