"""The ``data:`` section: validation, yaml loading, path resolution, split checks, defaults."""

from __future__ import annotations

import os

import pytest
import yaml
from helpers import parquet_config

import resumable_stream
from resumable_stream import ConfigError, ResumableStream, StreamConfig
from resumable_stream.sources import open_source
from resumable_stream.sources.map_style import MapStyleSource
from resumable_stream.sources.parquet import ParquetSource
from resumable_stream.testing import write_parquet_dataset

_MISSING = object()
BASE = {"dataset_name_or_path": "parquet", "data_files": "data/*.parquet"}


def _case(key, value, allowed, *, value_text=None, extra=None, id=None):
    """One bad config: ``key`` set to ``value`` (``_MISSING``: removed) on top of BASE and ``extra``."""
    data = dict(BASE, **(extra or {}))
    if value is _MISSING:
        data.pop(key, None)
    else:
        data[key] = value
    text = value_text if value_text is not None else repr(value)
    return pytest.param(data, key, text, allowed, id=id or f"{key}={text}")


BAD_CONFIGS = [
    # backend
    _case("backend", "pytorch", "hf, local"),
    _case("backend", "HF", "hf, local"),
    _case("backend", None, "hf, local"),
    # streaming
    _case("streaming", "true", "true or false"),
    _case("streaming", 1, "true or false"),
    _case("streaming", True, "backend 'hf'", value_text="'local'", extra={"backend": "local"},
          id="streaming=true+backend=local"),
    # dataset_name_or_path
    _case("dataset_name_or_path", "", "non-empty string"),
    _case("dataset_name_or_path", "   ", "non-empty string"),
    _case("dataset_name_or_path", 123, "non-empty string"),
    _case("dataset_name_or_path", None, "non-empty string"),
    _case("dataset_name_or_path", ["parquet"], "non-empty string"),
    _case("dataset_name_or_path", _MISSING, "required", value_text="missing"),
    # name
    _case("name", "", "subset"),
    _case("name", 5, "subset"),
    # data_files
    _case("data_files", "", "glob"),
    _case("data_files", [], "glob"),
    _case("data_files", 42, "glob"),
    _case("data_files", ["a.parquet", 3], "glob"),
    _case("data_files", ["a.parquet", ""], "glob"),
    _case("data_files", {}, "mapping split -> paths"),
    _case("data_files", {"train": 5}, "mapping split -> paths"),
    _case("data_files", {"train": ""}, "mapping split -> paths"),
    _case("data_files", {"train": []}, "mapping split -> paths"),
    _case("data_files", {"train": ["a.parquet", None]}, "mapping split -> paths"),
    _case("data_files", {1: "a.parquet"}, "mapping split -> paths"),
    _case("data_files", "x.parquet", "backend 'hf'", extra={"backend": "local", "streaming": False},
          id="data_files+backend=local"),
    # a builder name without data_files would read the working directory
    *[_case("data_files", _MISSING, f"the {b} builder reads the files data_files names",
            extra={"dataset_name_or_path": b}, value_text="missing", id=f"data_files missing for {b}")
      for b in ("parquet", "json", "csv", "text", "arrow")],
    # split
    _case("split", "", "split name"),
    _case("split", "  ", "split name"),
    _case("split", None, "split name"),
    _case("split", ["train"], "split name"),
    # shuffle
    _case("shuffle", "yes", "true or false"),
    _case("shuffle", 1, "true or false"),
    _case("shuffle", None, "true or false"),
    # shuffle_seed
    _case("shuffle_seed", True, "[0, 2**63)"),
    _case("shuffle_seed", "42", "[0, 2**63)"),
    _case("shuffle_seed", -1, "[0, 2**63)"),
    _case("shuffle_seed", 2**63, "[0, 2**63)"),
    _case("shuffle_seed", 42.0, "[0, 2**63)"),
    _case("shuffle_seed", None, "[0, 2**63)"),
    # buffer_size
    _case("buffer_size", 0, "1 to 10000000"),
    _case("buffer_size", -5, "1 to 10000000"),
    _case("buffer_size", "1024", "1 to 10000000"),
    _case("buffer_size", True, "1 to 10000000"),
    _case("buffer_size", 16384.0, "1 to 10000000"),
    _case("buffer_size", 10_000_001, "1 to 10000000"),
    # interleave_shards
    _case("interleave_shards", 0, "1 to 64"),
    _case("interleave_shards", 65, "1 to 64"),
    _case("interleave_shards", False, "1 to 64"),
    # block_rows
    _case("block_rows", 0, "1 to 1000000"),
    _case("block_rows", "1024", "1 to 1000000"),
    _case("block_rows", 1_000_001, "1 to 1000000"),
    # resume_state_path
    _case("resume_state_path", "", "sidecar"),
    _case("resume_state_path", 7, "sidecar"),
    _case("resume_state_path", ["ckpt"], "sidecar"),
    # cache_dir / network settings
    _case("cache_dir", "", "null (off) or a directory"),
    _case("cache_dir", 5, "null (off) or a directory"),
    _case("retries", -1, "0 to 100"),
    _case("retries", 1.5, "0 to 100"),
    _case("retry_backoff_s", -0.1, "0 to 600"),
    _case("timeout_s", 0, "> 0"),
    _case("timeout_s", float("nan"), "> 0"),
    # cache_size_limit_gb
    _case("cache_size_limit_gb", 0, "> 0"),
    _case("cache_size_limit_gb", -1.5, "> 0"),
    _case("cache_size_limit_gb", True, "> 0"),
    _case("cache_size_limit_gb", "50", "> 0"),
    _case("cache_size_limit_gb", None, "> 0"),
    _case("cache_size_limit_gb", float("nan"), "> 0"),
    # num_partitions / elastic
    _case("num_partitions", 0, "at least ranks x workers"),
    _case("num_partitions", -3, "an integer from 1 to 1000000"),
    _case("num_partitions", 6.0, "an integer from 1 to 1000000"),
    _case("num_partitions", "6", "an integer from 1 to 1000000"),
    _case("num_partitions", True, "an integer from 1 to 1000000"),
    _case("elastic", "yes", "true or false"),
    _case("elastic", None, "true or false"),
    _case("elastic", 1, "true or false"),
]


@pytest.mark.parametrize("data, key, value_text, allowed", BAD_CONFIGS)
def test_bad_config_raises_config_error_naming_key_value_and_allowed(data, key, value_text, allowed):
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_dict(data)
    assert type(info.value) is resumable_stream.ConfigError
    msg = str(info.value)
    assert f"data.{key}" in msg
    assert value_text in msg
    assert allowed in msg


def test_bad_configs_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 25


@pytest.mark.parametrize("data, key, value_text, allowed", BAD_CONFIGS[:12] + BAD_CONFIGS[-12:])
def test_bad_config_from_yaml_gives_the_same_error(tmp_path, data, key, value_text, allowed):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "tiny"}, "data": data, "train": {"max_steps": 3}}))
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(path)
    msg = str(info.value)
    assert f"data.{key}" in msg and value_text in msg and allowed in msg


def test_keyword_construction_validates_too():
    with pytest.raises(ConfigError, match=r"data\.buffer_size: got 0"):
        StreamConfig(dataset_name_or_path="parquet", data_files="data/*.parquet", buffer_size=0)
    with pytest.raises(ConfigError, match=r"data\.shuffle_seed: got True"):
        StreamConfig(dataset_name_or_path="parquet", data_files="data/*.parquet", shuffle_seed=True)


def test_replace_revalidates():
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files="data/*.parquet")
    with pytest.raises(ConfigError, match=r"data\.buffer_size: got -1"):
        cfg.replace(buffer_size=-1)
    assert cfg.replace(buffer_size=7).buffer_size == 7


@pytest.mark.parametrize("typo, suggestion", [
    ("shufle", "shuffle"),
    ("buffersize", "buffer_size"),
    ("shuffle_sed", "shuffle_seed"),
    ("data_file", "data_files"),
    ("dataset_name", "dataset_name_or_path"),
    ("interleave_shard", "interleave_shards"),
])
def test_unknown_key_suggests_closest(typo, suggestion):
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_dict(dict(BASE, **{typo: 1}))
    msg = str(info.value)
    assert f"data.{typo}" in msg
    assert "unknown key" in msg
    assert f"did you mean {suggestion!r}" in msg
    # and says what is allowed
    for key in StreamConfig.keys():
        assert key in msg


def test_unknown_key_without_close_match_lists_allowed_keys():
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_dict(dict(BASE, zzzzzz=1))
    msg = str(info.value)
    assert "data.zzzzzz" in msg and "did you mean" not in msg and "shuffle_seed" in msg


def test_source_file_is_not_a_user_key():
    with pytest.raises(ConfigError, match=r"data\.source_file: unknown key"):
        StreamConfig.from_dict(dict(BASE, source_file="x.yaml"))


@pytest.mark.parametrize("data", [None, [], ["parquet"], "parquet", 3])
def test_from_dict_needs_a_mapping(data):
    with pytest.raises(ConfigError, match=r"^data: got .*allowed: a mapping"):
        StreamConfig.from_dict(data)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, resumable_stream.ResumableStreamError)


# ---------------------------------------------------------------------------- defaults
def test_defaults():
    cfg = StreamConfig(dataset_name_or_path="org/name")
    assert cfg.backend == "hf"
    assert cfg.shuffle is False
    assert cfg.shuffle_seed == 42
    assert cfg.buffer_size == 16384
    assert cfg.streaming is True
    assert cfg.split == "train"
    assert cfg.data_files is None and cfg.name is None
    assert cfg.cache_dir is None and cfg.resume_state_path is None
    assert StreamConfig.from_dict({"dataset_name_or_path": "org/name"}) == cfg


def test_streaming_default_depends_on_backend():
    assert StreamConfig(dataset_name_or_path="d", backend="local").streaming is False
    assert StreamConfig(dataset_name_or_path="d", backend="hf").streaming is True
    assert StreamConfig(dataset_name_or_path="d", backend="hf", streaming=False).streaming is False


def test_defaults_from_minimal_yaml(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text("dataset_name_or_path: org/name\n")
    cfg = StreamConfig.from_yaml(path)
    assert (cfg.shuffle, cfg.shuffle_seed, cfg.buffer_size, cfg.streaming) == (False, 42, 16384, True)
    assert cfg.source_file == str(path)


def test_to_dict_round_trips():
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=["a.parquet"], shuffle=True, shuffle_seed=7,
                       buffer_size=100)
    d = cfg.to_dict()
    assert set(d) == set(StreamConfig.keys())
    assert StreamConfig.from_dict(d) == cfg


# ---------------------------------------------------------------------------- from_yaml
FULL_DATA = {
    "backend": "hf", "streaming": True, "dataset_name_or_path": "parquet", "name": None, "data_files": ["/abs/x/*.parquet"],
    "revision": None, "data_dir": None,
    "split": "train", "shuffle": True, "shuffle_seed": 1234, "buffer_size": 256, "interleave_shards": 2,
    "block_rows": 64, "resume_state_path": None, "cache_dir": None, "cache_size_limit_gb": 1.5,
    "retries": 2, "retry_backoff_s": 0.5, "timeout_s": 30.0, "retry_budget_s": 90.0, "max_requests_per_s": "hub-team",
    "rate_limit_wait_s": 120.0, "num_partitions": 12, "elastic": True,
    "elastic_determinism": False, "index_path": "/abs/x/index.json", "verify_files": False, "prefetch_blocks": 3, "prefetch_memory_mb": 64,
    "max_member_bytes": 1 << 20,
    "growth": "append", "growth_allow_removal": True, "poll_interval_s": 2.5, "follow_timeout_s": 60,
    "storage_options": {"endpoint_url": "http://127.0.0.1:9000", "client_kwargs": {"region_name": "eu-west-1"}},
}


@pytest.mark.parametrize("value", [["endpoint_url"], "endpoint_url=x", {"": 1}, {1: "x"}])
def test_bad_storage_options_name_the_key(value):
    with pytest.raises(ConfigError, match=r"data\.storage_options: got .*allowed: null or a mapping"):
        StreamConfig(dataset_name_or_path="parquet", data_files="s3://b/*.parquet", storage_options=value)


def test_storage_options_flat_or_keyed_by_protocol_join_ours():
    from resumable_stream.io.net import with_user_options

    ours = {"http": {"client_kwargs": {"timeout": 5}}}
    flat = with_user_options(ours, {"endpoint_url": "http://e", "client_kwargs": {"region_name": "r"}}, ["s3"])
    assert flat == {"http": {"client_kwargs": {"timeout": 5}},
                    "s3": {"endpoint_url": "http://e", "client_kwargs": {"region_name": "r"}}}
    keyed = with_user_options(ours, {"http": {"client_kwargs": {"trust_env": True}}, "s3": {"anon": True}}, ["s3"])
    assert keyed == {"http": {"client_kwargs": {"timeout": 5, "trust_env": True}}, "s3": {"anon": True}}
    assert ours == {"http": {"client_kwargs": {"timeout": 5}}}        # not modified


def test_from_yaml_whole_trainer_yaml_uses_only_data(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"model_name_or_path": "tiny", "shuffle": "not a data key"},
        "data": FULL_DATA,
        "train": {"max_steps": 10, "output_dir": "out", "buffer_size": -1},
    }))
    cfg = StreamConfig.from_yaml(path)
    assert cfg.to_dict() == FULL_DATA


def test_from_yaml_data_section_only(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text(yaml.safe_dump(FULL_DATA))
    cfg = StreamConfig.from_yaml(str(path))
    assert cfg.to_dict() == FULL_DATA
    # the same keys in a whole trainer yaml give an equal config
    whole = tmp_path / "whole.yaml"
    whole.write_text(yaml.safe_dump({"model": {}, "data": FULL_DATA, "train": {}}))
    assert StreamConfig.from_yaml(whole) == cfg


def test_from_yaml_missing_file_names_it(tmp_path):
    path = tmp_path / "nope" / "train.yaml"
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(path)
    msg = str(info.value)
    assert str(path) in msg and "not found" in msg


def test_from_yaml_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("data:\n  shuffle: [true\n  split: train\n")
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(path)
    assert str(path) in str(info.value) and "yaml" in str(info.value)


@pytest.mark.parametrize("text, kind", [
    ("- dataset_name_or_path: parquet\n- split: train\n", "list"),
    ("just a string\n", "str"),
    ("", "NoneType"),
])
def test_from_yaml_top_level_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(path)
    msg = str(info.value)
    assert str(path) in msg and "mapping" in msg and kind in msg


@pytest.mark.parametrize("section", ["null", "[a, b]", "parquet"])
def test_from_yaml_data_section_not_a_mapping(tmp_path, section):
    path = tmp_path / "train.yaml"
    path.write_text(f"model: {{}}\ndata: {section}\n")
    with pytest.raises(ConfigError, match=r"^data: got"):
        StreamConfig.from_yaml(path)


def test_from_yaml_unknown_key_in_data_section(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: {}\ndata:\n  dataset_name_or_path: parquet\n  shufle: true\n")
    with pytest.raises(ConfigError, match=r"data\.shufle: unknown key; did you mean 'shuffle'"):
        StreamConfig.from_yaml(path)


def test_from_yaml_not_utf8_is_config_error(tmp_path):
    # Library gap: open(..., encoding="utf-8") raises UnicodeDecodeError, which from_yaml does not catch.
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00data: \x80\x81\n")
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(path)
    assert str(path) in str(info.value)


def test_from_yaml_directory_is_config_error(tmp_path):
    # Library gap: only FileNotFoundError is caught; a directory raises IsADirectoryError.
    with pytest.raises(ConfigError) as info:
        StreamConfig.from_yaml(tmp_path)
    assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------------------- relative paths
@pytest.fixture
def yaml_with_data(tmp_path):
    """conf/train.yaml with its data in conf/data/*.parquet (500 rows, 2 files x 5 row groups)."""
    conf = tmp_path / "conf"
    write_parquet_dataset(str(conf / "data"), rows=500, files=2, row_group_size=50)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return conf, elsewhere


def test_relative_data_files_resolved_next_to_yaml(yaml_with_data, monkeypatch):
    conf, elsewhere = yaml_with_data
    path = conf / "train.yaml"
    path.write_text(yaml.safe_dump({"model": {}, "data": {
        "dataset_name_or_path": "parquet", "data_files": "data/*.parquet"}}))
    monkeypatch.chdir(elsewhere)
    cfg = StreamConfig.from_yaml("../conf/train.yaml")
    assert cfg.data_files == os.path.join(str(conf), "data", "*.parquet")
    assert os.path.isabs(cfg.data_files)
    stream = ResumableStream(cfg, rank=0, world_size=1)
    stream.set_epoch(0)
    assert sorted(row["id"] for row in stream) == list(range(500))


def test_relative_data_files_list_and_dict_resolved(yaml_with_data, monkeypatch):
    conf, elsewhere = yaml_with_data
    path = conf / "data.yaml"
    path.write_text(yaml.safe_dump({
        "dataset_name_or_path": "parquet",
        "data_files": {"train": ["./data/part-00000.parquet"], "validation": "data/part-00001.parquet"},
    }))
    monkeypatch.chdir(elsewhere)
    cfg = StreamConfig.from_yaml(path)
    assert cfg.data_files == {
        "train": [os.path.join(str(conf), "data", "part-00000.parquet")],
        "validation": os.path.join(str(conf), "data", "part-00001.parquet"),
    }


def test_relative_path_missing_next_to_yaml_is_kept(yaml_with_data, monkeypatch):
    conf, elsewhere = yaml_with_data
    path = conf / "data.yaml"
    path.write_text(yaml.safe_dump({
        "dataset_name_or_path": "parquet",
        "data_files": ["data/*.parquet", "other/*.parquet", "hf://datasets/org/name/x.parquet"],
    }))
    monkeypatch.chdir(elsewhere)
    cfg = StreamConfig.from_yaml(path)
    assert cfg.data_files == [os.path.join(str(conf), "data", "*.parquet"), "other/*.parquet",
                              "hf://datasets/org/name/x.parquet"]


# ---------------------------------------------------------------------------- split
@pytest.fixture(scope="module")
def split_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("splits")
    paths = write_parquet_dataset(str(d), rows=500, files=2, row_group_size=50)
    return paths


def _split_config(paths, split):
    return StreamConfig(dataset_name_or_path="parquet", data_files={"train": paths[0], "validation": paths[1]},
                        split=split)


@pytest.mark.parametrize("opener", [
    pytest.param(lambda cfg: ResumableStream(cfg, rank=0, world_size=1), id="ResumableStream"),
    pytest.param(lambda cfg: open_source(cfg.source_spec), id="open_source"),
])
def test_unknown_split_lists_existing_splits(split_dir, opener):
    with pytest.raises(ConfigError) as info:
        opener(_split_config(split_dir, "test"))
    msg = str(info.value)
    assert "data.split" in msg
    assert "'test'" in msg
    assert "train" in msg and "validation" in msg


def test_unknown_split_with_list_data_files(split_dir):
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=list(split_dir), split="validation")
    with pytest.raises(ConfigError, match=r"data\.split: got 'validation'.*train"):
        open_source(cfg.source_spec)


def test_existing_split_reads_only_its_files(split_dir):
    stream = ResumableStream(_split_config(split_dir, "validation"), rank=0, world_size=1)
    stream.set_epoch(0)
    assert sorted(row["id"] for row in stream) == list(range(250, 500))


# ---------------------------------------------------------------------------- streaming: false
@pytest.fixture(scope="module")
def data_500(tmp_path_factory):
    d = tmp_path_factory.mktemp("data500")
    write_parquet_dataset(str(d), rows=500, files=2, row_group_size=50)
    return str(d)


def _all_ids(cfg):
    stream = ResumableStream(cfg, rank=0, world_size=1)
    stream.set_epoch(0)
    rows = list(stream)
    assert set(rows[0]) == {"id", "text", "label"}
    return stream, [r["id"] for r in rows]


@pytest.mark.parametrize("shuffle", [False, True])
def test_non_streaming_gives_the_same_ids_as_streaming(data_500, shuffle):
    s_stream, s_ids = _all_ids(parquet_config(data_500, shuffle=shuffle, buffer_size=64))
    m_stream, m_ids = _all_ids(parquet_config(data_500, streaming=False, shuffle=shuffle, buffer_size=64))
    assert isinstance(s_stream.source, ParquetSource)
    assert isinstance(m_stream.source, MapStyleSource)
    assert m_stream.source.fingerprint["streaming"] is False
    assert len(m_ids) == len(s_ids) == 500
    assert set(m_ids) == set(s_ids) == set(range(500))


def test_non_streaming_unknown_split(data_500):
    with pytest.raises(ConfigError, match=r"data\.split: got 'validation'"):
        open_source(parquet_config(data_500, streaming=False, split="validation").source_spec)


# ---------------------------------------------------------------------------- numeric edge
def test_non_finite_cache_size_rejected():
    # Library gap: `v > 0` lets float('inf') through ('a number of gigabytes > 0' should be finite).
    with pytest.raises(ConfigError, match=r"data\.cache_size_limit_gb: got inf"):
        StreamConfig(dataset_name_or_path="parquet", data_files="data/*.parquet", cache_size_limit_gb=float("inf"))


@pytest.mark.parametrize("key, value", [
    ("shuffle_seed", 0), ("shuffle_seed", 2**63 - 1), ("buffer_size", 1), ("buffer_size", 10_000_000),
    ("interleave_shards", 1), ("interleave_shards", 64), ("block_rows", 1), ("block_rows", 1_000_000),
    ("cache_size_limit_gb", 0.5), ("cache_size_limit_gb", 1),
])
def test_boundary_values_accepted(key, value):
    assert getattr(StreamConfig.from_dict(dict(BASE, **{key: value})), key) == value


def test_a_trainer_yaml_with_eval_and_monitoring_keys_reads_as_its_training_stream(tmp_path):
    """peek / warmup / index take a trainer yaml: data.eval and the monitoring keys are the trainer's."""
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"data": {
        "dataset_name_or_path": "parquet", "data_files": "data/*.parquet", "shuffle_seed": 7,
        "eval": {"data_files": "notes/*.parquet", "num_samples": 8}, "metrics_port": 9400, "data_bound_share": 0.5}}))
    cfg = StreamConfig.from_yaml(str(path))
    assert cfg.shuffle_seed == 7 and cfg.dataset_name_or_path == "parquet"
