"""Per logging step, every rank's data-path figures, gathered in one ``all_gather``: in the Trainer's logs (so
``report_to`` gets them), in ``train_log.jsonl``, and watched for data-bound windows. The Prometheus endpoint
(``data.metrics_port``) is started here too, one per rank."""

from __future__ import annotations

import math
import os
from typing import Any

from ...observe.metrics import READING_FIELDS, combined, delta, figures
from ...observe.monitoring import DataBoundWatch, MonitorSettings
from ...observe.prometheus import serve

# the figures that go into the Trainer's logs (scalars only: reporting integrations drop anything else)
LOGGED = ("wait_s", "wait_share", "samples_per_s", "tokens_per_s", "requests", "bytes_read", "retries",
          "response_ms_p50", "response_ms_p90", "response_ms_p99", "cache_hit_rate", "prefetch_depth",
          "rate_limited", "rate_limit_wait_s", "budget_wait_s")


class DataMetricsLog:
    """The data figures of one training run, for the patched Trainer's ``log``."""

    def __init__(self, loader, settings: MonitorSettings, context: dict[str, Any], rank: int, world_size: int,
                 device=None):
        self.loader, self.settings = loader, settings
        self.rank, self.world_size, self.device = rank, world_size, device
        self.watch = DataBoundWatch(settings, context)
        self.latest: dict[str, Any] = {}
        self._last = loader.metrics_reading()
        self.server = None
        if settings.metrics_port is not None:

            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            self.server = serve(loader, settings.metrics_port + local_rank, rank, settings.metrics_addr)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def on_log(self, logs: dict[str, Any], step: int) -> None:
        """Called on every rank with the Trainer's training logs: adds the ``data_*`` figures to ``logs``."""
        now = self.loader.metrics_reading()
        mine = delta(self._last, now)
        self._last = now
        epoch = self.loader.data_epoch()
        deltas, epochs = self._gathered(mine, epoch)
        per_rank = [figures(d) for d in deltas]
        total = combined(deltas, per_rank)
        known = [e for e in epochs if e is not None]
        total["epoch"] = round(sum(known) / len(known), 6) if known and len(known) == len(epochs) else None
        self.latest = {f"data_{k}": v for k, v in total.items()}
        self.latest["data_ranks"] = [{"rank": r, **f, "epoch": e} for r, (f, e) in enumerate(zip(per_rank, epochs))]
        for name in (*LOGGED, "epoch"):
            value = total.get(name)
            if value is not None:
                logs[f"data_{name}"] = value
        if self.rank == 0:
            self.watch.add(step, deltas)

    def _gathered(self, mine: dict[str, float], epoch: float | None) -> tuple[list[dict], list[float | None]]:
        """Every rank's delta and data epoch (one all_gather; just this rank's without torch.distributed)."""
        import torch
        import torch.distributed as dist

        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return [mine], [epoch]
        row = torch.tensor([mine[k] for k in READING_FIELDS] + [math.nan if epoch is None else epoch],
                           dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row)
        deltas, epochs = [], []
        for values in (r.tolist() for r in rows):
            deltas.append(dict(zip(READING_FIELDS, values[:-1])))
            epochs.append(None if math.isnan(values[-1]) else round(values[-1], 6))
        return deltas, epochs
