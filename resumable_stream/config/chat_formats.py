"""LLaMA-Factory's dataset formats (``alpaca``, ``sharegpt``): the columns and role tags each reads, with its defaults
(what ``data.columns`` / ``data.tags`` may set); the conversion of a row is :mod:`resumable_stream.transforms.formats`."""

from __future__ import annotations

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None}


SHAREGPT_COLUMNS = {"messages": "conversations", "system": None}


SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


COLUMN_KEYS = ("prompt", "query", "response", "system", "history", "messages")


# the column a format cannot do without; the others may be absent from a row (unless set explicitly)
REQUIRED = {"alpaca": ("prompt", "response"), "sharegpt": ("messages",)}


ROLES = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "tool", "function_tag": "assistant",
          "system_tag": "system"}


def resolved_columns(fmt: str, columns: dict[str, str] | None) -> dict[str, str | None]:
    """The format's columns: LLaMA-Factory's defaults overridden by ``data.columns``."""
    defaults = ALPACA_COLUMNS if fmt == "alpaca" else SHAREGPT_COLUMNS
    return {**defaults, **{k: v for k, v in (columns or {}).items() if k in defaults}}


def resolved_tags(tags: dict[str, str] | None) -> dict[str, str]:
    return {**SHAREGPT_TAGS, **(tags or {})}


def same_role_tags(tags: dict[str, str] | None) -> list[str]:
    """The role tags (user_tag, ...) that share their value with another one, after defaults."""
    resolved = resolved_tags(tags)
    values = [resolved[k] for k in ROLES]
    return [k for k in ROLES if values.count(resolved[k]) > 1]
