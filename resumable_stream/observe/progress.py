"""How far partitions are through their data, for ``inspect`` and the training logs."""

from __future__ import annotations

from typing import Any


def partition_progress(ps: dict[str, Any]) -> dict[str, Any]:
    """Where one partition stands in its data (a ``PartitionState.to_dict()``): its epoch, rows of that epoch
    consumed, and the fraction (None when the epoch's row count or start is unknown, e.g. json shards or an
    older sidecar)."""
    start, rows = ps.get("epoch_start"), ps.get("epoch_rows")
    done = ps["consumed"] - start if start is not None else None
    fraction = done / rows if done is not None and rows else None
    return {"epoch": ps["epoch"], "epoch_consumed": done, "epoch_rows": rows,
            "epoch_fraction": None if fraction is None else round(fraction, 6)}


def progress_summary(progress: list[dict[str, Any]]) -> dict[str, Any]:
    """min / max / mean over partitions of the epoch, the fraction of the current epoch consumed, and
    epochs completed (epoch + fraction: comparable across partitions in different epochs)."""
    def stats(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {"min": round(min(values), 6), "max": round(max(values), 6),
                "mean": round(sum(values) / len(values), 6)}

    known = [p for p in progress if p["epoch_fraction"] is not None]
    return {"partitions": len(progress),
            "epoch": {"min": min(p["epoch"] for p in progress), "max": max(p["epoch"] for p in progress)}
            if progress else None,
            "epoch_fraction": stats([p["epoch_fraction"] for p in known]),
            "epochs_completed": stats([p["epoch"] + p["epoch_fraction"] for p in known]),
            "unknown_fraction": len(progress) - len(known)}


def epoch_position(state: Any) -> float | None:
    """Epochs completed by one partition, fractional (``epoch + fraction of it consumed``), from its typed state
    (a ``PartitionState``; a ``MixturePartitionState``: the mean of its sources'); None when unknown."""
    sources = getattr(state, "sources", None)
    if sources is not None:
        known = [x for x in (epoch_position(s) for s in sources) if x is not None]
        return sum(known) / len(known) if known else None
    return position(state.epoch, state.consumed, state.epoch_start, state.epoch_rows)


def position(epoch: int, consumed: int, epoch_start: int | None, epoch_rows: int | None) -> float | None:
    """``epoch`` plus the fraction of its ``epoch_rows`` consumed (``consumed`` counts all epochs, of which
    ``epoch_start`` came before this one); None when either is unknown."""
    if epoch_start is None or not epoch_rows:
        return None
    return epoch + (consumed - epoch_start) / epoch_rows


def mean_position(positions: list[float | None]) -> float | None:
    """The mean of a rank's partition positions, rounded; None when any is unknown (or there are none)."""
    if not positions or any(p is None for p in positions):
        return None
    return round(sum(positions) / len(positions), 6)
