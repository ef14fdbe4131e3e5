"""LLaMA-Factory's converter and dataset processor (``pt``, ``sft``, packed ``sft``) as a stateful transform,
exactly as ``llamafactory-cli``'s batched ``map``: a packing chunk of ``preprocessing_batch_size`` rows is part of
the state and never spans an epoch's end (docs/llamafactory.md)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import SidecarError
from ...io.safe_files import JSONRefused, parse_json
from ...transforms.errors import BadSample, TransformError, skip_or_raise
from ...transforms.protocol import QueuedProcessor, checked_state, saved_stats
from ...transforms.text import tokenizer_digest
from . import media, preference

log = logging.getLogger(__name__)
STATE_VERSION = 1
STAT_KEYS = ("rows", "examples", "dropped", "skipped_image", "skipped_mismatch")
_LATER_STATS = ("skipped_image", "skipped_mismatch")     # absent from the states of earlier versions
# DatasetAttr fields that decide how a row is converted (columns and tags of dataset_info.json)
ATTR_FIELDS = ("formatting", "system", "tools", "prompt", "query", "response", "history", "messages",
                "role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag",
                "system_tag", "images", "videos", "audios")
_TEMPLATE_FIELDS = ("format_user", "format_assistant", "format_system", "format_function", "format_observation",
                    "format_tools", "format_prefix", "default_system", "stop_words", "thought_words",
                    "tool_call_words", "efficient_eos", "replace_eos", "replace_jinja_template", "enable_thinking",
                    "preserve_thinking")
# data arguments the dataset processors read
_DATA_FIELDS = ("cutoff_len", "train_on_prompt", "mask_history", "packing", "neat_packing", "template",
                "tool_format", "default_system", "enable_thinking", "preserve_thinking")


def _plain(value: Any) -> Any:
    """A JSON-able description of a template field (formatters by class, slots and tool format)."""
    from llamafactory.data.formatter import Formatter  # llamafactory: an optional extra, imported when used

    if isinstance(value, Formatter):
        return {"class": type(value).__name__, "slots": _plain(value.slots), "tool_format": value.tool_format}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted(map(str, value))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return {"class": type(value).__name__}


def template_digest(template) -> str:
    """blake2b of what the template renders with: its class, formatters, default system, stop words, flags and
    media plugin (after ``get_template_and_fix_tokenizer`` applied the data arguments to it)."""
    desc = {"class": type(template).__name__, **{f: _plain(getattr(template, f, None)) for f in _TEMPLATE_FIELDS}}
    plugin = getattr(template, "mm_plugin", None)
    desc["mm_plugin"] = {"class": type(plugin).__name__, **{k: getattr(plugin, k, None) for k in
                                                           ("image_token", "video_token", "audio_token")}}
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass
class Formatting:
    """What formats rows the way LLaMA-Factory does: its template and tokenizer (as ``run_sft`` / ``run_pt``
    fixed them), data arguments and stage, and the dataset attributes of each source (by label)."""

    template: Any
    tokenizer: Any
    data_args: Any
    stage: str
    attrs: dict[str, Any]            # source label -> DatasetAttr
    processor: Any = None            # a multimodal model's processor (LLaMA-Factory's load_tokenizer)
    media: Any = None                # its image rules (media.media_settings), with a processor

    @property
    def chunk(self) -> int:
        rows = preference.chunk(self.stage, self.data_args)
        if rows is not None:
            return rows
        return max(1, int(self.data_args.preprocessing_batch_size)) if self.packing else 1

    @property
    def packing(self) -> bool:
        # the pairwise and feedback processors do not pack (LLaMA-Factory ignores packing there)
        return bool(self.data_args.packing) and self.stage in ("pt", "sft")

    def fingerprint(self) -> dict[str, Any]:
        import llamafactory  # an optional extra, imported when used

        fp = {"llamafactory": llamafactory.__version__, "stage": self.stage,
              "template": template_digest(self.template), "tokenizer": tokenizer_digest(self.tokenizer),
              "data": {f: getattr(self.data_args, f, None) for f in _DATA_FIELDS},
              "sources": {label: {**{f: getattr(attr, f, None) for f in ATTR_FIELDS},
                                  **preference.fingerprint(attr)}
                          for label, attr in sorted(self.attrs.items())}}
        if self.packing or self.stage == "kto":      # the chunk decides the blocks / kto's KL pairs
            fp["data"]["preprocessing_batch_size"] = self.chunk
        if self.processor is not None:               # only then: text fingerprints stay as they were
            fp["processor"] = media.processor_fingerprint(self.processor)
            fp["media"] = {"media_dir": self.data_args.media_dir,
                           **{k: getattr(self.media, k) for k in ("max_image_bytes", "allow_absolute_image_paths")}}
        return fp


_BYTES = "__bytes_b64__"     # image bytes (an HF Image struct of a parquet row) in a JSON state


def _bytes_out(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _bytes_in(value: Any) -> Any:
    if isinstance(value, list):
        return [_bytes_in(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_BYTES} and isinstance(value[_BYTES], str):
            return base64.b64decode(value[_BYTES], validate=True)
        return {k: _bytes_in(v) for k, v in value.items()}
    return value


class LlamaFactoryProcessor(QueuedProcessor):
    """A :class:`~resumable_stream.transforms.Processor` around LLaMA-Factory's converter and dataset processor;
    ``held_out``: (val_size, cut), the rows before the (shard, row) ``cut`` dropped (:mod:`.held_out`)."""

    takes_source = True              # a mixture tells each sample's source: its dataset's converter
    epoch_bound = True               # llamafactory-cli maps each epoch afresh: a chunk never spans two

    def __init__(self, fmt: Formatting, held_out: tuple[int, tuple[int, int]] | None = None):
        # llamafactory: an optional extra, imported when used
        from llamafactory.data.converter import get_dataset_converter
        from llamafactory.data.loader import _get_dataset_processor

        self.fmt = fmt
        self._converters = {label: get_dataset_converter(attr.formatting, attr, fmt.data_args)
                            for label, attr in fmt.attrs.items()}
        self._default = next(iter(fmt.attrs))
        # the stage's dataset processor, as LLaMA-Factory's loader picks it (its dpo stage reads "rm" data)
        self._processor = _get_dataset_processor(fmt.data_args, fmt.stage, fmt.template, fmt.tokenizer, fmt.processor)
        self._fingerprint = fmt.fingerprint()
        self._cut = tuple(held_out[1]) if held_out is not None else None
        # in the stream's fingerprint; the state's own (below) leaves it out, as it always did
        self._held_out = {"val_size": held_out[0], "cut": list(self._cut)} if held_out is not None else None
        self._reset()

    def _reset(self) -> None:
        self._rows: list[tuple[str, dict]] = []             # converted rows of the unfinished chunk
        self._pending: deque[dict] = deque()                # examples, each with its "keys"
        self._tail = 0                                      # the first examples of _pending: an ended epoch's
        self.data_epoch: int | None = None                  # the epoch of the rows fed (set by the loader)
        self._stats = dict.fromkeys(STAT_KEYS, 0)

    def feed(self, sample: dict, key: str, source: str | None = None) -> None:
        if self._cut is not None:
            # one dataset (mixtures are refused with val_size): the loader's key is "shard:row"
            shard, row = key.rsplit(":", 1)
            if (int(shard), int(row)) < self._cut:
                return
        label = source if source in self._converters else self._default
        self._stats["rows"] += 1
        attr = self.fmt.attrs[label]
        try:
            if self.fmt.processor is not None and attr.images:
                sample = {**sample, attr.images: media.checked_images(sample.get(attr.images), self.fmt.media)}
            row = self._converters[label](sample)
            if self.fmt.processor is not None and (why := media.placeholder_problem(row)):
                raise BadSample("skipped_mismatch", why)
        except KeyError as e:
            raise TransformError(f"sample {key!r} of dataset {attr.dataset_name!r}: no column {e} "
                                 "(the columns its dataset_info.json entry names, or the defaults of its "
                                 f"formatting {attr.formatting!r}); the row has "
                                 f"{sorted(sample)}", key) from None
        except BadSample as bad:
            skip_or_raise(self.fmt.media.bad_sample, "resumable_stream.bad_sample", key, bad.reason, self._stats,
                          bad.kind, log, where=f"sample {key!r} of dataset {attr.dataset_name!r}")
            return
        self._rows.append((key, row))
        if len(self._rows) >= self.fmt.chunk:
            self._process()

    def _process(self) -> None:
        rows, self._rows = self._rows, []
        batch = {name: [row[name] for _, row in rows] for name in rows[0][1]}
        out = self._processor.preprocess_dataset(batch)
        n = len(next(iter(out.values()), []))     # input_ids, or chosen_input_ids (pairwise)
        examples = [{name: values[i] for name, values in out.items()} for i in range(n)]
        keys = [key for key, _ in rows]
        per_example = preference.example_keys(self.fmt.stage, rows, n)
        if not self.fmt.packing or per_example is not None:
            self._stats["dropped"] += len(rows) - n      # invalid conversations, as LLaMA-Factory drops them
        for i, example in enumerate(examples):
            # without packing a chunk is one row and one example (or none); packed, its first block carries the
            # keys of every row of the chunk (which block holds which row is the knapsack's business)
            example["keys"] = per_example[i] if per_example is not None else keys if i == 0 else []
            self._pending.append(example)
        self._stats["examples"] += n

    def flush(self) -> None:
        if self._rows:
            self._process()

    def end_epoch(self, epoch: int) -> None:
        self.flush()
        self._tail = len(self._pending)
        self.data_epoch = epoch

    def epoch_tail(self) -> int:
        return self._tail

    def take(self, with_key_tokens: bool = False) -> dict:
        example = super().take()
        self._tail = max(0, self._tail - 1)
        return example

    def fingerprint(self) -> dict[str, Any]:
        return {**self._fingerprint, "held_out": self._held_out} if self._held_out else dict(self._fingerprint)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        pending = json.dumps([[key, row] for key, row in self._rows], default=_bytes_out).encode()
        ready = json.dumps(list(self._pending), default=_bytes_out).encode()
        return {"tensors": {"pending_rows": np.frombuffer(pending, dtype=np.uint8).copy(),
                            "ready_examples": np.frombuffer(ready, dtype=np.uint8).copy()},
                "meta": {"version": STATE_VERSION, "fingerprint": dict(self._fingerprint), "stats": self.stats(),
                         "data_epoch": self.data_epoch, "epoch_tail": self._tail}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a ``state()``: StreamMismatchError when it was made with another template, tokenizer, stage,
        data argument or dataset_info entry; SidecarError when it is malformed."""
        tensors, meta = checked_state(state, STATE_VERSION, self._fingerprint)
        try:
            pending = _bytes_in(parse_json(np.asarray(tensors["pending_rows"], dtype=np.uint8).tobytes()))
            ready = _bytes_in(parse_json(np.asarray(tensors["ready_examples"], dtype=np.uint8).tobytes()))
            stats = saved_stats(meta, STAT_KEYS, _LATER_STATS)
            # states saved before epochs bounded the chunks have neither (the loader then asks the stream)
            data_epoch, tail = meta.get("data_epoch"), meta.get("epoch_tail", 0)
            ok = (isinstance(pending, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                    and isinstance(p[1], dict) for p in pending)
                  and isinstance(ready, list) and all(isinstance(e, dict) and isinstance(e.get("keys"), list)
                                                      for e in ready))
        except (KeyError, TypeError, ValueError, JSONRefused) as e:
            raise SidecarError(f"LLaMA-Factory transform state: missing or malformed field ({e})") from None
        ok = ok and (data_epoch is None or (type(data_epoch) is int and data_epoch >= 0)) \
            and type(tail) is int and 0 <= tail <= len(ready)
        if not ok or len(pending) >= self.fmt.chunk:
            raise SidecarError("LLaMA-Factory transform state: malformed pending rows, examples, data_epoch or "
                               "epoch_tail")
        self._reset()
        self._rows = [(key, row) for key, row in pending]
        self._pending.extend(ready)
        self._stats = stats
        self.data_epoch, self._tail = data_epoch, tail
