"""The ``model:`` section's checks that need more than its types: a local-looking path must exist, and
``model.config`` must make a transformers config and a model (built on the meta device: no memory, no weights),
so that every command refuses a bad one at once with a ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from typing import Any

from ..errors import ConfigError, shown

PATH_KEYS = ("name_or_path", "tokenizer", "processor")


def looks_local(value: str) -> bool:
    """A path, not a hub id: absolute, ./, ../ or ~ (a hub id is 'name' or 'org/name')."""
    return os.path.isabs(value) or value.startswith(("./", "../", "~")) or value in (".", "..")


def check_local_paths(model_doc: dict[str, Any]) -> None:
    """A local-looking path that does not exist is refused now; transformers would take it for a hub id and
    either refuse its form or retry the hub for a minute."""
    for key in PATH_KEYS:
        value = model_doc.get(key)
        if isinstance(value, str) and looks_local(value) and not os.path.exists(os.path.expanduser(value)):
            raise ConfigError(f"model.{key}: got {shown(value)}: no such file or directory (a local path: relative "
                              "ones are taken from the yaml's folder, else the current directory); allowed: an "
                              "existing local directory or a hub id (org/name)")


def check_model_config(config: dict[str, Any], vl: bool) -> None:
    """``model.config`` (random init) as ``train`` will use it: ``AutoConfig.for_model`` takes the fields,
    then the model class is built from it on the meta device. ``vl``: an image-text-to-text model."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    fields = dict(config)
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"model.config.model_type: got {shown(model_type)}; allowed: a model type of transformers "
                          f"(e.g. qwen3, llama){hint}")
    try:
        made = AutoConfig.for_model(model_type, **fields)
    except Exception as e:   # huggingface_hub's StrictDataclass*Error, ValueError, TypeError, KeyError, ...
        raise field_error(model_type, fields, e) from None
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            auto.from_config(made)
    except Exception as e:   # a wrong size (negative dimension), an unknown activation, another model kind
        raise ConfigError(f"model.config: model_type {shown(model_type)} with these fields does not make an "
                          f"{auto.__name__} model ({type(e).__name__}: {e})") from None


def field_error(model_type: str, fields: dict[str, Any], e: Exception) -> ConfigError:
    """A config class's refusal as a ConfigError naming the field, the value given and the type allowed."""
    from transformers import CONFIG_MAPPING

    named = re.search(r"field '(\w+)'", str(e))
    key = named.group(1) if named else None
    if key in fields:
        types = {f.name: f.type for f in dataclasses.fields(CONFIG_MAPPING[model_type])} \
            if dataclasses.is_dataclass(CONFIG_MAPPING[model_type]) else {}
        allowed = f"{_type_name(types[key])} (the {model_type} config's type)" if key in types else \
            f"what the {model_type} config takes ({_one_line(e)})"
        return ConfigError(f"model.config.{key}: got {shown(fields[key])}; allowed: {allowed}")
    return ConfigError(f"model.config: model_type {shown(model_type)} with these fields is not a transformers config "
                       f"({type(e).__name__}: {_one_line(e)})")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _type_name(t: Any) -> str:
    return t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")
