"""The trainer yaml (model / data / train) is validated before anything loads."""

import copy
import glob
import os

import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, StreamConfig
from resumable_stream.config.trainer import TrainerConfig

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny", "train_lm.yaml")


def _doc():
    with open(TINY, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _write(tmp_path, doc):
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def test_tiny_config_parses_into_sections():
    cfg = TrainerConfig.from_yaml(TINY)
    assert cfg.model.config["model_type"] == "qwen3"
    assert os.path.isdir(cfg.model.tokenizer), "tokenizer dir resolved next to the yaml"
    assert cfg.stream.shuffle and cfg.stream.buffer_size == 256
    assert cfg.transform.packing and cfg.transform.max_seq_len == 64
    args = cfg.training_arguments()
    assert args.max_steps == 200 and args.ignore_data_skip is False and args.remove_unused_columns is False
    # peek / StreamConfig.from_yaml read the same file's data section (transform keys are tolerated)
    assert StreamConfig.from_yaml(TINY).data_files == cfg.stream.data_files


def _set(doc, dotted, value):
    section, key = dotted.split(".", 1)
    if value is _DELETE:
        doc[section].pop(key, None)
    else:
        doc[section][key] = value


_DELETE = object()


@pytest.mark.parametrize(
    ("dotted", "value", "needle"),
    [
        ("train.max_steps", _DELETE, "train.max_steps"),
        ("train.max_steps", 0, "train.max_steps: got 0"),
        ("train.max_steps", "100", "train.max_steps: got '100'"),
        ("train.output_dir", _DELETE, "train.output_dir: missing"),
        ("train.learning_rat", 0.1, "did you mean 'learning_rate'"),
        ("train.ignore_data_skip", True, "train.ignore_data_skip: got True"),
        ("train.per_device_train_batch_size", 0, "train.per_device_train_batch_size: got 0"),
        ("train.dataloader_num_workers", -1, "train.dataloader_num_workers: got -1"),
        ("data.max_samples", 1000, "data.max_samples: got 1000"),
        ("train.eval_strategy", "steps", "train.eval_strategy: got 'steps'"),
        ("train.eval_on_start", True, "train.eval_on_start: got True"),
        ("data.packin", True, "did you mean 'packing'"),
        ("data.max_seq_len", 0, "data.max_seq_len"),
        ("data.format", "chat", "data.format"),
        ("data.buffer_size", -5, "data.buffer_size: got -5"),
        ("model.tokeniser", "x", "did you mean 'tokenizer'"),
        ("model.dtype", "float8", "model.dtype: got 'float8'"),
        ("model.config", {"hidden_size": 3}, "model.config"),
        ("model.tokenizer", _DELETE, "model.tokenizer: missing"),
    ],
)
def test_bad_trainer_configs(tmp_path, dotted, value, needle):
    doc = copy.deepcopy(_doc())
    _set(doc, dotted, value)
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_yaml(_write(tmp_path, doc))
    assert needle in str(e.value)


def test_model_needs_weights_or_config(tmp_path):
    doc = _doc()
    doc["model"] = {"tokenizer": "tokenizer"}
    with pytest.raises(ConfigError, match="model.name_or_path .* or model.config"):
        TrainerConfig.from_yaml(_write(tmp_path, doc))


def test_unknown_section_and_missing_section(tmp_path):
    doc = _doc()
    doc["trian"] = {}
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        TrainerConfig.from_yaml(_write(tmp_path, doc))
    doc = _doc()
    del doc["train"]
    with pytest.raises(ConfigError, match="train: missing"):
        TrainerConfig.from_yaml(_write(tmp_path, doc))


def test_training_arguments_errors_name_the_section(tmp_path):
    doc = _doc()
    doc["train"]["lr_scheduler_type"] = "sideways"       # a value of an enum field: refused with the yaml
    with pytest.raises(ConfigError, match=r"train.lr_scheduler_type: got 'sideways'; allowed: linear, cosine, "):
        TrainerConfig.from_yaml(_write(tmp_path, doc))
    doc["train"]["lr_scheduler_type"] = "linear"
    doc["train"]["load_best_model_at_end"] = True         # refused by TrainingArguments itself
    cfg = TrainerConfig.from_yaml(_write(tmp_path, doc))
    with pytest.raises(ConfigError, match="train: TrainingArguments rejected .*load_best_model_at_end"):
        cfg.training_arguments()


def test_float_train_values_written_as_strings(tmp_path):
    doc = _doc()
    doc["train"]["learning_rate"] = "3e-4"          # yaml 1.1 reads this as a string
    cfg = TrainerConfig.from_yaml(_write(tmp_path, doc))
    assert cfg.train["learning_rate"] == pytest.approx(3e-4)
    doc["train"]["learning_rate"] = "abc"
    with pytest.raises(ConfigError, match="train.learning_rate: got 'abc'; allowed: a number"):
        TrainerConfig.from_yaml(_write(tmp_path, doc))


def test_dispatch_batches_false_is_what_the_stream_does_and_accepted(tmp_path):
    """LLaMA-Factory users set dispatch_batches: false for streaming on several ranks: every rank reading its
    own batches is what the StreamLoader does anyway."""
    doc = _doc()
    doc["train"]["accelerator_config"] = {"dispatch_batches": False}
    args = TrainerConfig.from_yaml(_write(tmp_path, doc)).training_arguments()
    assert args.accelerator_config.dispatch_batches is False


@pytest.mark.parametrize(("key", "value"), [
    ("accelerator_config.split_batches", True), ("accelerator_config.dispatch_batches", True),
    ("accelerator_config.even_batches", False),
    ("accelerator_config.use_seedable_sampler", False), ("accelerator_config.non_blocking", True),
    ("data_seed", 7), ("dataloader_drop_last", True), ("dataloader_persistent_workers", True),
    ("train_sampling_strategy", "sequential"),
])
def test_data_loading_arguments_the_stream_replaces_are_refused(tmp_path, key, value):
    """The Trainer's own data loading is replaced by the StreamLoader: these settings would be ignored."""
    doc = _doc()
    owner, _, name = key.rpartition(".")
    (doc["train"].setdefault(owner, {}) if owner else doc["train"])[name] = value
    cfg = TrainerConfig.from_yaml(_write(tmp_path, doc))
    with pytest.raises(ConfigError, match=rf"train\.{key}: got {value!r}; not supported with a resumable stream"):
        cfg.training_arguments()
    if owner:   # the same keys at their defaults are fine
        doc["train"]["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        assert TrainerConfig.from_yaml(_write(tmp_path, doc)).training_arguments().accelerator_config


# ------------------------------------------------------------------------------ per-run paths follow output_dir
EXAMPLE_YAMLS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))


def _strings(value, where=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


@pytest.mark.parametrize("path", EXAMPLE_YAMLS, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_example_yaml_writes_a_run_file_outside_its_output_dir(path):
    """A path under the yaml's output_dir written out (``consumed_log: runs/tiny_lm/consumed``) stays where it
    is when a user overrides only ``train.output_dir``: two runs would append to one log."""
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    out = (doc.get("train") or {}).get("output_dir") or doc.get("output_dir")
    if not out:
        return   # not a training yaml (examples/tiny/stream.yaml)
    fixed = [(key, v) for key, v in _strings(doc) if v != out and os.path.normpath(v).startswith(out.rstrip("/") + "/")]
    assert not fixed, f"{path}: {fixed} hard-code(s) {out!r}; use data.consumed_log: true (output_dir/consumed)"


def test_consumed_log_true_is_the_runs_own_output_dir(tmp_path):
    runs = {name: TrainerConfig.from_yaml(TINY, [f"train.output_dir={tmp_path / name}"]) for name in ("a", "b")}
    assert {n: c.transform.consumed_log for n, c in runs.items()} == \
        {n: os.path.join(str(tmp_path / n), "consumed") for n in runs}, "examples/tiny/train_lm.yaml has consumed_log: true"
    explicit = TrainerConfig.from_yaml(TINY, [f"train.output_dir={tmp_path / 'a'}", "data.consumed_log=logs/mine"])
    assert explicit.transform.consumed_log == "logs/mine"          # a directory of the user's: as written
    off = TrainerConfig.from_yaml(TINY, [f"train.output_dir={tmp_path / 'a'}", "data.consumed_log=false"])
    assert off.transform.consumed_log is None


def test_llamafactory_consumed_log_true_is_output_dir_consumed(tmp_path):
    from types import SimpleNamespace

    from resumable_stream.integrations.llamafactory.callbacks import ConsumedLog
    from resumable_stream.integrations.llamafactory.settings import split

    assert split({"output_dir": "x", "resumable_stream": {"consumed_log": True}})[1] == {"consumed_log": True}
    with pytest.raises(ConfigError, match=r"resumable_stream.consumed_log: got 3; allowed: null or false"):
        split({"resumable_stream": {"consumed_log": 3}})
    paths = []
    for name in ("a", "b"):
        log = ConsumedLog(None)
        args = SimpleNamespace(output_dir=str(tmp_path / name), process_index=0)
        log.on_train_begin(args, SimpleNamespace(global_step=0), None, train_dataloader=SimpleNamespace())
        log.on_train_end(args, None, None)
        paths.append(log.path)
    assert paths == [str(tmp_path / n / "consumed" / "rank-00000.jsonl") for n in ("a", "b")]
    assert all(os.path.isfile(p) for p in paths)


@pytest.mark.parametrize("value", ["1", "true", "Y"])
def test_llamafactory_on_ray_is_refused_naming_use_ray(value):
    """LLaMA-Factory's Ray workers (USE_RAY=1) train through its own get_dataset: our stream would not be read."""
    from resumable_stream.integrations.llamafactory.settings import refuse_unsupported

    args = {"stage": "sft", "do_train": True, "max_steps": 10}
    with pytest.raises(ConfigError, match=rf"USE_RAY: got '{value}'.*FORCE_TORCHRUN"):
        refuse_unsupported(args, {"USE_RAY": value})
    refuse_unsupported(args, {"USE_RAY": "0"})     # off: accepted
    refuse_unsupported(args, {})
