"""``key=value`` overrides of a yaml on the command line, as ``llamafactory-cli`` takes them
(``train.max_steps=5 data.sources.0.weight=2``; a value is read as yaml). They are merged into the yaml before
it is validated, and an error about one names it as typed. A relative path is taken from the current directory."""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnknownKeyError, shown
from .yaml_files import load_file, load_text

# keys naming local inputs, resolved like the yaml resolves them (but from the current directory)
_INPUT_PATHS = {"data": ("data_files", "resume_state_path", "index_path", "dataset_name_or_path", "image_dir"),
                "model": ("name_or_path", "tokenizer", "processor")}
SECTIONS = ("model", "data", "train")


@dataclass(frozen=True)
class Override:
    given: str                      # as typed: "train.max_steps=5"
    key: str                        # the key as typed: "train.max_steps"
    path: tuple[str | int, ...]     # where it lands in the yaml: ("train", "max_steps"); list items are ints
    value: Any


def parse(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value read as yaml)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override {shown(text)}: expected key=value (e.g. train.max_steps=5)")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {shown(text)}: the key before '=' is empty or has an empty part; expected a dotted "
                          "yaml key such as data.shuffle_seed")
    if raw == "":
        return key, ""
    return key, load_text(raw, f"override {shown(text)}")


def _exists(path: str) -> bool:
    return os.path.exists(path) or bool(glob.glob(path, recursive=True))


def _from_cwd(value: Any, base_dir: str | None) -> Any:
    """A relative local input path of an override, made absolute from the current directory when it exists
    there, or when the yaml's folder has it (so that it is not taken from there instead)."""
    if isinstance(value, list):
        return [_from_cwd(v, base_dir) for v in value]
    if isinstance(value, dict):    # data_files: split -> paths
        return {k: _from_cwd(v, base_dir) for k, v in value.items()}
    if not isinstance(value, str) or not value or "://" in value or os.path.isabs(value):
        return value
    if _exists(value) or (base_dir and _exists(os.path.join(base_dir, value))):
        return os.path.abspath(value)
    return value   # not a local path here (a hub id, a pattern inside a Hub repo): as typed


def _set(doc: dict, where: tuple[str | int, ...], value: Any, given: str) -> None:
    node: Any = doc
    for i, part in enumerate(where[:-1]):
        child = node[part] if isinstance(node, list) else node.get(part)
        if child is None and isinstance(node, dict):
            child = node[part] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {shown(given)}: {_render(where[:i + 1])} is {shown(child)} in the yaml, not a "
                              "mapping")
        node = child
    node[where[-1]] = value


def _path(doc: dict, key: str, given: str) -> tuple[str | int, ...]:
    """Where ``key`` lands in ``doc``: parts under a list are its indices."""
    path: list[str | int] = []
    node: Any = doc
    for part in key.split("."):
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ConfigError(f"override {shown(given)}: {shown(part)} is not an item of the list {_render(path)} "
                                  f"(0 .. {len(node) - 1})")
            path.append(int(part))
            node = node[int(part)]
        else:
            path.append(part)
            node = node.get(part) if isinstance(node, dict) else None
    return tuple(path)


def _is_input_path(path: tuple[str | int, ...]) -> bool:
    if path[0] == "model":
        return len(path) == 2 and path[1] in _INPUT_PATHS["model"]
    return path[0] == "data" and (path[-1] in _INPUT_PATHS["data"] or "data_files" in path)


def read(path: str, overrides: Sequence[str], expected: str, data_only: bool = False) -> tuple[dict, str, list[Override]]:
    """(the yaml at ``path`` with ``overrides`` merged in (:func:`apply`), its folder, the overrides); a yaml that is
    not a mapping is refused, saying what is ``expected``."""
    doc = load_file(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {shown(path)}: expected {expected}, got {type(doc).__name__}")
    base_dir = os.path.dirname(os.path.abspath(path))
    doc, given = apply(doc, overrides, base_dir=base_dir, data_only=data_only, source=path)
    return doc, base_dir, given


def apply(doc: dict, items: Sequence[str], *, base_dir: str | None, data_only: bool = False,
          source: str = "the yaml") -> tuple[dict, list[Override]]:
    """``doc`` (not changed) with the overrides merged in, and the overrides. ``data_only`` (peek, warmup, index):
    data keys only, bare (``shuffle_seed=7``, in a yaml of data keys only) or under ``data.``."""
    doc = copy.deepcopy(doc)
    bare = data_only and "data" not in doc and not ({"model", "train"} & set(doc))
    done = []
    for text in items:
        key, value = parse(text)
        first = key.split(".", 1)[0]
        if data_only and (first in ("model", "train") or (not bare and first != "data")):
            hint = f"; write data.{text}" if first not in SECTIONS else ""
            raise ConfigError(f"override {shown(text)}: only data keys apply here (this command reads the data: "
                              f"section of {source}){hint}")
        where = _path(doc, key[len("data."):] if bare and first == "data" else key, text)
        canon = ("data", *where) if bare else where     # as the config errors name it
        if _is_input_path(canon):
            value = _from_cwd(value, base_dir)
        _set(doc, where, value, text)
        done.append(Override(text, key, canon, value))
    return doc, done


def _render(path: Sequence[str | int]) -> str:
    """("data", "sources", 0, "weight") -> "data.sources[0].weight", as the config errors name keys."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _parts(name: str) -> tuple[str | int, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[(\d+)\]", name) if p)


def _unknown_key(e: UnknownKeyError, overrides: list[Override]) -> ConfigError | None:
    where = () if e.section == "config" else _parts(e.section)
    bad = (*where, e.key)
    for ov in overrides:
        if ov.path[:len(bad)] != bad:
            continue
        typed = ov.key.split(".")
        i = len(typed) - (len(ov.path) - len(bad)) - 1     # the typed part that is unknown
        hint = ""
        if e.suggestion is not None:
            hint = f"; did you mean {'.'.join([*typed[:i], e.suggestion, *typed[i + 1:]])}?"
        return ConfigError(f"override {shown(ov.given)}: unknown key {'.'.join(typed[:i + 1])}{hint}")
    return None


@contextlib.contextmanager
def named(overrides: list[Override]) -> Iterator[None]:
    """Validation errors about an override's key name the override as it was typed."""
    try:
        yield
    except UnknownKeyError as e:
        renamed = _unknown_key(e, overrides)
        if renamed is None:
            raise
        raise renamed from None
    except ConfigError as e:
        text = str(e)
        for ov in overrides:
            if re.search(rf"(^|[\s(]){re.escape(_render(ov.path))}\b", text):
                raise ConfigError(f"override {shown(ov.given)}: {text}") from None
        raise
