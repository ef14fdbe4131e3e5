"""Mixture weights that change with training: ``data.sources[i].weight`` as a number or a schedule such as
``{schedule: linear, unit: steps, points: [[0, 0.9], [1000, 0.1]]}`` (docs/mixtures.md). A schedule is checked
here and kept as plain JSON values, so it goes into a fingerprint as is; how a position maps to a partition's
draw index is the stream's (resumable_stream.stream.weights)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, shown
from ..limits import is_number

SCHEDULES = ("linear", "constant")
UNITS = ("steps", "samples")
MAX_POINTS = 10_000
_ALLOWED = ("a finite number > 0, or a schedule {schedule: linear | constant, unit: steps | samples, "
            "points: [[position, weight], ...]} with positions strictly increasing from 0 and weights >= 0")


def check_weight(value: Any, key: str, allow_zero: bool = False) -> float | dict[str, Any]:
    """A source's weight in its canonical form: a float, or a schedule with float points. ``key`` names it;
    ``allow_zero``: a fixed weight may be 0 (a source paused by a change of weights)."""
    if is_number(value):
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{key}: got {shown(value)}; allowed: {_ALLOWED} (weights are relative: they are "
                              "normalised to sum to 1)")
        return float(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: got {shown(value)}; allowed: {_ALLOWED}")
    unknown = sorted(set(value) - {"schedule", "unit", "points"})
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; allowed: schedule, unit, points")
    kind, unit, points = value.get("schedule", "linear"), value.get("unit", "steps"), value.get("points")
    if kind not in SCHEDULES:
        raise ConfigError(f"{key}.schedule: got {shown(kind)}; allowed: {' or '.join(SCHEDULES)}")
    if unit not in UNITS:
        raise ConfigError(f"{key}.unit: got {shown(unit)}; allowed: {' or '.join(UNITS)}")
    if not (isinstance(points, list) and 1 <= len(points) <= MAX_POINTS):
        raise ConfigError(f"{key}.points: got {shown(points)}; allowed: a list of 1 to {MAX_POINTS} "
                          "[position, weight] pairs")
    out = []
    for j, point in enumerate(points):
        if not (isinstance(point, (list, tuple)) and len(point) == 2 and all(is_number(v) for v in point)
                and point[0] >= 0 and point[1] >= 0):
            raise ConfigError(f"{key}.points[{j}]: got {shown(point)}; allowed: [position, weight], a position >= 0 "
                              f"({unit}) and a finite weight >= 0")
        if out and point[0] <= out[-1][0]:
            raise ConfigError(f"{key}.points[{j}]: position {shown(point[0])} after {shown(points[j - 1][0])}; allowed: positions "
                              "strictly increasing (a step change is two points: [[99, 1.0], [100, 0.0]] with "
                              "schedule: linear, or schedule: constant)")
        out.append([float(point[0]), float(point[1])])
    return {"schedule": kind, "unit": unit, "points": out}


def normalised(weights: list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """Weights divided by their sum, which is 1 then. Weights near the float maximum (1e308 and 1e308) have a sum
    that overflows to inf, and w / inf is 0 for every source: those are divided by the largest weight first (the
    ratios stay; weights whose sum is finite are divided as they always were, so that draws do not change)."""
    total = float(sum(weights))
    if not math.isfinite(total):
        top = max(weights)
        weights = [float(w) / top for w in weights]
        total = float(sum(weights))
    return tuple(float(w) / total for w in weights)


def is_schedule(weight: Any) -> bool:
    return isinstance(weight, dict)


def weight_at(weight: float | dict[str, Any], position: float) -> float:
    """The weight at ``position`` (in the schedule's unit): what resumable_stream.stream.weights computes for
    many positions at once."""
    if not is_schedule(weight):
        return float(weight)
    points = weight["points"]
    if position <= points[0][0]:
        return points[0][1]
    for (x0, w0), (x1, w1) in zip(points, points[1:]):
        if position < x1:
            if weight["schedule"] == "constant":
                return w0
            return w0 + (w1 - w0) * ((position - x0) / (x1 - x0))    # never (w1 - w0) * position: overflow
    return points[-1][1]


def check_weights(weights: list, labels: list[str], key_of, allow_zero: bool = False) -> tuple:
    """Every source's weight canonical, one unit over the schedules, and some weight > 0 at every position.
    ``key_of(i)`` names source i's weight key in errors."""
    out = tuple(check_weight(w, key_of(i), allow_zero) for i, w in enumerate(weights))
    units = {w["unit"] for w in out if is_schedule(w)}
    if len(units) > 1:
        raise ConfigError(f"{key_of(0).rsplit('[', 1)[0]}: schedules in {' and '.join(sorted(units))}; allowed: "
                          "one unit for every schedule of a mixture")
    # the weights are piecewise linear or constant: their sum is 0 somewhere only if it is 0 at a point
    positions = sorted({0.0} | {x for w in out if is_schedule(w) for x, _ in w["points"]})
    for x in positions:
        if sum(weight_at(w, x) for w in out) <= 0:
            unit = next(iter(units), "steps")
            raise ConfigError(f"{key_of(0).rsplit('[', 1)[0]}: every source's weight is 0 at {unit[:-1]} {x:g} "
                              f"({', '.join(labels)}); allowed: some source with a weight > 0 at every position")
    return out


def schedule_unit(weights: tuple) -> str | None:
    """The unit of a mixture's schedules (None: fixed weights only)."""
    return next((w["unit"] for w in weights if is_schedule(w)), None)
