"""LLaMA-Factory's datasets (``dataset`` + ``dataset_info.json``) as our stream, in place of its ``get_dataset``:
its keys map as docs/llamafactory.md ("How LLaMA-Factory's keys map") says. Everything that decides how a row is
formatted stays LLaMA-Factory's (:mod:`.processor`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
from typing import Any

import numpy as np

from ...config.stream_config import StreamConfig
from ...errors import ConfigError
from ...stream.mixture import open_stream
from .held_out import check_val_size, hold_out
from .media import media_settings
from .preference import ATTR_FIELDS as PREFERENCE_FIELDS
from .preference import check_stage
from .processor import ATTR_FIELDS, Formatting, LlamaFactoryProcessor
from .settings import STREAM_KEYS, monitor_settings

log = logging.getLogger(__name__)
_LABEL = re.compile(r"[^A-Za-z0-9_.-]")
_STRATEGIES = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}
# how the data.elastic_determinism errors name LLaMA-Factory's keys and ours
LLAMAFACTORY_KEYS = {"switch": "resumable_stream.elastic_determinism", "partitions": "resumable_stream.num_partitions"}


def _refused(name: str, what: str) -> ConfigError:
    return ConfigError(f"dataset {name!r} (dataset_info.json): {what}; not supported by resumable-stream llamafactory")


def _source(attr, data_args) -> dict[str, Any]:
    """The data keys of our stream for one dataset_info.json entry."""
    from llamafactory.extras.constants import FILEEXT2TYPE  # an optional extra, imported when used

    name = attr.dataset_name
    media = [c for c in ("videos", "audios") if getattr(attr, c, None)]
    if media:     # transformers 5's video processors need torchvision; audio has no test here either
        raise _refused(name, f"media columns {media} (images are; videos and audios are not yet)")
    if attr.num_samples is not None:
        log.warning("dataset %r: num_samples is ignored when streaming (as llamafactory-cli ignores it)", name)
    if attr.load_from == "file":
        path = os.path.join(data_args.dataset_dir, name)
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path))
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ConfigError(f"dataset {name!r} (dataset_info.json file_name): {path!r} not found")
        kinds = {FILEEXT2TYPE.get(os.path.splitext(f)[1][1:]) for f in files}
        if len(kinds) != 1 or None in kinds:
            raise ConfigError(f"dataset {name!r} (dataset_info.json file_name {path!r}): files of one type only; "
                              f"allowed extensions: {', '.join(FILEEXT2TYPE)}")
        return {"dataset_name_or_path": kinds.pop(), "data_files": files, "split": attr.split}
    if attr.load_from == "hf_hub":
        out = {"dataset_name_or_path": name, "split": attr.split}
        if attr.subset:
            out["name"] = attr.subset
        if attr.folder:
            out["data_dir"] = attr.folder
        return out
    raise _refused(name, f"loaded from {attr.load_from} (allowed: file_name, hf_hub_url)")


def _label(i: int, name: str) -> str:
    """The source label of the ``dataset:`` entry ``name`` (sample keys, logs): the entry's name."""
    label = _LABEL.sub("_", str(name))[-64:]
    return label or f"source{i}"


def _same_formatting(a, b) -> bool:
    return all(getattr(a, f, None) == getattr(b, f, None) for f in ATTR_FIELDS + PREFERENCE_FIELDS)


def lf_concat_order(sources: list, seed: int) -> list:
    """The datasets of ``mix_strategy: concat`` in the order llamafactory-cli reads them in its first epoch: its
    ``split_dataset`` shuffle permutes the datasets with ``numpy.random.default_rng(seed)`` even with
    ``buffer_size: 1``. Its later epochs permute them again; ours keep this order (docs/llamafactory.md)."""
    order = list(range(len(sources)))
    np.random.default_rng(seed).shuffle(order)
    return [sources[i] for i in order]


def mixture_draws(data_args) -> str:
    """An interleaved mixture read in file order (``buffer_size: 1``) draws its datasets as
    ``datasets.interleave_datasets`` does for llamafactory-cli; shuffled, our own draws (the order is ours anyway)."""
    if data_args.buffer_size > 1:
        return "hash"
    return "datasets_choice" if data_args.interleave_probs else "datasets_cycle"


def stream_section(data_args, training_args, ours: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ``data:`` section of our stream, source label -> DatasetAttr) of LLaMA-Factory's data arguments."""
    from llamafactory.data.parser import get_dataset_list  # an optional extra, imported when used

    attrs = get_dataset_list(data_args.dataset, data_args.dataset_dir)
    if not attrs:
        raise ConfigError("dataset: missing; allowed: the names of dataset_info.json entries, comma-separated")
    sources = [_source(a, data_args) for a in attrs]
    labels = [_label(i, name) for i, name in enumerate(data_args.dataset)]
    if len(set(labels)) != len(labels):
        labels = [f"source{i}" for i in range(len(attrs))]
    order = {"shuffle": data_args.buffer_size > 1, "buffer_size": data_args.buffer_size,
             "shuffle_seed": training_args.seed}
    stream_keys = {k: v for k, v in ours.items() if k in STREAM_KEYS and k != "resume_state_path"}
    if len(sources) == 1:
        return {**sources[0], **order, **stream_keys}, {labels[0]: attrs[0]}
    strategy = data_args.mix_strategy
    if strategy == "concat":
        builders = {s["dataset_name_or_path"] for s in sources}
        if (any("data_files" not in s for s in sources) or len(builders) != 1
                or not all(_same_formatting(attrs[0], a) for a in attrs[1:])
                or len({s["split"] for s in sources}) != 1):
            raise ConfigError(f"mix_strategy: got 'concat' for datasets {[a.dataset_name for a in attrs]}; "
                              "allowed: concat of local files of one type and one formatting (read as one "
                              "dataset); set mix_strategy: interleave_under or interleave_over (with "
                              "interleave_probs) to mix other datasets")
        if not order["shuffle"]:
            sources = lf_concat_order(sources, training_args.seed)
        files = [f for s in sources for f in s["data_files"]]
        return {**sources[0], "data_files": files, **order, **stream_keys}, {labels[0]: attrs[0]}
    if strategy not in _STRATEGIES:
        raise ConfigError(f"mix_strategy: got {strategy!r}; allowed: concat, {', '.join(_STRATEGIES)}")
    probs = data_args.interleave_probs or [1.0] * len(sources)
    mixture = [{**s, "label": label, "weight": float(p)} for s, label, p in zip(sources, labels, probs)]
    index_dir = stream_keys.pop("index_path", None)
    if index_dir is not None:
        # several datasets: index_path is a directory of one index per source, as `resumable-stream index
        # MIX.yaml -o DIR` writes it (a dataset index describes one dataset)
        for s in mixture:
            s["index_path"] = os.path.join(index_dir, f"{s['label']}.json")
    return ({"sources": mixture, "stopping": _STRATEGIES[strategy], **order, **stream_keys,
             "mixture_change": ours.get("mixture_change", "refuse")},
            dict(zip(labels, attrs)))


def train_stream(template, data_args, training_args, tokenizer, stage: str, ours: dict[str, Any], processor=None):
    """The :class:`~resumable_stream.integrations.transformers.TrainingStream` LLaMA-Factory's trainer reads;
    ``processor``: a multimodal model's (images of the rows checked by :mod:`.media`)."""
    from ..transformers.patch import TrainingStream, fit_to_steps  # torch: this module imports without it

    section, attrs = stream_section(data_args, training_args, ours)
    check_stage(attrs, stage)
    cfg = StreamConfig.from_dict(section, extra_keys=())
    stream = open_stream(cfg, rank=training_args.process_index, world_size=training_args.world_size,
                         num_workers=training_args.dataloader_num_workers,
                         index_from=training_args.resume_from_checkpoint, mixture_draws=mixture_draws(data_args))
    fit_to_steps(stream, training_args, LLAMAFACTORY_KEYS)
    fmt = Formatting(template=template, tokenizer=tokenizer, data_args=data_args, stage=stage, attrs=attrs,
                     processor=processor, media=media_settings(ours, data_args.media_dir))
    # collate_fn None: the trainer's own data collator (LLaMA-Factory builds it after the dataset)
    return TrainingStream(stream, None, functools.partial(LlamaFactoryProcessor, fmt),
                          resume_state_path=ours.get("resume_state_path"), monitor=monitor_settings(ours))


def get_dataset(original, ours: dict[str, Any], template, model_args, data_args, training_args, stage, tokenizer,
                processor=None):
    """LLaMA-Factory's ``get_dataset`` with the training dataset replaced by our stream; an ``eval_dataset``
    is LLaMA-Factory's own (``original``), which needs no resume."""
    val_size = check_val_size({"val_size": data_args.val_size})
    if processor is not None and (stage != "sft" or val_size):
        # LLaMA-Factory's dpo workflow asks for its "rm" data
        what = {"sft": f"val_size {val_size}", "pt": "stage pt"}.get(stage, "a preference stage (dpo, kto, rm)")
        raise ConfigError(f"model_name_or_path: {model_args.model_name_or_path!r} loads with a multimodal processor, "
                          f"with {what}; not supported by resumable-stream llamafactory: multimodal models train "
                          "with stage sft, without val_size (evaluate on eval_dataset)")
    module = {"train_dataset": train_stream(template, data_args, training_args, tokenizer, stage, ours, processor)}
    if val_size:                 # the first val_size rows: the evaluation set, never trained on (held_out.py)
        module["eval_dataset"] = hold_out(module["train_dataset"], val_size, template, tokenizer, data_args,
                                          training_args, stage)
    if data_args.eval_dataset:
        eval_args = copy.copy(data_args)
        eval_args.dataset = None
        module.update({k: v for k, v in original(template, model_args, eval_args, training_args, stage,
                                                   tokenizer=tokenizer, processor=processor).items()
                       if k == "eval_dataset"})
    return module
