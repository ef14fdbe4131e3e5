"""``val_size: N``: the first N rows of the dataset in shard order are the evaluation set, and the training stream
never yields them (docs/llamafactory.md, "Held-out evaluation"). As LLaMA-Factory 0.9.5 splits the converted
rows when streaming (``take(N)`` / ``skip(N)``), the training transform drops the rows before the cut by key,
so sample keys stay the dataset's own and nothing below the transform changes."""

from __future__ import annotations

import functools
from typing import Any

from ...errors import ConfigError, shown
from ...limits import MAX_INT64, is_number
from ...sources.table_rows import table_rows


def _why(value: Any, reason: str) -> ConfigError:
    return ConfigError(f"val_size: got {shown(value)}; not supported by resumable-stream llamafactory: {reason}")


def check_val_size(args: dict[str, Any]) -> int:
    """The number of held-out rows a yaml's ``val_size`` asks for (0: none), or a ConfigError naming why not."""
    value = args.get("val_size")
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1e-6):
        return 0                     # LLaMA-Factory's own threshold: val_size <= 1e-6 is no split
    if not is_number(value) or not 0 <= value <= MAX_INT64:     # inf, nan, a 400-digit int: no row count either
        raise _why(value, f"allowed: an integer >= 1 (at most {MAX_INT64}), the number of first rows held out "
                          "for evaluation")
    if value < 1:
        raise _why(value, "a fraction of a stream has no size (llamafactory-cli refuses it in streaming mode too: "
                          "'Streaming mode should have an integer val size'); allowed: an integer >= 1")
    if value != int(value):
        raise _why(value, "allowed: an integer >= 1, the number of first rows held out for evaluation")
    if args.get("eval_dataset"):
        raise _why(value, f"given with eval_dataset {shown(args['eval_dataset'])} (llamafactory-cli refuses both "
                          "together too); give one of them")
    names = [n for n in str(args.get("dataset") or "").split(",") if n.strip()]
    strategy = args.get("mix_strategy", "concat")
    if len(names) > 1 and strategy != "concat":
        raise _why(value, f"with mix_strategy {shown(strategy)}: the first rows of a random mixture are no fixed set; "
                          "allowed: one dataset, or several with mix_strategy: concat (read as one dataset)")
    return int(value)


def first_rows(source, n: int) -> tuple[list[dict], tuple[int, int]]:
    """(the first ``n`` rows of ``source`` in shard order, the cut: (shard, row) of the first row after them).
    ConfigError when no row is left after them: nothing would be trained on."""
    rows: list[dict] = []
    for shard in range(len(source.shards)):
        taken = 0
        tables = source.read(shard, 0)
        try:
            for table in tables:
                if len(rows) == n:
                    if table.num_rows:
                        return rows, (shard, taken)
                    continue
                part = table.slice(0, n - len(rows))
                part = table_rows(part) or part.to_pylist()      # (a JSON-lines source hands on its lines)
                rows.extend(part)
                taken += len(part)
                if len(rows) == n and table.num_rows > len(part):
                    return rows, (shard, taken)
        finally:
            tables.close()
    raise ConfigError(f"val_size: got {n}; the dataset has {len(rows)} rows, none would be left to train on; "
                      "allowed: fewer than the dataset's rows")


def eval_dataset(rows: list[dict], attr, template, tokenizer, data_args, training_args, stage: str):
    """The held-out rows as LLaMA-Factory's evaluation set: its converter for the dataset's entry, then the
    processor its loader picks for evaluation, over chunks of ``preprocessing_batch_size`` rows (its ``map``)."""
    # datasets and llamafactory: heavy, and llamafactory an optional extra; imported when used
    from datasets import Dataset
    from llamafactory.data.converter import get_dataset_converter
    from llamafactory.data.loader import _get_dataset_processor

    convert = get_dataset_converter(attr.formatting, attr, data_args)
    converted = [convert(row) for row in rows]
    processor = _get_dataset_processor(data_args, stage, template, tokenizer, None,
                                       do_generate=bool(training_args.predict_with_generate))
    chunk = max(1, int(data_args.preprocessing_batch_size))
    columns: dict[str, list] = {}
    for lo in range(0, len(converted), chunk):
        part = converted[lo:lo + chunk]
        out = processor.preprocess_dataset({name: [r[name] for r in part] for name in part[0]})
        for name, values in out.items():
            columns.setdefault(name, []).extend(values)
    if not columns.get("input_ids"):
        raise ConfigError(f"val_size: got {len(rows)}; the first {len(rows)} rows make no evaluation example "
                          "(LLaMA-Factory's processor dropped them all); allowed: more rows")
    return Dataset.from_dict(columns)


def hold_out(train, val_size: int, template, tokenizer, data_args, training_args, stage: str):
    """Take the first ``val_size`` rows of the training stream ``train`` (a TrainingStream over one dataset)
    away from it; the evaluation dataset they make."""
    from llamafactory.data.parser import get_dataset_list  # an optional extra, imported when used

    rows, cut = first_rows(train.stream.source, val_size)
    # one dataset, or a concat of datasets of one formatting (stream_section checked it): the first one's converter
    attr = get_dataset_list(data_args.dataset, data_args.dataset_dir)[0]
    dataset = eval_dataset(rows, attr, template, tokenizer, data_args, training_args, stage)
    train.processor_factory = functools.partial(train.processor_factory, held_out=(val_size, cut))
    return dataset
