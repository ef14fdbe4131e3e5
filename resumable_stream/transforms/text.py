"""Text transform: raw rows -> tokenized training examples (``text``, or chat formats labelled on assistant turns
by :mod:`.chat`), packed ``concat`` or ``neat`` (docs/packing.md, docs/formats.md)."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import deque
from typing import Any

import numpy as np

from ..config.chat_formats import resolved_columns, resolved_tags
from ..config.transforms import TransformConfig
from ..errors import SidecarError
from .chat import IGNORE_INDEX, ChatTemplate, NotVerbatim, checked_messages
from .errors import TransformError
from .formats import BadRow, to_messages
from .protocol import Example, QueuedProcessor, checked_state, saved_stats
from .row_map import RowMap

STATE_VERSION = 1
STAT_KEYS = ("skipped_empty", "dropped_overlong", "truncated", "samples", "examples", "skipped_bad",
             "dropped_by_map")
_LATER_STATS = ("skipped_bad", "dropped_by_map")    # absent from the states of earlier versions


def tokenizer_digest(tokenizer: Any) -> str:
    """blake2b of the backend tokenizer (with its transient truncation/padding settings removed), the
    chat template and the EOS id: what decides the tokens this transform produces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TransformError(
            f"tokenizer {type(tokenizer).__name__}: not a fast tokenizer; the text transform needs one "
            "(load it with AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    spec = json.loads(backend.to_str())
    # transformers sets these on the backend per call (truncation=True, padding=...); they are not identity.
    spec["truncation"] = None
    spec["padding"] = None
    return labelled_digest(json.dumps(spec, sort_keys=True, ensure_ascii=False),
                           chat_template=json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True),
                           eos=getattr(tokenizer, "eos_token_id", None))


def labelled_digest(first: str, **parts: Any) -> str:
    """blake2b (16 bytes) of ``first``, then ``\\0name\\0value`` per part: the tokenizer's and processor's digests."""
    text = first + "".join(f"\0{name}\0{value}" for name, value in parts.items())
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class TextProcessor(QueuedProcessor):
    """Turns raw rows into training examples; see the module docstring."""

    def __init__(self, tokenizer: Any, cfg: TransformConfig):
        if not isinstance(cfg, TransformConfig):
            raise TypeError(f"cfg: expected a TransformConfig, got {type(cfg).__name__}")
        self.tokenizer = tokenizer
        self.cfg = cfg
        # per source label (None: the data section's): its settings and its data.map function
        self._settings = {None: (cfg, RowMap(cfg.map, cfg.map_version) if cfg.map else None)}
        for i, (label, scfg) in enumerate(cfg.sources):
            self._settings[label] = (scfg, RowMap(scfg.map, scfg.map_version, f"data.sources[{i}].map")
                                     if scfg.map else None)
        self.takes_source = bool(cfg.sources)   # the loader passes feed() the sample's source label
        self.counts_key_tokens = True           # take(with_key_tokens=True) says each key's tokens
        self._fingerprint = self._compute_fingerprint()
        self._eos = tokenizer.eos_token_id
        self._neat = cfg.packing and cfg.packing_mode == "neat"
        configs = cfg.all_configs()
        if cfg.add_eos and self._eos is None and any(c.format == "text" for c in configs):
            raise TransformError("data.add_eos: true but the tokenizer has no eos_token; set one or add_eos: false")
        chat = [c.format for c in configs if c.is_chat]
        if chat and not getattr(tokenizer, "chat_template", None):
            raise TransformError(f"data.format: {chat[0]!r} but the tokenizer has no chat_template")
        self._chat = ChatTemplate(tokenizer.apply_chat_template, tokenizer, self._tokenize_with_offsets,
                                  lambda role, text: {"role": role, "content": text}) if chat else None
        self._reset()

    # ------------------------------------------------------------------ state kept between feeds
    def _reset(self) -> None:
        # finished examples: (input_ids, labels, keys, segment lengths; None unless packing_mode is neat)
        self._pending: deque[tuple[list[int], list[int], list[str], list[int] | None]] = deque()
        # per finished example, the tokens of each of its keys (None: unknown, from a state saved without them)
        self._pending_key_tokens: deque[list[int] | None] = deque()
        # packing carry: flat token/label lists from _carry_start on, [key, n_tokens] per contributing sample
        self._carry_ids: list[int] = []
        self._carry_labels: list[int] = []
        self._carry_start = 0
        self._carry_keys: deque[list[Any]] = deque()
        self._stats = dict.fromkeys(STAT_KEYS, 0)

    # ------------------------------------------------------------------ public API
    def feed(self, sample: dict, key: str, source: str | None = None) -> None:
        """Take one raw row (``source``: its mixture source, whose settings apply). ``data.map`` runs first; every row
        it returns is encoded now, so what is not yet taken is in ``state()``."""
        cfg, row_map = self._settings.get(source, self._settings[None])
        self._feed_mapped(sample, key, row_map, lambda row, row_key: self._feed_row(row, row_key, cfg))

    def _feed_row(self, sample: dict, key: str, cfg: TransformConfig) -> None:
        if cfg.format == "text":
            encoded = self._encode_text(sample, key, cfg)
        else:
            encoded = self._encode_messages(sample, key, cfg)
        if encoded is None:
            return
        ids, labels = encoded
        if self.cfg.packing:
            self._carry_ids += ids
            self._carry_labels += labels
            self._carry_keys.append([key, len(ids)])
            self._cut_blocks()
            return
        L = self.cfg.max_seq_len
        if len(ids) > L:
            policy = self.cfg.overlong
            if policy == "error":
                raise TransformError(
                    f"sample {key!r}: {len(ids)} tokens, longer than data.max_seq_len {L} "
                    "(data.overlong is 'error'; use 'truncate' or 'drop', raise max_seq_len, or enable packing)",
                    key)
            if policy == "drop":
                self._stats["dropped_overlong"] += 1
                return
            ids, labels = ids[:L], labels[:L]
            if all(x == IGNORE_INDEX for x in labels):
                # truncation cut away every assistant token: nothing left to learn from
                self._stats["dropped_overlong"] += 1
                return
            self._stats["truncated"] += 1
        self._emit(ids, labels, [(key, len(ids))])

    def take(self, with_key_tokens: bool = False) -> Example:
        """Pop the oldest example: ``{"input_ids", "labels", "keys"}`` (+ ``position_ids`` with ``packing_mode: neat``;
        with ``with_key_tokens`` the tokens each key put in it, None when restored from a state without them)."""
        ids, labels, keys, segments = super().take()
        key_tokens = self._pending_key_tokens.popleft()
        example = {"input_ids": ids, "labels": labels, "keys": keys}
        if with_key_tokens:
            example["key_tokens"] = key_tokens
        if segments is not None:
            example["position_ids"] = [p for n in segments for p in range(n)]
        return example

    def flush(self) -> None:
        """Packing only: turn the carried tokens into one last, shorter example (end of a finite stream)."""
        if self.cfg.packing and len(self._carry_ids) > self._carry_start:
            ids = self._carry_ids[self._carry_start:]
            labels = self._carry_labels[self._carry_start:]
            parts = [(k, n) for k, n in self._carry_keys]
            self._carry_ids, self._carry_labels, self._carry_start = [], [], 0
            self._carry_keys.clear()
            self._emit(ids, labels, parts)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """``{"tensors": {name: int64 ndarray}, "meta": JSON-able dict}``; see ``load_state``."""
        carry_ids = self._carry_ids[self._carry_start:]
        carry_labels = self._carry_labels[self._carry_start:]
        pending = list(self._pending)
        tensors = {
            "carry_input_ids": _arr(carry_ids),
            "carry_labels": _arr(carry_labels),
            "carry_key_tokens": _arr([n for _, n in self._carry_keys]),   # also the document boundaries
            "pending_input_ids": _arr([t for ids, _, _, _ in pending for t in ids]),
            "pending_labels": _arr([t for _, labels, _, _ in pending for t in labels]),
            "pending_lengths": _arr([len(ids) for ids, _, _, _ in pending]),
            "pending_key_counts": _arr([len(keys) for _, _, keys, _ in pending]),
        }
        if self._neat:   # only then, so that concat states keep the layout they always had
            tensors["pending_segment_lengths"] = _arr([n for *_, segs in pending for n in segs])
            tensors["pending_segment_counts"] = _arr([len(segs) for *_, segs in pending])
        meta = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "carry_keys": [k for k, _ in self._carry_keys],
            "pending_keys": [k for _, _, keys, _ in pending for k in keys],
            "stats": self.stats(),
        }
        if all(n is not None for n in self._pending_key_tokens):    # the realized mixture's token counts
            meta["pending_key_tokens"] = [int(n) for ns in self._pending_key_tokens for n in ns]
        return {"tensors": tensors, "meta": meta}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a ``state()``; raises ``StreamMismatchError`` if it was made with another tokenizer
        or other output-changing settings, ``SidecarError`` if it is malformed."""
        tensors, meta = checked_state(state, STATE_VERSION, self.fingerprint())
        try:
            t = {k: np.asarray(tensors[k], dtype=np.int64).reshape(-1).tolist() for k in (
                "carry_input_ids", "carry_labels", "carry_key_tokens",
                "pending_input_ids", "pending_labels", "pending_lengths", "pending_key_counts")}
            segments = {k: np.asarray(tensors[k], dtype=np.int64).reshape(-1).tolist() for k in (
                "pending_segment_lengths", "pending_segment_counts")} if self._neat else None
            carry_keys = [str(k) for k in meta["carry_keys"]]
            pending_keys = [str(k) for k in meta["pending_keys"]]
            stats = saved_stats(meta, STAT_KEYS, _LATER_STATS)
        except (KeyError, TypeError, ValueError) as e:
            raise SidecarError(f"transform state: missing or malformed field ({e})") from None
        n_carry = len(t["carry_input_ids"])
        if (len(t["carry_labels"]) != n_carry or sum(t["carry_key_tokens"]) != n_carry
                or len(t["carry_key_tokens"]) != len(carry_keys)
                or len(t["pending_labels"]) != len(t["pending_input_ids"])
                or sum(t["pending_lengths"]) != len(t["pending_input_ids"])
                or len(t["pending_key_counts"]) != len(t["pending_lengths"])
                or sum(t["pending_key_counts"]) != len(pending_keys)):
            raise SidecarError("transform state: inconsistent lengths (truncated or corrupt state)")
        pending_segments = _split_segments(segments, t["pending_lengths"]) if segments is not None \
            else [None] * len(t["pending_lengths"])
        self._reset()
        self._carry_ids, self._carry_labels = t["carry_input_ids"], t["carry_labels"]
        self._carry_keys = deque([k, n] for k, n in zip(carry_keys, t["carry_key_tokens"]))
        lengths = t["pending_lengths"]
        self._pending.extend(zip(_pieces(t["pending_input_ids"], lengths), _pieces(t["pending_labels"], lengths),
                                 _pieces(pending_keys, t["pending_key_counts"]), pending_segments))
        self._pending_key_tokens = deque(_split_key_tokens(meta.get("pending_key_tokens"), t["pending_key_counts"],
                                                           t["pending_lengths"]))
        self._stats = stats

    # ------------------------------------------------------------------ internals
    def _compute_fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        fp: dict[str, Any] = {"tokenizer": tokenizer_digest(self.tokenizer), "format": c.format,
                              "max_seq_len": c.max_seq_len, "packing": c.packing, "empty": c.empty,
                              "id_column": c.id_column}
        fp.update(self._row_fingerprint(None))
        if c.format == "text":
            fp["add_eos"] = c.add_eos
        if not c.packing:
            fp["overlong"] = c.overlong
        elif c.packing_mode != "concat":   # absent means concat: states saved before the key existed still load
            fp["packing_mode"] = c.packing_mode
        if c.sources:
            fp["sources"] = {label: {"format": sc.format, **self._row_fingerprint(label)} for label, sc in c.sources}
        return fp

    def _row_fingerprint(self, source: str | None) -> dict[str, Any]:
        """What decides how a row of ``source`` becomes a conversation or a text: columns, tags, data.map."""
        c, row_map = self._settings[source]
        if c.format == "text":
            fp: dict[str, Any] = {"text_column": c.text_column}
        elif c.format == "messages":
            fp = {"messages_column": c.messages_column}
        else:
            fp = {"columns": resolved_columns(c.format, c.columns)}
            if c.format == "sharegpt":
                fp["tags"] = resolved_tags(c.tags)
        if row_map is not None:
            fp["map"] = row_map.identity
        return fp

    def _emit(self, ids: list[int], labels: list[int], parts: list[tuple[str, int]]) -> None:
        """Queue one example; ``parts``: (sample key, tokens) of each contributing sample, in order."""
        segments = None
        if self._neat:
            segments = [n for _, n in parts if n]   # a sample that tokenized to nothing is no segment
            labels = list(labels)
            start = 0
            for n in segments:   # a segment's first token is never predicted from the segment before it
                labels[start] = IGNORE_INDEX
                start += n
        self._pending.append((ids, labels, [k for k, _ in parts], segments))
        self._pending_key_tokens.append([n for _, n in parts])
        self._stats["examples"] += 1

    def _cut_blocks(self) -> None:
        L = self.cfg.max_seq_len
        while len(self._carry_ids) - self._carry_start >= L:
            start, end = self._carry_start, self._carry_start + L
            parts: list[tuple[str, int]] = []
            need = L
            while need:
                entry = self._carry_keys[0]
                n = min(need, entry[1])
                parts.append((entry[0], n))
                need -= n
                if n == entry[1]:
                    self._carry_keys.popleft()
                else:
                    entry[1] -= n
            self._emit(self._carry_ids[start:end], self._carry_labels[start:end], parts)
            self._carry_start = end
        if self._carry_start:
            del self._carry_ids[:self._carry_start]
            del self._carry_labels[:self._carry_start]
            self._carry_start = 0

    def _encode_text(self, sample: dict, key: str, cfg: TransformConfig) -> tuple[list[int], list[int]] | None:
        col = cfg.text_column
        text = sample.get(col) if isinstance(sample, dict) else None
        if text is None or (isinstance(text, str) and not text.strip()):
            what = "missing" if text is None and (not isinstance(sample, dict) or col not in sample) else (
                "null" if text is None else "empty or whitespace only")
            self._empty(key, f"column data.text_column {col!r} is {what}")
            return None
        if not isinstance(text, str):
            raise TransformError(
                f"sample {key!r}: column data.text_column {col!r} holds {type(text).__name__}, expected a string",
                key)
        # the fast tokenizer's Rust core (tokenizer_digest made sure there is one): same ids, half the overhead
        ids = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        if self.cfg.add_eos:
            ids.append(self._eos)
        return ids, list(ids)

    # ---- messages
    def _tokenize_with_offsets(self, text: str) -> tuple[list[int], Any]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(x) for x in enc["input_ids"]], enc["offset_mapping"]

    def _encode_messages(self, sample: dict, key: str, cfg: TransformConfig) -> tuple[list[int], list[int]] | None:
        if cfg.format == "messages":
            col = cfg.messages_column
            what = f"column data.messages_column {col!r}"
            msgs = sample.get(col) if isinstance(sample, dict) else None
            if msgs is None or (isinstance(msgs, (list, tuple)) and len(msgs) == 0):
                self._empty(key, f"{what} is {'missing' if msgs is None else 'empty'}")
                return None
            msgs = checked_messages(msgs, key, col)
        else:     # alpaca / sharegpt: LLaMA-Factory's columns and tags -> messages
            what = f"the {cfg.format} conversation"
            try:
                msgs = to_messages(cfg.format, sample, resolved_columns(cfg.format, cfg.columns),
                                   resolved_tags(cfg.tags), frozenset(cfg.columns or ()))
            except BadRow as e:
                self._bad(key, f"{e} (data.format {cfg.format!r})")
                return None
        texts = [[c] if (c := (m.get("content") or "").strip()) else [] for m in msgs]
        if not any(m["role"] == "assistant" and t for m, t in zip(msgs, texts)):
            self._empty(key, f"{what} has no assistant turn with content")
            return None
        try:
            full = self._chat.render(msgs, False)
        except Exception as e:
            raise TransformError(f"sample {key!r}: the chat template failed on this conversation ({e})", key) from e
        try:
            return self._chat.label(full, msgs, texts)
        except NotVerbatim as e:
            raise TransformError(f"sample {key!r}: {e}", key) from None


def _pieces(flat: list, counts: list[int]) -> list[list]:
    """``flat`` cut into consecutive pieces of ``counts`` items."""
    ends = list(itertools.accumulate(counts))
    return [flat[end - n:end] for n, end in zip(counts, ends)]


def _split_segments(segments: dict[str, list[int]], lengths: list[int]) -> list[list[int]]:
    """Per pending example, its segment lengths; ``SidecarError`` unless they tile each example exactly."""
    flat, counts = segments["pending_segment_lengths"], segments["pending_segment_counts"]
    out = _pieces(flat, counts)
    if (len(counts) != len(lengths) or sum(counts) != len(flat) or any(n <= 0 for n in flat + counts)
            or any(sum(segs) != n for segs, n in zip(out, lengths))):
        raise SidecarError("transform state: inconsistent segment lengths (truncated or corrupt state)")
    return out


def _split_key_tokens(flat: Any, key_counts: list[int], lengths: list[int]) -> list[list[int] | None]:
    """Per pending example, its keys' tokens from a state's ``pending_key_tokens``; all None when the state has
    none (saved before they were kept) or they do not add up to the examples (they only feed the metrics)."""
    if (isinstance(flat, list) and len(flat) == sum(key_counts)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in flat)):
        out = _pieces(flat, key_counts)
        if all(sum(part) == n for part, n in zip(out, lengths)):
            return out
    return [None] * len(lengths)


def _arr(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def collate_numpy(examples: list[Example], pad_token_id: int) -> dict[str, np.ndarray]:
    """``collate``'s padding as int64 numpy arrays (no torch needed: MindSpore); with ``position_ids`` the padded tail
    of a row counts 0, 1, ... as a segment of its own."""
    if not examples:
        raise ValueError("collate: empty batch")
    if pad_token_id is None:
        raise ValueError("collate: pad_token_id is None; set tokenizer.pad_token (e.g. to the EOS token)")
    neat = sum("position_ids" in ex for ex in examples)
    if neat not in (0, len(examples)):
        raise ValueError("collate: some examples have position_ids and some do not (mixed packing modes)")
    width = max(len(ex["input_ids"]) for ex in examples)
    ids = np.full((len(examples), width), int(pad_token_id), dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(examples), width), dtype=np.int64)
    positions = np.tile(np.arange(width, dtype=np.int64), (len(examples), 1))
    for r, ex in enumerate(examples):
        n = len(ex["input_ids"])
        if len(ex["labels"]) != n:
            raise ValueError(f"collate: example {r} has {n} input_ids but {len(ex['labels'])} labels")
        ids[r, :n] = np.asarray(ex["input_ids"], dtype=np.int64)
        labels[r, :n] = np.asarray(ex["labels"], dtype=np.int64)
        mask[r, :n] = 1
        if neat:
            if len(ex["position_ids"]) != n:
                raise ValueError(f"collate: example {r} has {n} input_ids but {len(ex['position_ids'])} position_ids")
            positions[r, :n] = np.asarray(ex["position_ids"], dtype=np.int64)
            positions[r, n:] = np.arange(width - n)
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if neat:
        out["position_ids"] = positions
    return out


def collate(examples: list[Example], pad_token_id: int, flash_attn_kwargs: bool = False) -> dict[str, Any]:
    """Right-pad a batch as int64 torch tensors: input_ids with ``pad_token_id``, labels with -100, attention_mask.
    With ``position_ids`` (``packing_mode: neat``) no attention_mask: transformers builds the block-diagonal mask
    from the restarts (and ``use_cache: False``, with which it would not); ``flash_attn_kwargs`` adds the
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` flash-attention's varlen path needs."""
    import torch

    arrays = {name: torch.from_numpy(a) for name, a in collate_numpy(examples, pad_token_id).items()}
    ids, labels, positions = arrays["input_ids"], arrays["labels"], arrays.get("position_ids")
    if positions is None:
        return {"input_ids": ids, "labels": labels, "attention_mask": arrays["attention_mask"]}
    # a model's config asks for a KV cache by default, and with one transformers' masking utils do not look
    # for packed sequences (transformers 5's Trainer turns the cache off for training; a plain loop may not)
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}
    if flash_attn_kwargs:
        flat = positions.reshape(-1)
        starts = (flat == 0).nonzero().reshape(-1)
        cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
        longest = int(cu.diff().max())
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return batch
