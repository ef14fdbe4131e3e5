"""``data.metrics_addr``: the address the Prometheus endpoint (``data.metrics_port``) is served on, checked
with a real prometheus_client server on loopback; bad values and a key without its port are ConfigErrors."""

from __future__ import annotations

import inspect
import itertools
import os
import socket
import urllib.request

import pytest
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader
from resumable_stream.observe.monitoring import MonitorSettings
from resumable_stream.testing import write_parquet_dataset

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny", "train_lm.yaml")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def loader(tmp_path):
    write_parquet_dataset(str(tmp_path), rows=100, files=1, row_group_size=50)
    stream = ResumableStream(StreamConfig(dataset_name_or_path="parquet", data_files=str(tmp_path / "*.parquet")))
    loader = StreamLoader(stream, batch_size=10)
    list(itertools.islice(loader, 2))
    yield loader
    stream.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(loader, **settings):
    from resumable_stream.integrations.transformers.data_metrics import DataMetricsLog

    return DataMetricsLog(loader, MonitorSettings.from_data(settings), {}, rank=0, world_size=1)


def test_metrics_addr_127_0_0_1_serves_on_loopback_only(loader, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    log = _log(loader, metrics_port=port, metrics_addr="127.0.0.1")
    try:
        assert log.server.server_address == ("127.0.0.1", port)     # bound to loopback, not every interface
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        log.close()
    assert 'resumable_stream_batches_total{rank="0"} 2.0' in text


def test_the_endpoint_serves_the_process_and_platform_collectors_too(loader, monkeypatch):
    """Besides ours, what prometheus_client's default registry serves: process_*, python_gc_*, python_info."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    log = _log(loader, metrics_port=port, metrics_addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        log.close()
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds", "python_info", "python_gc_collections_total",
                 "resumable_stream_batches_total"):
        assert name in samples, (name, sorted(samples))
    rss = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("process_resident_memory_bytes"))
    assert rss > 10e6          # this very process: a Python with pyarrow loaded holds more than 10 MB


def test_without_metrics_addr_the_endpoint_is_where_prometheus_client_puts_it(loader, monkeypatch):
    from prometheus_client import start_http_server

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    default = inspect.signature(start_http_server).parameters["addr"].default    # "0.0.0.0" in 0.26
    port = _free_port()
    log = _log(loader, metrics_port=port)
    try:
        assert log.server.server_address == (default, port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        log.close()


def test_an_address_not_of_this_machine_is_a_config_error_naming_metrics_addr(loader, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    with pytest.raises(ConfigError) as e:
        _log(loader, metrics_port=port, metrics_addr="192.0.2.1")      # TEST-NET-1: no interface has it
    assert "data.metrics_addr: got '192.0.2.1'" in str(e.value) and str(port) in str(e.value)


@pytest.mark.parametrize("value", ["", " ", "127.0.0.1:9400", "http://127.0.0.1", "[::1]", "999.1.1.1", "1234",
                                   "-host", "host-", "a..b", "a" * 64, "host name", "hôst", 1234, 127.0, True,
                                   ["127.0.0.1"]])
def test_a_bad_metrics_addr_is_a_config_error(value):
    with pytest.raises(ConfigError) as e:
        MonitorSettings.from_data({"metrics_port": 9400, "metrics_addr": value})
    msg = str(e.value)
    assert msg.startswith(f"data.metrics_addr: got {value!r}; allowed: null") and "an IP address" in msg
    assert "host name" in msg


@pytest.mark.parametrize("value", ["127.0.0.1", "0.0.0.0", "::1", "::", "fe80::1%lo", "localhost",
                                   "node-3.cluster.local", "node-3.cluster.local.", "10.0.0.7"])
def test_ip_addresses_and_host_names_are_accepted(value):
    assert MonitorSettings.from_data({"metrics_port": 9400, "metrics_addr": value}).metrics_addr == value


def test_metrics_addr_without_metrics_port_is_a_config_error():
    for data in ({"metrics_addr": "127.0.0.1"}, {"metrics_addr": "127.0.0.1", "metrics_port": None}):
        with pytest.raises(ConfigError) as e:
            MonitorSettings.from_data(data)
        assert "data.metrics_addr: got '127.0.0.1' without data.metrics_port" in str(e.value)
    assert MonitorSettings.from_data({"metrics_addr": None}) == MonitorSettings()


def test_metrics_addr_is_read_wherever_metrics_port_is(tmp_path):
    from resumable_stream.config.trainer import TrainerConfig
    from resumable_stream.integrations.llamafactory.settings import monitor_settings, split

    # the trainer yaml, with key=value overrides as `resumable-stream train` takes them
    cfg = TrainerConfig.from_yaml(TINY, ["data.metrics_port=9400", "data.metrics_addr=127.0.0.1"])
    assert cfg.monitor == MonitorSettings(metrics_port=9400, metrics_addr="127.0.0.1")
    assert cfg.stream == TrainerConfig.from_yaml(TINY).stream       # the training's, not the stream's
    # peek / warmup / index read a trainer yaml's data section: the key is the trainer's, accepted and left out
    stream = StreamConfig.from_yaml(TINY, ["data.metrics_port=9400", "data.metrics_addr=::1"])
    assert stream == StreamConfig.from_yaml(TINY)
    # LLaMA-Factory's resumable_stream: section; its errors name the section's key
    _, ours = split({"stage": "sft", "resumable_stream": {"metrics_port": 9400, "metrics_addr": "localhost"}})
    assert monitor_settings(ours) == MonitorSettings(metrics_port=9400, metrics_addr="localhost")
    with pytest.raises(ConfigError) as e:
        split({"resumable_stream": {"metrics_port": 9400, "metrics_addr": "127.0.0.1:9400"}})
    assert str(e.value).startswith("resumable_stream.metrics_addr: got '127.0.0.1:9400'")
    with pytest.raises(ConfigError) as e:
        split({"resumable_stream": {"metrics_addr": "127.0.0.1"}})
    assert "resumable_stream.metrics_addr: got '127.0.0.1' without resumable_stream.metrics_port" in str(e.value)
