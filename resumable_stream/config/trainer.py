"""The trainer yaml: ``model:``, ``data:`` and ``train:`` sections, validated before anything loads."""

from __future__ import annotations

import dataclasses
import enum
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnknownKeyError, shown
from ..observe.monitoring import MONITOR_KEYS, MonitorSettings
from . import overrides as override
from .model_config import check_local_paths, check_model_config
from .stream_config import MixtureConfig, StreamConfig
from .transforms import TransformConfig

SECTIONS = ("model", "data", "train")
MODEL_KEYS = ("name_or_path", "config", "tokenizer", "processor", "dtype", "trust_remote_code")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# TrainingArguments we set ourselves; a user value would break exact resume.
# ignore_data_skip: nothing is replayed either way (the patched Trainer's skip is a no-op); True would only make
# the Trainer forget the steps already trained in its epoch count
_FORCED = {"ignore_data_skip": False, "remove_unused_columns": False}
_DEFAULTS = {"report_to": "none", "save_strategy": "steps", "logging_steps": 10, "save_steps": 100}


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str | None = None
    config: dict | None = None
    tokenizer: str | None = None
    processor: str | None = None     # data.format vl: the AutoProcessor (default: name_or_path)
    dtype: str = "float32"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.name_or_path is None and self.config is None:
            raise ConfigError("model: set model.name_or_path (pretrained weights) or model.config (random init "
                              "from an inline config with model_type)")
        if self.name_or_path is not None and not (isinstance(self.name_or_path, str) and self.name_or_path):
            raise ConfigError(f"model.name_or_path: got {shown(self.name_or_path)}; allowed: a hub id or a local path")
        if self.config is not None:
            if not isinstance(self.config, dict) or not isinstance(self.config.get("model_type"), str):
                raise ConfigError(f"model.config: got {shown(self.config)}; allowed: a mapping with model_type "
                                  "(e.g. qwen3) and the config fields")
        for key in ("tokenizer", "processor"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and value):
                raise ConfigError(f"model.{key}: got {shown(value)}; allowed: a hub id or a local directory")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype: got {shown(self.dtype)}; allowed: {', '.join(DTYPES)}")
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError(f"model.trust_remote_code: got {shown(self.trust_remote_code)}; allowed: true or false")


@dataclass(frozen=True)
class TrainerConfig:
    model: ModelConfig
    stream: StreamConfig | MixtureConfig
    transform: TransformConfig
    train: dict[str, Any]
    path: str | None = None
    eval_stream: StreamConfig | MixtureConfig | None = None   # data.eval: the validation stream
    eval_samples: int = 0                                      # data.eval.num_samples
    monitor: MonitorSettings = MonitorSettings()               # data.metrics_port, data.data_bound_*

    @classmethod
    def from_yaml(cls, path: str, overrides: Sequence[str] = ()) -> TrainerConfig:
        """``overrides``: ``key=value`` texts merged into the yaml first (:mod:`resumable_stream.config.overrides`)."""
        doc, base_dir, given = override.read(path, overrides, _TRAINER_YAML)
        with override.named(given):
            _check_sections(doc, path, required=("model", "data", "train"))
            return cls.from_dict(doc, base_dir=base_dir, path=path)

    @classmethod
    def from_dict(cls, doc: dict, base_dir: str | None = None, path: str | None = None) -> TrainerConfig:
        data = _DataSection.from_dict(doc["data"], base_dir, path)
        model = _model_section(doc["model"], base_dir, data.transform)
        train = dict(doc["train"])
        _check_train(train, has_eval=data.eval_stream is not None)
        transform = data.transform.replace(consumed_log=consumed_log_dir(data.transform.consumed_log,
                                                                         train["output_dir"]))
        return cls(model, data.stream, transform, train, path, data.eval_stream, data.eval_samples, data.monitor)

    def training_arguments(self, **overrides: Any):
        """TrainingArguments from ``train:``, with our forced values; TrainingArguments' own errors become
        ConfigErrors naming the train section."""
        from transformers import TrainingArguments

        values = {**_DEFAULTS, **self.train, **overrides, **_FORCED}
        try:
            args = TrainingArguments(**values)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"train: TrainingArguments rejected the values ({e})") from None
        check_data_arguments(args)
        return args


_TRAINER_YAML = "a mapping with model, data and train sections"


def _check_sections(doc: dict, path: str, required: Sequence[str]) -> None:
    for key in doc:
        if key not in SECTIONS:
            raise UnknownKeyError("config", str(key), list(SECTIONS))
    for key in SECTIONS:
        if (key in required or key in doc) and not isinstance(doc.get(key), dict):
            raise ConfigError(f"{key}: missing or not a mapping in {shown(path)}")


@dataclass(frozen=True)
class _DataSection:
    """The ``data:`` section, every key checked: the stream's, the transform's, the monitoring's, data.eval."""
    stream: StreamConfig | MixtureConfig
    transform: TransformConfig
    monitor: MonitorSettings
    eval_stream: StreamConfig | MixtureConfig | None
    eval_samples: int

    @classmethod
    def from_dict(cls, section: Any, base_dir: str | None, path: str | None) -> _DataSection:
        data = dict(section)
        if data.get("max_samples") is not None:
            raise ConfigError(f"data.max_samples: got {shown(data['max_samples'])}; not supported: the stream is endless "
                              "and its length unknown in advance; bound training with train.max_steps")
        data.pop("max_samples", None)
        monitor = MonitorSettings.from_data(data)
        for key in MONITOR_KEYS:      # the training's, not the stream's (nor the validation stream's)
            data.pop(key, None)
        eval_doc = data.pop("eval", None)
        transform = TransformConfig.from_dict(data)
        if transform.image_dir and base_dir and not os.path.isabs(transform.image_dir) \
                and os.path.isdir(os.path.join(base_dir, transform.image_dir)):
            transform = transform.replace(image_dir=os.path.normpath(os.path.join(base_dir, transform.image_dir)))
        stream = StreamConfig.from_dict(data, base_dir=base_dir, source_file=path,
                                       extra_keys=(*TransformConfig.KEYS, "eval", *MONITOR_KEYS))   # for the hint
        if monitor.log_source_loss and not isinstance(stream, MixtureConfig):
            raise ConfigError("data.log_source_loss: got true without data.sources; allowed: true only for a "
                              "mixture (the loss of each of its sources), else false")
        eval_stream, eval_samples = _eval_section(eval_doc, data, base_dir, path)
        return cls(stream, transform, monitor, eval_stream, eval_samples)


def _model_section(section: dict, base_dir: str | None, transform: TransformConfig) -> ModelConfig:
    model_doc = dict(section)
    for key in model_doc:
        if key not in MODEL_KEYS:
            raise UnknownKeyError("model", str(key), list(MODEL_KEYS))
    for key in ("name_or_path", "tokenizer", "processor"):   # local dirs next to the yaml
        v = model_doc.get(key)
        if base_dir and isinstance(v, str) and not os.path.isabs(v) and os.path.isdir(os.path.join(base_dir, v)):
            model_doc[key] = os.path.normpath(os.path.join(base_dir, v))
    check_local_paths(model_doc)
    for key in ("name_or_path", "tokenizer", "processor"):   # transformers does not expand ~
        if isinstance(model_doc.get(key), str) and model_doc[key].startswith("~"):
            model_doc[key] = os.path.expanduser(model_doc[key])
    model = ModelConfig(**model_doc)
    _check_model_for_format(model, transform)
    if model.config is not None:
        check_model_config(model.config, vl=transform.format == "vl")
    return model


def data_config_from_yaml(path: str, overrides: Sequence[str] = ()) -> StreamConfig | MixtureConfig:
    """The data of ``peek``, ``index`` and ``warmup``, every key of the yaml checked as ``train`` checks it (the same
    errors), though they read only the data. Overrides are data keys only."""
    doc, base_dir, given = override.read(path, overrides, "a mapping with a data: section (and model: and train:), "
                                         "or of data keys", data_only=True)
    with override.named(given):
        if not set(SECTIONS) & set(doc):
            return _DataSection.from_dict(doc, base_dir, path).stream
        if "data" not in doc:
            raise ConfigError(f"config file {shown(path)}: a trainer yaml (it has "
                              f"{', '.join(sorted({'model', 'train'} & set(doc)))}) without a data: section; add one "
                              "with at least dataset_name_or_path")
        _check_sections(doc, path, required=("data",))
        data = _DataSection.from_dict(doc["data"], base_dir, path)
        if "model" in doc:
            _model_section(doc["model"], base_dir, data.transform)
        if "train" in doc:
            _check_train(dict(doc["train"]), has_eval=data.eval_stream is not None)
        return data.stream


def data_sections_from_yaml(path: str, overrides: Sequence[str] = ()) -> tuple[StreamConfig | MixtureConfig,
                                                                             StreamConfig | MixtureConfig | None,
                                                                             dict[str, Any]]:
    """(stream, validation stream, train: section as written) of a trainer yaml, the data checked as
    :meth:`TrainerConfig.from_yaml` checks it, but not model: / train: (those checks import transformers)."""
    doc, base_dir, given = override.read(path, overrides, _TRAINER_YAML)
    with override.named(given):
        _check_sections(doc, path, required=("model", "data", "train"))
        data = _DataSection.from_dict(doc["data"], base_dir, path)
    return data.stream, data.eval_stream, dict(doc["train"])


def _check_model_for_format(model: ModelConfig, transform: TransformConfig) -> None:
    """With model.config (random init) the tokenizer, or for data.format vl the processor, must be named."""
    if transform.format == "vl":
        if not (model.processor or model.name_or_path):
            raise ConfigError("model.processor: missing; data.format 'vl' with model.config (random init) needs the "
                              "processor (a hub id or a local directory with the tokenizer and image processor)")
    elif model.tokenizer is None and model.name_or_path is None:
        raise ConfigError("model.tokenizer: missing; with model.config (random init) name the tokenizer (a hub id "
                          "or a local directory)")


# data keys a validation stream does not take from the training one
_NOT_INHERITED = ("sources", "stopping", "mixture_change", "resume_state_path", "elastic", "num_partitions")


def _eval_section(doc: Any, data: dict, base_dir: str | None, path: str | None):
    """``data.eval``: the validation stream's data keys over the training stream's (the transform is the
    same), plus ``num_samples``: examples per evaluation over all ranks."""
    if doc is None:
        return None, 0
    if not isinstance(doc, dict):
        raise ConfigError(f"data.eval: got {shown(doc)}; allowed: a mapping of data keys for the validation stream "
                          "(e.g. data_files) with num_samples")
    n = doc.get("num_samples")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"data.eval.num_samples: got {shown(n)}; allowed: an integer > 0 (training examples per "
                          "evaluation, over all ranks)")
    for key in doc:
        if key in TransformConfig.KEYS:
            raise ConfigError(f"data.eval.{key}: the validation data is transformed like the training data; "
                              f"set {key} in data:")
    section = {k: v for k, v in data.items() if k not in TransformConfig.KEYS and k not in _NOT_INHERITED}
    section.update((k, v) for k, v in doc.items() if k != "num_samples")
    try:
        stream = StreamConfig.from_dict(section, base_dir=base_dir, source_file=path)
    except UnknownKeyError as e:   # named where it was written, so that an override's typo is found
        raise UnknownKeyError("data.eval", e.key, [*StreamConfig.keys(), "num_samples"]) from None
    except ConfigError as e:
        raise ConfigError(f"data.eval: {e}") from None
    return stream, n


def consumed_log_dir(value: str | bool | None, output_dir: str) -> str | None:
    """``data.consumed_log``: true is the run's own ``output_dir/consumed`` (so that a run given another
    output_dir never appends to another run's log); a path is taken as written; null / false: off."""
    if value is True:
        return os.path.join(output_dir, "consumed")
    return value or None


def _check_train(train: dict[str, Any], has_eval: bool = False) -> None:
    from transformers import TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    known = list(fields)
    for key in train:
        if key not in known:
            raise UnknownKeyError("train", str(key), known)
    for key, value in list(train.items()):
        default = fields[key].default
        if isinstance(default, float) and not isinstance(value, bool):
            if isinstance(value, str):
                try:    # yaml reads 3e-4 (no dot) as a string
                    train[key] = float(value)
                except ValueError:
                    raise ConfigError(f"train.{key}: got {shown(value)}; allowed: a number") from None
            elif not isinstance(value, (int, float)):
                raise ConfigError(f"train.{key}: got {shown(value)}; allowed: a number")
        choices = _enum_values(fields[key])
        if choices and isinstance(value, str) and value not in choices:   # what TrainingArguments would refuse
            raise ConfigError(f"train.{key}: got {shown(value)}; allowed: {', '.join(choices)}")
    for key, forced in _FORCED.items():
        if key in train and train[key] != forced:
            raise ConfigError(f"train.{key}: got {shown(train[key])}; allowed: {shown(forced)} (resumable-stream restores the "
                              "data position from its sidecars instead of replaying batches)")
    if "output_dir" not in train or not isinstance(train["output_dir"], str) or not train["output_dir"]:
        raise ConfigError("train.output_dir: missing; checkpoints and logs go there (and a restart resumes from it)")
    steps = train.get("max_steps")
    if steps is None or isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ConfigError(f"train.max_steps: got {shown(steps)}; allowed: an integer > 0. A streaming dataset has no "
                          "known length, so training length must be set in steps")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "save_steps", "logging_steps"):
        v = train.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"train.{key}: got {shown(v)}; allowed: an integer > 0")
    strategy = train.get("eval_strategy", "no")
    if strategy not in ("no", "steps"):
        raise ConfigError(f"train.eval_strategy: got {shown(strategy)}; allowed: no, steps (a stream has no epochs)")
    asked = [k for k in ("eval_strategy", "eval_on_start", "do_eval") if train.get(k) not in (None, False, "no")]
    if asked and not has_eval:
        raise ConfigError(f"train.{asked[0]}: got {shown(train[asked[0]])} but there is no validation data: add a "
                          "data.eval section (data keys of the validation stream, with num_samples) or leave "
                          "eval_strategy at 'no'")
    if has_eval and strategy == "no" and not train.get("eval_on_start"):
        raise ConfigError("data.eval: set train.eval_strategy: steps (and eval_steps) to evaluate on it; without "
                          "it the validation data would never be read")
    workers = train.get("dataloader_num_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ConfigError(f"train.dataloader_num_workers: got {shown(workers)}; allowed: an integer >= 0")



def _enum_values(field: dataclasses.Field) -> list[str]:
    """The values of a TrainingArguments field typed with an enum (lr_scheduler_type, optim, *_strategy)."""
    for t in typing.get_args(field.type) or (field.type,):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [str(m.value) for m in t]
    return []

# Settings of the Trainer's own data loading. Our StreamLoader replaces that loading (it is never
# passed to accelerate's prepare()), so these would have no effect; the ones of accelerator_config
# would otherwise change which rank reads what (dispatch_batches: rank 0 reads every batch and sends
# slices; split_batches: a batch is cut across the ranks; even_batches / use_seedable_sampler: samplers).
_NO_EFFECT = {
    "accelerator_config.split_batches": (False, "the stream deals whole batches to every rank"),
    "accelerator_config.dispatch_batches": ((None, False), "every rank reads its own partitions; nothing is "
                                                           "dispatched from rank 0"),
    "accelerator_config.even_batches": (True, "the ranks' partitions are balanced by the plan, not by "
                                              "repeating samples"),
    "accelerator_config.use_seedable_sampler": (True, "there is no sampler; the order comes from "
                                                      "data.shuffle_seed"),
    "accelerator_config.non_blocking": (False, "batches are not moved by accelerate's data loader"),
    "data_seed": (None, "the order comes from data.shuffle_seed"),
    "dataloader_drop_last": (False, "the stream is endless; training length is max_steps"),
    "dataloader_persistent_workers": (False, "the StreamLoader manages its workers"),
    "train_sampling_strategy": ("random", "there is no sampler; set data.shuffle"),
}


def check_data_arguments(args, section: str = "train") -> None:
    """Refuse TrainingArguments that the Trainer's data loading would use but ours does not."""
    for key, (default, why) in _NO_EFFECT.items():
        owner, _, name = key.rpartition(".")
        holder = getattr(args, owner) if owner else args
        if holder is None or not hasattr(holder, name):   # fields of other transformers versions
            continue
        value = getattr(holder, name)
        allowed = default if isinstance(default, tuple) else (default,)
        if value not in allowed:
            raise ConfigError(f"{section}.{key}: got {shown(value)}; not supported with a resumable stream ({why}); "
                              f"leave it at {shown(allowed[0])}")
