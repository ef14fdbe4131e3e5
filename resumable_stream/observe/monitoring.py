"""Watching the data path during training: the ``data.metrics_*`` / ``data.data_bound_*`` settings and the
data-bound warning (over each window of ``data_bound_steps`` steps, the worst rank's share of step time spent
waiting for data compared with ``data_bound_share``; one warning per window, with the likely cure)."""

from __future__ import annotations

import ipaddress
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, shown
from ..limits import is_int
from .metrics import READING_FIELDS, combined

log = logging.getLogger(__name__)

MONITOR_KEYS = ("metrics_port", "metrics_addr", "data_bound_share", "data_bound_steps", "log_source_loss")
MAX_PORT = 65535
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")   # a label of a host name (RFC 1123)
SLOW_RESPONSE_MS = 200.0     # a p50 above this: the server (or the link) is slow, whatever we do here


def is_address(v: Any) -> bool:
    """An IP address (IPv4, or IPv6 without brackets) or a host name: dot-separated labels of letters, digits
    and inner hyphens, each at most 63 characters, at most 253 in all, the last one not all digits (so that
    ``999.1.1.1`` or ``1234`` is not taken for a name)."""
    if not isinstance(v, str) or not v:
        return False
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        pass
    name = v[:-1] if v.endswith(".") else v
    labels = name.split(".")
    return len(name) <= 253 and all(_HOST_LABEL.match(label) for label in labels) and not labels[-1].isdigit()


@dataclass(frozen=True)
class MonitorSettings:
    """The monitoring keys of ``data:`` (docs/configuration.md): a Prometheus endpoint per rank on ``metrics_port``
    + local rank, served on ``metrics_addr``; the data-bound warning's share and window; ``log_source_loss``."""

    metrics_port: int | None = None
    metrics_addr: str | None = None
    data_bound_share: float | None = 0.2
    data_bound_steps: int = 50
    log_source_loss: bool = False

    def __post_init__(self) -> None:
        port, share, steps = self.metrics_port, self.data_bound_share, self.data_bound_steps
        if port is not None and not is_int(port, 1, MAX_PORT):
            raise ConfigError(f"data.metrics_port: got {shown(port)}; allowed: null or a port from 1 to {MAX_PORT} "
                              "(each rank serves on port + its local rank)")
        addr = self.metrics_addr
        if addr is not None and not is_address(addr):
            raise ConfigError(f"data.metrics_addr: got {shown(addr)}; allowed: null (prometheus_client's default, "
                              "0.0.0.0: every IPv4 interface) or the address to serve the endpoint on: an IP address "
                              "(e.g. 127.0.0.1 for this machine only, ::1, 0.0.0.0; IPv6 without brackets) or a host "
                              "name (e.g. localhost)")
        if addr is not None and port is None:
            raise ConfigError(f"data.metrics_addr: got {shown(addr)} without data.metrics_port; it is the address of the "
                              "Prometheus endpoint, which only data.metrics_port starts: set data.metrics_port too, "
                              "or remove data.metrics_addr")
        if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool)
                                      and 0 < share <= 1):
            raise ConfigError(f"data.data_bound_share: got {shown(share)}; allowed: null (no warning) or a share of "
                              "step time above 0 and at most 1, e.g. 0.2")
        if not isinstance(self.log_source_loss, bool):
            raise ConfigError(f"data.log_source_loss: got {shown(self.log_source_loss)}; allowed: true or false (a "
                              "mixture's training loss per source in train_log.jsonl)")
        if not is_int(steps, 1, math.inf):
            raise ConfigError(f"data.data_bound_steps: got {shown(steps)}; allowed: an integer >= 1 (optimizer steps "
                              "per window)")

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> MonitorSettings:
        """The settings among a ``data:`` section's keys (the rest is left to the stream and the transform)."""
        return cls(**{k: data[k] for k in MONITOR_KEYS if k in data})


def cures(f: dict[str, Any], context: dict[str, Any]) -> list[str]:
    """What would most likely make the data path keep up, from one window's figures ``f`` (:func:`combined`)
    and ``context`` (``cache_dir``, ``workers``, ``prefetch_blocks`` of the run)."""
    out = []
    remote = f.get("requests", 0) > 0
    blocks = context.get("prefetch_blocks")
    if remote and not context.get("cache_dir"):
        out.append("enable data.cache_dir (a local block cache: later epochs and restarts read from disk; "
                   "`resumable-stream warmup` fills it ahead)")
    if remote and blocks == 0:
        out.append("turn prefetch on (data.prefetch_blocks: null adapts its depth to the measured latency)")
    elif remote and blocks is not None:
        out.append(f"raise data.prefetch_blocks (now {blocks}; null adapts the depth to the measured latency)")
    if not context.get("workers"):
        out.append("raise train.dataloader_num_workers (reading, decoding and tokenizing now run in the "
                   "training process)")
    p50 = f.get("response_ms_p50")
    if p50 is not None and p50 >= SLOW_RESPONSE_MS:
        out.append(f"the server answers slowly (median {p50:.0f} ms per request): read from a closer store or "
                   "a mirror")
    if f.get("retries"):
        causes = ", ".join(f"{n} {c}" for c, n in sorted(f.get("retry_causes", {}).items()))
        out.append(f"requests are being retried ({causes}): check the link and the server")
    return out


class DataBoundWatch:
    """Collects each log interval's per-rank deltas; at the end of every window of ``settings.data_bound_steps``
    steps warns (once) when the worst rank waited more than ``settings.data_bound_share`` of the time."""

    def __init__(self, settings: MonitorSettings, context: dict[str, Any]):
        self.settings, self.context = settings, context
        self._start_step: int | None = None
        self._sums: list[dict[str, float]] | None = None

    def add(self, step: int, deltas: list[dict[str, float]]) -> str | None:
        """One log interval ending at ``step`` (each rank's :func:`metrics.delta`); the warning, if one is due."""
        if self.settings.data_bound_share is None or not deltas:
            return None
        if self._sums is None or len(self._sums) != len(deltas):
            self._sums, self._start_step = [dict.fromkeys(READING_FIELDS, 0.0) for _ in deltas], step
        for total, d in zip(self._sums, deltas):
            for k in READING_FIELDS:
                total[k] += d[k]
        if step - self._start_step + 1 < self.settings.data_bound_steps:
            return None
        sums, first = self._sums, self._start_step
        self._sums = None
        f = combined(sums)
        if f["wait_share"] < self.settings.data_bound_share:
            return None
        message = (f"data-bound: over steps {first}-{step} the training loop waited {f['wait_s']:.1f} s of "
                   f"{f['step_s']:.1f} s for its batches ({f['wait_share']:.0%}, above data.data_bound_share "
                   f"{self.settings.data_bound_share:.0%}); {f['samples_per_s']:.1f} samples/s, "
                   f"{f['requests']} requests, response p50 {_ms(f['response_ms_p50'])} / p99 "
                   f"{_ms(f['response_ms_p99'])}, cache hit rate "
                   f"{'n/a' if f['cache_hit_rate'] is None else format(f['cache_hit_rate'], '.0%')}, prefetch "
                   f"depth {'n/a' if f['prefetch_depth'] is None else format(f['prefetch_depth'], '.1f')}. "
                   f"Likely cure: {'; '.join(cures(f, self.context)) or 'none found in these figures'}")
        log.warning("%s", message)
        return message


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"
