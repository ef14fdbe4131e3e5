"""Chat-template rendering and label masking, shared by the text and VL transforms (every probe of a template).

A conversation is rendered and tokenized once, with offsets. Labels are -100 except on assistant content and the
end-of-turn token after it. Assistant content is searched from the end of the rendering with
``add_generation_prompt=True`` when that is a prefix of the full one (ChatML, Llama-3, Qwen3), else from the first
assistant header after the previous messages. LLaMA-Factory's processor masks with its own template instead."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .errors import TransformError

IGNORE_INDEX = -100

# text -> (token ids, character offsets), without special tokens added
Tokenize = Callable[[str], tuple[list[int], Any]]


class NotVerbatim(ValueError):
    """An assistant message the chat template does not render verbatim: its tokens cannot be labelled."""

    def __init__(self, i: int):
        super().__init__(f"assistant message {i} does not appear verbatim in the chat template's rendering (a "
                         "template that rewrites assistant text, e.g. moves or drops <think> reasoning), so its "
                         "tokens cannot be labelled")


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens, added ones included."""
    ids = {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return ids


def checked_messages(msgs: Any, key: str, col: str) -> list[dict]:
    """``msgs`` as a list of {role, content} dicts (copies); TransformError naming the sample otherwise."""
    if not isinstance(msgs, (list, tuple)):
        raise TransformError(f"sample {key!r}: column data.messages_column {col!r} holds {type(msgs).__name__}, "
                             "expected a list of {role, content}", key)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TransformError(f"sample {key!r}: column data.messages_column {col!r} message {i} is {m!r}, "
                                 "expected {'role': str, 'content': str}", key)
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise TransformError(f"sample {key!r}: column data.messages_column {col!r} message {i} content is "
                                 f"{type(content).__name__}, expected a string", key)
        out.append(dict(m))
    return out


class ChatTemplate:
    """A chat template and what probing it found: the special tokens, the token that opens a turn (never taken
    for an end-of-turn) and the text that opens an assistant turn."""

    def __init__(self, apply: Callable, tokenizer: Any, tokenize: Tokenize, message: Callable[[str, str], dict]):
        """``apply``: the ``apply_chat_template`` of the tokenizer or processor that owns the template;
        ``tokenize(text)``: (ids, offsets); ``message(role, text)``: one message in the owner's content form."""
        self._apply, self.tokenize = apply, tokenize
        self.special_ids = special_ids(tokenizer)
        self.turn_start_id = self._find_turn_start(message)
        self.assistant_header = self._find_assistant_header(message)

    def render(self, conversation: list[dict], generation_prompt: bool) -> str:
        out = self._apply(conversation, tokenize=False, add_generation_prompt=generation_prompt)
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        if not isinstance(out, str):
            raise TransformError(f"chat template rendered {type(out).__name__}, expected a string")
        return out

    def label(self, full: str, conversation: list[dict], texts: list[list[str]],
              skip_ids: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
        """(ids, labels) of the rendering ``full``, whose message *i* shows ``texts[i]``: each assistant text labelled and
        once per message its end-of-turn token (past any ``skip_ids``, never labelled). NotVerbatim when an assistant
        text is not in ``full``."""
        spans: list[tuple[int, int]] = []
        ends: list[bool] = []
        cursor = 0
        for i, (m, pieces) in enumerate(zip(conversation, texts)):
            if m["role"] != "assistant":
                for piece in pieces:
                    pos = full.find(piece, cursor)
                    if pos >= 0:
                        cursor = pos + len(piece)
                continue
            if not pieces:
                continue
            start = self._content_start(full, conversation, i, cursor)
            for k, piece in enumerate(pieces):
                pos = full.find(piece, start)
                if pos < 0:
                    raise NotVerbatim(i)
                spans.append((pos, pos + len(piece)))
                ends.append(k == len(pieces) - 1)
                start = cursor = pos + len(piece)
        ids, offsets = self.tokenize(full)
        labels = label_spans(full, ids, offsets, spans, self.special_ids, self.turn_start_id, ends, skip_ids)
        if skip_ids:
            for q, tok in enumerate(ids):   # an image inside an assistant turn is still not a target
                if tok in skip_ids:
                    labels[q] = IGNORE_INDEX
        return ids, labels

    def part_ids(self, part: dict) -> set[int]:
        """The special tokens the template renders for a content ``part`` (e.g. an image's): those of a user message
        holding it and a text, less those of the text alone; none where the probe cannot render."""
        text = [{"type": "text", "text": "x"}]
        try:
            plain = self.render([{"role": "user", "content": text}], False)
            with_part = self.render([{"role": "user", "content": [part, *text]}], False)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe: none found
            return set()
        before = set(self.tokenize(plain)[0])
        return {int(t) for t in self.tokenize(with_part)[0] if t in self.special_ids and t not in before}

    def _find_turn_start(self, message: Callable[[str, str], dict]) -> int | None:
        probe = [message("user", "x")]
        try:
            plain = self.render(probe, False)
            header = self.render(probe, True)[len(plain):]
        except Exception:  # noqa: BLE001 - a template that cannot render the probe: no turn-start exclusion
            return None
        ids = self.tokenize(header)[0] if header else []
        return int(ids[0]) if ids and int(ids[0]) in self.special_ids else None

    def _find_assistant_header(self, message: Callable[[str, str], dict]) -> str | None:
        """The text that opens an assistant turn: the common start of the generation prompt and of a rendered assistant
        message's header, last or not (Qwen3 adds a <think> block to the last only); None where none shows."""
        user = [message("user", "x")]
        marker = "\x00rs-probe\x00"
        reply = [message("assistant", marker)]
        heads = []
        for conversation, generation_prompt in ((user, True), (user + reply, False), (user + reply + user, False)):
            try:
                plain = self.render(user, False)
                text = self.render(conversation, generation_prompt)
            except Exception:  # noqa: BLE001 - a template that cannot render this probe: the others decide
                continue
            if not text.startswith(plain):
                return None
            text = text[len(plain):]
            heads.append(text[:text.index(marker)] if marker in text else text)
        header = os.path.commonprefix(heads) if heads else ""
        return header if header.strip() else None

    def _content_start(self, full: str, conversation: list, i: int, cursor: int) -> int:
        """Where to search for assistant message ``i``'s content in the rendering ``full``: never inside the
        rendering of the messages before it (a default system prompt, a header), whatever message ``i`` is."""
        try:
            prefix = self.render(conversation[:i], True)   # i == 0: the empty conversation's generation prompt
        except Exception:  # noqa: BLE001 - a template that cannot render it: the fallbacks below
            prefix = None
        if prefix and len(prefix) >= cursor and full.startswith(prefix):
            return len(prefix)
        base = cursor
        if i > 0:
            try:
                before = self.render(conversation[:i], False)
            except Exception:  # noqa: BLE001
                before = ""
            if before and full.startswith(before):
                base = max(base, len(before))
        if self.assistant_header:     # the first assistant header after the previous messages
            h = full.find(self.assistant_header, base)
            if h >= 0:
                return h + len(self.assistant_header)
        return base


def label_spans(full: str, ids: list[int], offsets, spans: list[tuple[int, int]], special_ids: set[int],
                turn_start_id: int | None, ends: list[bool], skip_ids: set[int] | frozenset[int]) -> list[int]:
    """Labels for ``ids`` (tokens of ``full`` with ``offsets``): tokens overlapping the assistant ``spans`` and, after
    a span that ends a message, its end-of-turn token (stepping over ``skip_ids``); else IGNORE_INDEX."""
    labels = [IGNORE_INDEX] * len(ids)
    n = len(ids)
    t = 0
    for k, (s, e) in enumerate(spans):
        while t < n and offsets[t][1] <= s:
            t += 1
        while t < n and offsets[t][0] < e:
            labels[t] = ids[t]
            t += 1
        if not ends[k]:
            continue
        j = t
        while j < n:
            if ids[j] in skip_ids:
                j += 1
                continue
            if ids[j] in special_ids:
                if ids[j] != turn_start_id:
                    for q in range(t, j + 1):
                        if ids[q] not in skip_ids:
                            labels[q] = ids[q]
                    t = j + 1
                break
            a, b = offsets[j]
            if full[a:b].strip():
                break
            j += 1
    return labels
