"""``resumable-stream report RUN_DIR``: a PNG of stacked panels over steps and a text summary, both from
``RUN_DIR/train_log.jsonl`` alone (docs/cli.md). Damaged lines are skipped and counted, a log linked out of
RUN_DIR is refused, and a value the picture cannot draw is left out and named in one warning."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, RunLogError
from ..io.safe_files import FileRefused, read_regular_file

LOG_NAME = "train_log.jsonl"
DEFAULT_PNG = "report.png"
FIGSIZE_IN = (10.0, 15.0)
DPI = 100
SIZE_PX = (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))   # (width, height) of the PNG: 1000 x 1500
# a mixture's log (source_target_weights / source_realized_weights) gets a seventh panel, 2.5 in taller
MIXTURE_FIGSIZE_IN = (10.0, 17.5)
MIXTURE_SIZE_PX = (int(MIXTURE_FIGSIZE_IN[0] * DPI), int(MIXTURE_FIGSIZE_IN[1] * DPI))   # 1000 x 1750
MAX_SOURCES_DRAWN = 16        # the mixture panel's sources (the others are named as left out)
# one colour per source of a mixture: its realized share solid, its target dashed; none of them in COLOURS
SOURCE_COLOURS = ("navy", "darkgoldenrod", "teal", "darkviolet", "saddlebrown", "darkgreen", "deeppink", "steelblue")
MAX_LOG_BYTES = 2 * 1024**3
META_PREFIX = "resumable-stream "   # PNG text keys: "resumable-stream log", "... log blake2b", ...
NOT_RECORDED = "not recorded"
# The largest magnitude drawn: matplotlib's axis limits and ticks (a span, margins, tick steps up to 100x the
# scale) overflow for data near the float maximum (1.8e308): `ValueError: arange: cannot compute length`.
DRAW_LIMIT = 1e300
RESUME_COLOUR = "tab:red"     # the resume lines; no series has it
# one colour per series, none of them the resume lines
COLOURS = {"loss": "tab:blue", "eval_loss": "tab:orange", "data_wait_share": "tab:purple",
           "samples_per_s": "tab:cyan", "data_samples_per_s": "tab:green", "data_tokens_per_s": "tab:pink",
           "data_requests": "tab:gray", "data_response_ms_p50": "tab:olive", "data_response_ms_p99": "tab:brown",
           "cache_hit_rate": "black", "compared_loss": "0.45", "loss_difference": "tab:blue",
           "same_samples": "tab:green", "samples_differ": "crimson"}
# the training-line fields the picture draws (eval_loss, of the evaluation lines, too)
DRAWN = ("loss", "data_wait_share", "samples_per_s", "data_samples_per_s", "data_tokens_per_s", "data_requests",
         "data_response_ms_p50", "data_response_ms_p99", "data_cache_hit_rate", "cache_hit_rate")


@dataclass
class RunLog:
    """The records of one ``train_log.jsonl``: training lines (one per step, by step), evaluation lines, resume
    points and how many lines were damaged."""

    path: str
    digest: str                                   # blake2b (64-byte) hex digest of the file's bytes
    training: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)   # line numbers skipped

    def series(self, *keys: str, drawn: bool = False) -> tuple[str | None, list[tuple[int, float]]]:
        """(key, [(step, value)]) of the first of ``keys`` that some training line has as a number (``drawn``:
        as a number the picture can draw, see :func:`drawable`)."""
        keep = drawable if drawn else number
        for key in keys:
            points = [(r["step"], v) for r in self.training if (v := keep(r.get(key))) is not None]
            if points:
                return key, points
        return None, []

    def sources(self) -> list[str]:
        """The labels of a mixture's sources, in the order the log first names them (target or realized
        weights); empty for a single dataset's log."""
        seen: dict[str, None] = {}
        for r in self.training:
            for key in ("source_target_weights", "source_realized_weights"):
                value = r.get(key)
                if isinstance(value, dict):
                    seen.update(dict.fromkeys(k for k in value if isinstance(k, str)))
        return list(seen)

    def source_series(self, key: str, label: str) -> list[tuple[int, float]]:
        """(step, value) of source ``label`` in the mapping field ``key``, where drawable."""
        return [(r["step"], v) for r in self.training
                if isinstance(r.get(key), dict) and (v := drawable(r[key].get(label))) is not None]

    def undrawn(self) -> list[tuple[str, int, Any]]:
        """(field, step, value) of each number of a drawn field that the picture leaves out (not finite, or
        beyond +-DRAW_LIMIT), in the log's order of steps."""
        out = [(key, r["step"], r[key]) for r in self.training for key in DRAWN if _not_drawable(r.get(key))]
        return out + [("eval_loss", r["step"], r["eval_loss"]) for r in self.evals if _not_drawable(r.get("eval_loss"))]


MAX_STEP = 10**15


def number(value) -> float | None:
    """A finite int or float (not a bool), else None: missing and null fields read the same (and so do NaN,
    Infinity and ints too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:
        return None


def drawable(value) -> float | None:
    """:func:`number`, if within +-DRAW_LIMIT (what the picture can draw), else None."""
    v = number(value)
    return v if v is not None and -DRAW_LIMIT <= v <= DRAW_LIMIT else None


def _not_drawable(value) -> bool:
    """A number (NaN, infinities and ints too large for a float included) that :func:`drawable` refuses."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and drawable(value) is None


def record_step(rec) -> int | None:
    """A record's ``step``: an int in 0..MAX_STEP, else None."""
    step = rec.get("step") if isinstance(rec, dict) else None
    ok = isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP
    return step if ok else None


def records(data: bytes) -> Iterator[tuple[int, Any, int | None]]:
    """(line number, record, :func:`record_step`) of each non-blank line of a JSON-lines log (only "\n" ends a
    line, as the writer's); the record None where the line is not JSON (or nested too deeply)."""
    for number_, raw in enumerate(data.split(b"\n"), 1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        yield number_, rec, record_step(rec)


def log_path(run_dir: str) -> tuple[str, str]:
    """``RUN_DIR/train_log.jsonl`` and the file it is (symlinks resolved), checked: RUN_DIR a directory, the
    log inside it."""
    if not os.path.isdir(run_dir):
        what = "not a directory" if os.path.lexists(run_dir) else "not found"
        raise RunLogError(f"run directory {run_dir!r}: {what} (give a train.output_dir holding {LOG_NAME})")
    path = os.path.join(run_dir, LOG_NAME)
    if not os.path.lexists(path):
        raise RunLogError(f"{path!r}: not found (a training run writes it in its train.output_dir)")
    real_dir, real = os.path.realpath(run_dir), os.path.realpath(path)
    if os.path.commonpath([real_dir, real]) != real_dir:
        raise RunLogError(f"{path!r}: a link to {real!r}, outside the run directory; refused")
    return path, real


def read_log_bytes(path: str, real: str) -> bytes:
    """The bytes of ``real`` (``path`` resolved); only a regular file (a FIFO or device is refused, never
    waited on), at most MAX_LOG_BYTES."""
    try:
        return read_regular_file(real, MAX_LOG_BYTES)
    except FileRefused as e:
        raise RunLogError(f"{path!r}: {e}; refused") from None
    except OSError as e:
        raise RunLogError(f"{path!r}: cannot be read: {e.strerror or e}") from None


def _resume_step(name: Any, step: int) -> int:
    """The step of ``checkpoint-N`` (the resume point); the step before ``step`` when the name says none."""
    m = re.fullmatch(r"checkpoint-(\d{1,12})", name) if isinstance(name, str) else None
    return int(m.group(1)) if m else step - 1


def read_log(run_dir: str) -> RunLog:
    """Parse ``RUN_DIR/train_log.jsonl``: training lines (int ``step`` and ``loss``; a step logged twice keeps its
    later line), resume points (``resumed_from: "checkpoint-N"``) and evaluation lines (``eval_*`` keys)."""
    path, real = log_path(run_dir)
    data = read_log_bytes(path, real)
    log = RunLog(path=path, digest=hashlib.blake2b(data).hexdigest())
    by_step: dict[int, dict] = {}
    for number_, rec, step in records(data):
        if step is None:
            log.damaged.append(number_)
        elif "loss" in rec:
            by_step[step] = rec
            if "resumed_from" in rec:
                at = _resume_step(rec["resumed_from"], step)
                if at not in log.resumes:
                    log.resumes.append(at)
        elif any(isinstance(k, str) and k.startswith("eval_") for k in rec):
            log.evals.append(rec)
    log.training = [by_step[s] for s in sorted(by_step)]
    log.resumes.sort()
    return log


# ------------------------------------------------------------------------------------------------ summary
def _mean(values):
    try:
        return statistics.fmean(values)
    except OverflowError:   # the sum leaves the float range (values near 1.8e308); their mean does not:
        k = len(values).bit_length() + 1    # summed scaled down by 2**k (exact), which keeps the sum finite
        return math.ldexp(math.fsum(math.ldexp(v, -k) for v in values) / len(values), k)


def _median(values):
    """The median; of an even count, the mean of the middle two taken as halves (their sum may overflow)."""
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else values[mid - 1] / 2 + values[mid] / 2


# the summary's figures of one series each: (summary key, text row, the log's field, reduced over its values)
FIGURES = (("first_loss", "first loss", "loss", lambda v: v[0]),
           ("last_loss", "last loss", "loss", lambda v: v[-1]),
           ("wait_share_mean", "data wait share mean", "data_wait_share", _mean),
           ("wait_share_max", "data wait share max", "data_wait_share", max),
           ("samples_per_s_mean", "samples/s mean", "samples_per_s", _mean),
           ("data_samples_per_s_mean", "data samples/s mean", "data_samples_per_s", _mean),
           ("tokens_per_s_mean", "data tokens/s mean", "data_tokens_per_s", _mean),
           ("requests_total", "requests total", "data_requests", sum),
           ("response_ms_p50", "response ms p50", "data_response_ms_p50", _median),
           ("response_ms_p99", "response ms p99", "data_response_ms_p99", _median))


def summarize(log: RunLog) -> dict:
    """The summary's figures (None: not recorded). Means and medians are over the logged intervals that
    have the field."""
    steps = [r["step"] for r in log.training]
    cache_key, cache = log.series("data_cache_hit_rate", "cache_hit_rate_total", "cache_hit_rate")
    figures = {key: reduce([v for _, v in points]) if (points := log.series(field)[1]) else None
               for key, _, field, reduce in FIGURES}
    return {
        "records": len(log.training), "evaluations": len(log.evals), "damaged_lines": len(log.damaged),
        "first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None,
        **figures,
        "cache_hit_rate_end": cache[-1][1] if cache else None, "cache_hit_rate_step": cache[-1][0] if cache else None,
        "cache_hit_rate_kind": {"data_cache_hit_rate": "per interval"}.get(cache_key, "cumulative") if cache_key else None,
        "resume_steps": list(log.resumes),
        **_mixture_summary(log),
    }


def _mixture_summary(log: RunLog) -> dict:
    """A mixture's realized share of each source over every logged interval (their samples summed), and its
    target weights at the last line; empty for a single dataset's log."""
    totals: dict[str, float] = {}
    target: dict[str, float] = {}
    for r in log.training:
        counts = r.get("source_interval_samples")
        if isinstance(counts, dict):
            for label, n in counts.items():
                if isinstance(label, str) and (v := number(n)) is not None and v >= 0:
                    totals[label] = totals.get(label, 0) + v
        weights = r.get("source_target_weights")
        if isinstance(weights, dict):
            target = {k: v for k, w in weights.items() if isinstance(k, str) and (v := number(w)) is not None}
    if not totals and not target:
        return {}
    total = math.fsum(totals.values())
    realized = {k: (n / total if total else None) for k, n in totals.items()}
    return {"source_realized_weights": realized, "source_target_weights_last": target}


def _fmt(value) -> str:
    if value is None:
        return NOT_RECORDED
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool) and not -10**16 < value < 10**16:
        digits = str(abs(value))             # (an int past the float range cannot go through :g)
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:6]}e+{len(digits) - 1}"
    return str(value)


def format_summary(summary: dict, png: str | None) -> str:
    """The text summary: one ``name: value`` line per figure."""
    s = summary
    cache = _fmt(s["cache_hit_rate_end"])
    if s["cache_hit_rate_end"] is not None:
        cache += f" ({s['cache_hit_rate_kind']}, step {s['cache_hit_rate_step']})"
    rows = [
        ("steps", f"{s['first_step']}..{s['last_step']} ({s['records']} training records)"),
        *((row, _fmt(s[key])) for key, row, _, _ in FIGURES),
        ("cache hit rate at end", cache),
        ("resume points", ", ".join(map(str, s["resume_steps"])) or "none"),
        ("damaged lines skipped", str(s["damaged_lines"])),
    ]
    if "source_realized_weights" in s:
        realized, target = s["source_realized_weights"], s["source_target_weights_last"]
        rows.append(("realized mixture", ", ".join(
            f"{label} {_fmt(share)} (target {_fmt(target.get(label))})" for label, share in realized.items())
            or NOT_RECORDED))
    if png is not None:
        rows.append(("png", png))
    return "\n".join(f"{name + ':':<24}{value}" for name, value in rows) + "\n"


# ------------------------------------------------------------------------------------------------ picture
def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError("resumable-stream report needs matplotlib to draw the picture: "
                          "pip install 'resumable-stream[report]'") from None
    return Figure, FigureCanvasAgg, MaxNLocator


def _line(ax, points, label, **style):
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker="." if len(points) < 60 else None,
                linewidth=1.2, **style)


def _not_recorded(ax, fields: str, why: str | None = None) -> None:
    ax.text(0.5, 0.5, why or f"{NOT_RECORDED} ({fields} absent from {LOG_NAME})", transform=ax.transAxes,
            ha="center", va="center", color="0.4")
    ax.set_yticks([])


def _why_empty(ax, why: str) -> None:
    """A panel whose fields were recorded but are empty by the nature of the run: it says why."""
    ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="0.3", fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "0.8", "alpha": 0.9})


def _panel(ax, lines, ylabel: str, fields: str, top: float | None = None, legend: bool = True,
           why: str | None = None) -> bool:
    """A panel of quantities that are never negative: ``lines`` of (points, label, style), or, when none has a
    point, a note that ``fields`` were not recorded (or ``why``). Whether something was drawn."""
    ax.set_ylabel(ylabel)
    if not any(points for points, _, _ in lines):
        _not_recorded(ax, fields, why)
        return False
    for points, label, style in lines:
        _line(ax, points, label, **style)
    _from_zero(ax, top=top)
    if legend:
        _legend(ax)
    return True


def _twin(ax, present, ylabel: str, lines, fields: str) -> list:
    """A second y axis with ``lines`` when ``present``, else a note that ``fields`` were not recorded."""
    if not present:
        ax.text(0.01, 0.95, f"{fields}: {NOT_RECORDED}", transform=ax.transAxes, ha="left", va="top",
                fontsize=8, color="0.4")
        return []
    twin = ax.twinx()
    for points, label, colour in lines:
        _line(twin, points, label, color=colour)
    twin.set_ylabel(ylabel)
    return [twin]


def _legend(*axes, loc: str = "upper right") -> None:
    handles, labels = [], []
    for ax in axes:
        h, la = ax.get_legend_handles_labels()
        handles += h
        labels += la
    if handles:
        axes[0].legend(handles, labels, loc=loc, fontsize=8)


def _title(log: RunLog, name: str) -> str:
    """How many records, over which steps (a record is logged every logging_steps), and the resumes."""
    n, first, last = len(log.training), log.training[0]["step"], log.training[-1]["step"]
    records = f"1 log record at step {first}" if n == 1 else f"{n} log records over steps {first}..{last}"
    resumed = f"resumed at step {', '.join(map(str, log.resumes))}" if log.resumes else "no resume"
    return f"{name}: {records}, {resumed}"


ZERO_MARGIN = 0.03    # below 0, as a share of the axis: a line of zeros shows above the frame, not on it


def _from_zero(ax, top: float | None = None) -> None:
    """A panel of quantities that are never negative starts at 0 (``top``: its fixed top, else the data's); one
    of zeros only gets 0..1, not matplotlib's -0.04..0.04 around its constant."""
    values = [v for line in ax.get_lines() for v in line.get_ydata()]
    if not values or min(values) < 0:
        return
    if top is None:
        top = 1.0 if max(values) == 0 else ax.get_ylim()[1]
    ax.set_ylim(-ZERO_MARGIN * top, top)


PANEL_IN = MIXTURE_FIGSIZE_IN[1] - FIGSIZE_IN[1]     # the height a seventh (or eighth) panel adds


def figure_size_px(log: RunLog, compared: bool = False) -> tuple[int, int]:
    """(width, height) of the picture: six panels, one more for a mixture, one more with --compare."""
    panels = (1 if log.sources() else 0) + (1 if compared else 0)
    return SIZE_PX[0], int((FIGSIZE_IN[1] + panels * PANEL_IN) * DPI)


def figure(log: RunLog, comparison=None):
    """The picture as a matplotlib Figure (Agg canvas): six panels over steps, one more for a mixture's weights and
    one with ``comparison``; resume points as dashed vertical lines on each."""
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()
    sources = log.sources()
    width, height = figure_size_px(log, comparison is not None)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(6 + (1 if sources else 0) + (1 if comparison is not None else 0), 1, sharex=True)
    name = os.path.basename(os.path.dirname(os.path.abspath(log.path)))
    fig.suptitle(_title(log, name) + (f"; compared with {comparison.name}" if comparison is not None else ""))

    ax = axes[0]
    _, loss = log.series("loss", drawn=True)
    _line(ax, loss, "loss", color=COLOURS["loss"])
    if comparison is not None:
        _, other = comparison.other.series("loss", drawn=True)
        _line(ax, other, f"loss of {comparison.name}".replace("$", r"\$"), color=COLOURS["compared_loss"],
              linestyle="--")
    evals = [(r["step"], v) for r in log.evals if (v := drawable(r.get("eval_loss"))) is not None]
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o", color=COLOURS["eval_loss"], label="eval_loss")
    if not loss and not evals:
        ax.text(0.5, 0.5, f"no loss to draw (not finite, or beyond +-{DRAW_LIMIT:g})", transform=ax.transAxes,
                ha="center", va="center", color="0.4")
    ax.set_ylabel("loss")
    _legend(ax)

    _, wait = log.series("data_wait_share", drawn=True)
    if not _panel(axes[1], [(wait, "data wait share", {"color": COLOURS["data_wait_share"]})], "data wait / step",
                  "data_wait_share", top=1.05, legend=False):
        axes[1].set_ylabel("data wait share")
    # the trainer's and the data path's samples/s: the same quantity, one axis
    _, trainer_rate = log.series("samples_per_s", drawn=True)
    _, data_rate = log.series("data_samples_per_s", drawn=True)
    _panel(axes[2], [(trainer_rate, "samples/s (trainer)", {"color": COLOURS["samples_per_s"]}),
                     (data_rate, "samples/s (data)", {"color": COLOURS["data_samples_per_s"], "linestyle": "--"})],
           "samples/s", "samples_per_s, data_samples_per_s")
    # its own panel: tokens/s follows samples/s, on a twin axis it would cover that line
    _, tokens = log.series("data_tokens_per_s", drawn=True)
    _panel(axes[3], [(tokens, "tokens/s (data)", {"color": COLOURS["data_tokens_per_s"]})], "tokens/s",
           "data_tokens_per_s")

    ax = axes[4]
    _, requests = log.series("data_requests", drawn=True)
    _, p50 = log.series("data_response_ms_p50", drawn=True)
    _, p99 = log.series("data_response_ms_p99", drawn=True)
    ax.set_ylabel("requests")
    if requests or p50 or p99:
        _line(ax, requests, "requests / interval", color=COLOURS["data_requests"], drawstyle="steps-mid")
        _from_zero(ax)
        local = not any(v for _, v in requests) and not (p50 or p99)    # recorded, and all zero
        twins = [] if local else _twin(
            ax, p50 or p99, "response ms", [(p50, "response p50 ms", COLOURS["data_response_ms_p50"]),
                                            (p99, "response p99 ms", COLOURS["data_response_ms_p99"])],
            "data_response_ms_p50/p99")
        for twin in twins:
            _from_zero(twin)
        _legend(ax, *twins)
        if local:
            _why_empty(ax, "no remote requests: the data is read from local files (requests and response times "
                           "count http(s), hf:// and s3:// reads)")
    else:
        _not_recorded(ax, "data_requests, data_response_ms_p50/p99")

    key, cache = log.series("data_cache_hit_rate", "cache_hit_rate_total", "cache_hit_rate", drawn=True)
    counted = log.series("data_cache_hits", "data_cache_misses", "cache_hits_total")[0] is not None
    _panel(axes[5], [(cache, "cache hit rate, " + ("per interval" if key == "data_cache_hit_rate" else "cumulative"),
                      {"color": COLOURS["cache_hit_rate"]})], "cache hit rate", "data_cache_hit_rate, cache_hit_rate",
           top=1.05, why="no block cache lookups: data.cache_dir is not set (the cache keeps the blocks of remote "
                         "data on local disk)" if counted else None)
    if sources:
        _mixture_panel(axes[6], log, sources)
    if comparison is not None:
        _comparison_panel(axes[-1], comparison)
    axes[-1].set_xlabel("step")

    steps = [r["step"] for r in log.training] + log.resumes
    if comparison is not None:
        steps += [r["step"] for r in comparison.other.training]
    lo, hi = min(steps), max(steps)
    pad = max(1.0, (hi - lo) * 0.02)
    axes[0].set_xlim(lo - pad, hi + pad)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for i, ax in enumerate(axes):
        for step in log.resumes:     # over the panel's lines (zorder), wide enough to survive a scaled-down view
            ax.axvline(step, color=RESUME_COLOUR, linestyle="--", linewidth=1.6, zorder=5,
                       label="resume" if i == 0 and step == log.resumes[0] else None)
        if i == 0 and log.resumes:
            _legend(ax)
        ax.grid(True, alpha=0.3)
    return fig


def _loss_difference(comparison, fmt=_fmt) -> str:
    largest = comparison.largest_loss_difference
    if largest is None:
        return "no step logged by both"
    if largest[1] == 0:
        return f"0 (equal losses at all {len(comparison.loss_diff)} steps)"
    return f"{fmt(largest[1])} (step {largest[0]})"


def comparison_rows(comparison) -> list[tuple[str, str]]:
    """The summary's lines about a :class:`~resumable_stream.app.compare_runs.Comparison`."""
    c = comparison
    rows = [("compared with", f"{c.other.path} ({len(c.loss_diff)} steps logged by both)"),
            ("loss difference max", _loss_difference(c))]
    if c.same_samples is None:
        rows.append(("same samples", "not recorded (a run without consumed/rank-*.jsonl: data.consumed_log)"))
    else:
        first = c.first_difference
        rows.append(("same samples", f"{sum(c.same_samples.values())} of {len(c.same_samples)} steps (ranks "
                     f"{', '.join(map(str, c.ranks)) or 'none'})"
                     + (f"; first difference at step {first}" if first is not None else "")))
    return rows


def _comparison_panel(ax, c) -> None:
    """Against the other run: the loss difference (this - other) at each step both logged and, on a second axis,
    whether the step consumed the same samples (1) or not (0)."""
    diff = [(s, v) for s, v in c.loss_diff if drawable(v) is not None]
    _line(ax, diff, f"loss - loss of {c.name}".replace("$", r"\$"), color=COLOURS["loss_difference"])
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_ylabel(f"vs {c.name}"[:40].replace("$", r"\$"))
    twins = []
    if c.same_samples:
        twin = ax.twinx()
        steps = sorted(c.same_samples)
        twin.plot(steps, [1.0 if c.same_samples[s] else 0.0 for s in steps], drawstyle="steps-mid",
                  color=COLOURS["same_samples"], linewidth=1.2, label="same consumed samples (1) / not (0)")
        differ = [s for s in steps if not c.same_samples[s]]
        if differ:
            twin.plot(differ, [0.0] * len(differ), "x", color=COLOURS["samples_differ"], label="samples differ")
        twin.set_ylim(-0.1, 1.4)           # room above "same" for the text
        twin.set_yticks([0, 1], ["differ", "same"])
        twins.append(twin)
    first = c.first_difference
    text = ("consumed samples: not recorded (no consumed/ log in one of the runs)" if c.same_samples is None
            else f"same consumed samples at {sum(c.same_samples.values())} of {len(c.same_samples)} steps"
            + (f" (first difference at step {first})" if first is not None else ""))
    text += "; loss difference max " + _loss_difference(c, lambda v: f"{v:.3g}")
    ax.text(0.01, 0.97, text.replace("$", r"\$"), transform=ax.transAxes, ha="left", va="top", fontsize=8,
            color="0.2")
    _legend(ax, *twins, loc="lower right")


def _mixture_panel(ax, log: RunLog, sources: list[str]) -> None:
    """Per source of a mixture: its realized share of each interval's samples (solid) and its target weight
    (dashed steps), in one colour."""
    for i, label in enumerate(sources[:MAX_SOURCES_DRAWN]):
        colour = SOURCE_COLOURS[i % len(SOURCE_COLOURS)]
        shown = label.replace("$", r"\$")      # a log's label is text, never matplotlib math
        _line(ax, log.source_series("source_realized_weights", label), f"{shown} realized", color=colour)
        _line(ax, log.source_series("source_target_weights", label), f"{shown} target", color=colour,
              linestyle="--", drawstyle="steps-post")
    if len(sources) > MAX_SOURCES_DRAWN:
        ax.text(0.01, 0.95, f"{len(sources) - MAX_SOURCES_DRAWN} more sources not drawn", transform=ax.transAxes,
                ha="left", va="top", fontsize=8, color="0.4")
    _from_zero(ax, top=1.05)
    ax.set_ylabel("mixture weight")
    _legend(ax)


def draw(log: RunLog, png: str, comparison=None) -> None:
    """Write the PNG of :func:`figure` (atomically), with what it was drawn from in its text metadata."""
    fig = figure(log, comparison)
    name = os.path.basename(os.path.dirname(os.path.abspath(log.path)))
    metadata = {
        "Title": f"resumable-stream report of {name}",
        META_PREFIX + "log": LOG_NAME,
        META_PREFIX + "log blake2b": log.digest,
        META_PREFIX + "records": str(len(log.training)),
        META_PREFIX + "resume steps": json.dumps(log.resumes),
    }
    if comparison is not None:
        metadata.update({META_PREFIX + "compared log": comparison.other.path,
                         META_PREFIX + "compared log blake2b": comparison.other.digest})
    tmp = os.path.join(os.path.dirname(os.path.abspath(png)), f".{os.path.basename(png)}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata=metadata)
        os.replace(tmp, png)
    except OSError as e:
        raise RunLogError(f"-o {png!r}: cannot be written: {e.strerror or e}") from None
    except (ValueError, OverflowError, FloatingPointError) as e:   # matplotlib could not lay the data out
        raise RunLogError(f"{log.path!r}: its records cannot be drawn ({type(e).__name__}: {e})") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def report(run_dir: str, png: str | None = None, out=None, err=None, comparison=None) -> dict:
    """Read RUN_DIR's log, draw ``png`` (default RUN_DIR/report.png) and print the summary on ``out`` (and the
    damaged-line warning on ``err``); ``comparison``: this run against another
    (:func:`resumable_stream.app.compare_runs.compare`), drawn and summarized beside it. Returns the summary's
    figures."""
    out, err = out or sys.stdout, err or sys.stderr
    log = comparison.log if comparison is not None else read_log(run_dir)
    if not log.training:
        raise RunLogError(f"{log.path!r}: no training lines (records with step and loss) to report"
                          + (f"; {len(log.damaged)} damaged lines skipped" if log.damaged else ""))
    if comparison is not None and not comparison.other.training:
        raise RunLogError(f"--compare: {comparison.other.path!r} has no training lines to compare")
    png = png or os.path.join(run_dir, DEFAULT_PNG)
    if os.path.isdir(png):
        raise RunLogError(f"-o {png!r}: a directory; give a file name such as {os.path.join(png, DEFAULT_PNG)!r}")
    parent = os.path.dirname(os.path.abspath(png))
    if not os.path.isdir(parent):
        raise RunLogError(f"-o {png!r}: its directory {parent!r} does not exist")
    if log.damaged:
        shown = ", ".join(map(str, log.damaged[:10])) + (", ..." if len(log.damaged) > 10 else "")
        print(f"resumable-stream: warning: {log.path}: {len(log.damaged)} damaged lines skipped (line {shown})",
              file=err)
    undrawn = log.undrawn()
    if undrawn:
        shown = ", ".join(f"{key} at step {step} ({_fmt(value)})" for key, step, value in undrawn[:10])
        print(f"resumable-stream: warning: {log.path}: {len(undrawn)} values not drawn (not finite, or beyond "
              f"+-{DRAW_LIMIT:g}): {shown}{', ...' if len(undrawn) > 10 else ''}", file=err)
    draw(log, png, comparison)
    summary = summarize(log)
    text = format_summary(summary, png)
    if comparison is not None:
        rows = comparison_rows(comparison)
        text += "".join(f"{name + ':':<24}{value}\n" for name, value in rows)
        summary["compared"] = dict(rows)
        summary["same_samples"] = comparison.same_samples
        summary["loss_difference"] = comparison.loss_diff
    out.write(text)
    out.flush()
    return summary
