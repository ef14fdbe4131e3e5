"""LLaMA-Factory's dataset formats (``alpaca``, ``sharegpt``) turned into the ``messages`` form, with the column
names, role tags and defaults of its ``dataset_info.json`` (docs/formats.md): ``function`` turns are trained
like assistant turns, ``observation`` turns become role ``tool``. A row that breaks the format's rules raises
:class:`BadRow`; the processor applies ``data.bad_sample`` to it."""

from __future__ import annotations

from typing import Any

from ..config.chat_formats import REQUIRED, ROLES

_PROMPT_TAGS = ("user_tag", "observation_tag")
_REPLY_TAGS = ("assistant_tag", "function_tag")


class BadRow(ValueError):
    """A row that does not have the configured format; the message says what is wrong, naming the column."""


def to_messages(fmt: str, row: Any, columns: dict[str, str | None], tags: dict[str, str],
                explicit: frozenset[str]) -> list[dict[str, str]]:
    """The conversation of ``row`` as {role, content} dicts. ``columns`` / ``tags``: :func:`resolved_columns` /
    :func:`resolved_tags`; ``explicit``: the column keys the user set (required in every row)."""
    if not isinstance(row, dict):
        raise BadRow(f"the row is {type(row).__name__}, expected a mapping of columns")
    for key, column in columns.items():
        if column is not None and column not in row and (key in REQUIRED[fmt] or key in explicit):
            raise BadRow(f"column {column!r} (data.columns.{key}) is missing; the row has "
                         f"{', '.join(map(repr, sorted(row))) or 'no columns'}")
    messages: list[dict[str, str]] = []
    system = _text(row, columns.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    if fmt == "alpaca":
        messages += _alpaca(row, columns)
    else:
        messages += _sharegpt(row, columns["messages"], tags, has_system=bool(system))
    return messages


def _text(row: dict, column: str | None, key: str) -> str:
    """A string column's value ('' when absent or null)."""
    if column is None:
        return ""
    value = row.get(column)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRow(f"column {column!r} (data.columns.{key}) holds {type(value).__name__}, expected a string")
    return value


def _alpaca(row: dict, columns: dict[str, str | None]) -> list[dict[str, str]]:
    out = []
    column = columns.get("history")
    history = row.get(column) if column else None
    if history is not None:
        if not isinstance(history, (list, tuple)):
            raise BadRow(f"column {column!r} (data.columns.history) holds {type(history).__name__}, expected a list "
                         "of [prompt, response] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise BadRow(f"column {column!r} (data.columns.history) entry {i} is {pair!r}, expected a "
                             "[prompt, response] pair of strings")
            out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = [t for t in (_text(row, columns["prompt"], "prompt"), _text(row, columns.get("query"), "query")) if t]
    out.append({"role": "user", "content": "\n".join(query)})
    out.append({"role": "assistant", "content": _text(row, columns["response"], "response")})
    return out


def _sharegpt(row: dict, column: str, tags: dict[str, str], has_system: bool) -> list[dict[str, str]]:
    turns = row.get(column)
    if turns is None:
        return []      # no conversation: data.empty decides
    if not isinstance(turns, (list, tuple)):
        raise BadRow(f"column {column!r} (data.columns.messages) holds {type(turns).__name__}, expected a list of "
                     f"{{{tags['role_tag']!r}: ..., {tags['content_tag']!r}: ...}}")
    by_tag = {tags[k]: k for k in ROLES}
    out = []
    said = 0      # user / observation / assistant / function turns so far: even -> a prompt is due
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"column {column!r} (data.columns.messages) turn {i} is {turn!r}, expected a mapping with "
                         f"{tags['role_tag']!r} and {tags['content_tag']!r}")
        tag, content = turn.get(tags["role_tag"]), turn.get(tags["content_tag"])
        kind = by_tag.get(tag)
        if kind is None:
            allowed = ", ".join(repr(tags[k]) for k in ROLES)
            raise BadRow(f"column {column!r} (data.columns.messages) turn {i}: {tags['role_tag']!r} is {tag!r}; "
                         f"allowed: {allowed} (data.tags)")
        if not isinstance(content, str):
            raise BadRow(f"column {column!r} (data.columns.messages) turn {i}: {tags['content_tag']!r} holds "
                         f"{type(content).__name__}, expected a string")
        if kind == "system_tag":
            if i != 0 or has_system:
                raise BadRow(f"column {column!r} (data.columns.messages) turn {i}: a system turn is allowed only "
                             "first, and not with a system column")
        else:
            # LLaMA-Factory's rule: prompts and replies alternate, starting with a prompt
            expected = _PROMPT_TAGS if said % 2 == 0 else _REPLY_TAGS
            said += 1
            if kind not in expected:
                raise BadRow(f"column {column!r} (data.columns.messages) turn {i}: {tag!r} out of order; turns "
                             f"alternate {'/'.join(repr(tags[k]) for k in _PROMPT_TAGS)} then "
                             f"{'/'.join(repr(tags[k]) for k in _REPLY_TAGS)}")
        out.append({"role": ROLES[kind], "content": content})
    if out and out[-1]["role"] not in ("assistant",):
        raise BadRow(f"column {column!r} (data.columns.messages): the conversation ends with a "
                     f"{out[-1]['role']} turn; it must end with a {tags['assistant_tag']!r} or "
                     f"{tags['function_tag']!r} turn")
    return out
