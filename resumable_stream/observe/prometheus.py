"""A Prometheus endpoint per rank with the data path's counters (``data.metrics_port``; the ``metrics`` extra),
read at scrape time, never per step (metrics listed in docs/training.md)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .metrics import RESPONSE_BUCKETS_MS, RETRY_CAUSES

log = logging.getLogger(__name__)
PREFIX = "resumable_stream_"

# reading field -> (metric name, help)
_COUNTERS = {
    "requests": ("requests", "Requests to remote stores (ranged reads of data files)"),
    "request_errors": ("request_errors", "Requests that failed (network faults, bad answers)"),
    "bytes_read": ("bytes_read", "Bytes received from remote stores"),
    "row_groups": ("row_groups", "Parquet row groups fetched and decoded"),
    "rows_decoded": ("rows_decoded", "Rows decoded from fetched row groups"),
    "loader_batches": ("batches", "Batches handed to the training loop"),
    "loader_wait_s": ("batch_wait_seconds", "Seconds the training loop waited for its batches"),
    "loader_samples": ("samples", "Examples in the batches handed to the training loop"),
    "loader_tokens": ("tokens", "Tokens (attention mask ones) in the batches handed to the training loop"),
    "cache_hits": ("cache_hits", "Block cache hits"),
    "cache_misses": ("cache_misses", "Block cache misses"),
    "cache_bytes_read": ("cache_bytes_read", "Bytes read from the block cache"),
    "prefetch_takes": ("prefetch_takes", "Row groups handed over by the prefetcher"),
    "prefetch_depth_sum": ("prefetch_depth_sum", "Sum of the prefetch depth at each hand-over"),
    "rate_limited": ("rate_limited", "Rate-limit answers of remote stores (HTTP 429, S3 503 SlowDown)"),
    "budget_waits": ("budget_waits", "Requests that waited for their turn under data.max_requests_per_s"),
    # microseconds in the reading, exported in seconds (_DIVIDED)
    "budget_wait_us": ("budget_wait_seconds", "Seconds requests waited for their turn under data.max_requests_per_s "
                       "(summed over the requests)"),
    "rate_limit_wait_us": ("rate_limit_wait_seconds", "Seconds requests waited for the reset a store's rate-limit "
                           "answer named (summed over the requests)"),
}
_DIVIDED = {"budget_wait_us": 1e6, "rate_limit_wait_us": 1e6}


class DataPathCollector:
    """A ``prometheus_client`` collector over ``reading_of()`` (a ``StreamLoader.metrics_reading``) and
    ``epoch_of()``."""

    def __init__(self, reading_of: Callable[[], dict[str, float]], epoch_of: Callable[[], float | None],
                 rank: int, sources_of: Callable[[], dict[str, Any] | None] | None = None):
        self.reading_of, self.epoch_of, self.rank = reading_of, epoch_of, str(rank)
        self.sources_of = sources_of     # a StreamLoader.source_figures (None: not a mixture)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        r = self.reading_of()
        for field, (name, text) in _COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, text, labels=["rank"])
            family.add_metric([self.rank], float(r.get(field, 0)) / _DIVIDED.get(field, 1))
            yield family
        retries = CounterMetricFamily(PREFIX + "retries", "Requests or reads tried again, by cause",
                                      labels=["rank", "cause"])
        for cause in RETRY_CAUSES:
            retries.add_metric([self.rank, cause], float(r.get(f"retry_{cause}", 0)))
        yield retries
        buckets, seen = [], 0.0
        for b in RESPONSE_BUCKETS_MS:
            seen += r.get(f"response_le_{b}", 0)
            buckets.append((repr(b / 1000), seen))
        buckets.append(("+Inf", seen + r.get("response_le_inf", 0)))
        histogram = HistogramMetricFamily(PREFIX + "response_seconds", "Response time of requests to remote "
                                          "stores (latency and transfer)", labels=["rank"])
        histogram.add_metric([self.rank], buckets, sum_value=r.get("response_us", 0) / 1e6)
        yield histogram
        try:
            epoch = self.epoch_of()
        except Exception:      # read while the training loop moves on: the next scrape has it
            epoch = None
        if epoch is not None:
            gauge = GaugeMetricFamily(PREFIX + "data_epoch", "Epochs of data consumed (fractional)", labels=["rank"])
            gauge.add_metric([self.rank], float(epoch))
            yield gauge
        yield from self._sources()

    def _sources(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            figures = self.sources_of() if self.sources_of is not None else None
        except Exception:      # read while the training loop moves on: the next scrape has it
            figures = None
        if not figures:
            return
        for name, text in (("samples", "Samples each source of the mixture put into the batches handed to the "
                                        "training loop"),
                           ("tokens", "Tokens (padding excluded) each source of the mixture put into the batches "
                                      "handed to the training loop")):
            family = CounterMetricFamily(PREFIX + "source_" + name, text, labels=["rank", "source"])
            for label, value in zip(figures["labels"], figures[name]):
                family.add_metric([self.rank, label], float(value))
            yield family
        gauge = GaugeMetricFamily(PREFIX + "source_target_weight", "Target weight of each source of the mixture",
                                  labels=["rank", "source"])
        for label, weight in figures["target"].items():
            gauge.add_metric([self.rank, label], float(weight))
        yield gauge


def serve(loader: Any, port: int, rank: int = 0, addr: str | None = None):
    """Serve ``loader``'s data-path figures on ``http://addr:port/metrics``; returns the server (``shutdown()``
    stops it). ``addr`` (``data.metrics_addr``): None is prometheus_client's default (``0.0.0.0``, every
    IPv4 interface); ``127.0.0.1`` keeps the endpoint on this machine."""
    try:
        from prometheus_client import (
            CollectorRegistry,
            GCCollector,
            PlatformCollector,
            ProcessCollector,
            start_http_server,
        )
    except ImportError:
        raise ConfigError("data.metrics_port needs prometheus_client: pip install 'resumable-stream[metrics]'") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DataPathCollector(loader.metrics_reading, loader.data_epoch, rank, loader.source_figures))
    for default in (ProcessCollector, PlatformCollector, GCCollector):   # what prometheus_client's REGISTRY serves
        default(registry=registry)
    where = {} if addr is None else {"addr": addr}
    try:
        server, _thread = start_http_server(port, registry=registry, **where)
    except OSError as e:
        if addr is not None and e.errno not in (errno.EADDRINUSE, errno.EACCES):   # the address, not the port
            raise ConfigError(f"data.metrics_addr: got {addr!r}; port {port} cannot be served there ({e}); allowed: "
                              "an address of this machine (e.g. 127.0.0.1, 0.0.0.0) or a host name that resolves "
                              "to one") from None
        shown = "prometheus_client's default address" if addr is None else addr
        raise ConfigError(f"data.metrics_port: port {port} cannot be served on {shown} ({e}); allowed: a free port "
                          "(each rank uses port + its local rank)") from None
    log.info("data-path metrics of rank %d on %s", rank, metrics_url(port, server.server_address[0]))
    return server


def metrics_url(port: int, addr: str | None) -> str:
    """Where to scrape ``port`` served on ``addr`` (None: prometheus_client's default, every IPv4 interface):
    an address of every interface is reached by this machine's name."""
    if addr in (None, "", "0.0.0.0", "::"):
        import socket

        addr = socket.gethostname()
    host = f"[{addr}]" if ":" in addr else addr     # an IPv6 address in a URL
    return f"http://{host}:{port}/metrics"
