"""Two runs side by side, for ``resumable-stream report RUN --compare OTHER``: the losses at the steps both logged
and, where both kept their consumed samples (``data.consumed_log: true``: ``RUN/consumed/rank-NNNNN.jsonl``),
whether every rank consumed the same samples at each step. A killed and resumed run compared with an
uninterrupted one: "the same as uninterrupted" as a picture (a loss difference of 0 and the same samples at
every step), or the first step where they part.

What is read is bounded as the report's log is (report.py): regular files inside the run directory (a link out
of it is refused), at most MAX_LOG_BYTES each; lines that do not parse are skipped and counted.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ..errors import RunLogError
from .report import RunLog, _read_bytes, _step, number, read_log

CONSUMED_DIR = "consumed"
_RANK_FILE = re.compile(r"rank-(\d{5})\.jsonl")
MAX_RANK_FILES = 4096


@dataclass
class Consumed:
    """A run's consumed log: per rank, step -> the sample keys of that step (a step logged twice: its last line)."""

    ranks: dict[int, dict[int, list]] = field(default_factory=dict)
    damaged: int = 0


def read_consumed(run_dir: str) -> Consumed | None:
    """``RUN_DIR/consumed/rank-*.jsonl``, or None when the run kept none there."""
    directory = os.path.join(run_dir, CONSUMED_DIR)
    if not os.path.isdir(directory):
        return None
    real_dir = os.path.realpath(run_dir)
    if os.path.commonpath([real_dir, os.path.realpath(directory)]) != real_dir:
        raise RunLogError(f"{directory!r}: a link outside the run directory; refused")
    names = sorted(n for n in os.listdir(directory) if _RANK_FILE.fullmatch(n))
    if len(names) > MAX_RANK_FILES:
        raise RunLogError(f"{directory!r}: {len(names)} rank files; allowed: at most {MAX_RANK_FILES}")
    out = Consumed()
    for name in names:
        path = os.path.join(directory, name)
        real = os.path.realpath(path)
        if os.path.commonpath([real_dir, real]) != real_dir:
            raise RunLogError(f"{path!r}: a link to {real!r}, outside the run directory; refused")
        steps: dict[int, list] = {}
        for raw in _read_bytes(path, real).split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8", errors="replace"))
            except (ValueError, RecursionError):
                rec = None
            step = _step(rec)
            if step is None or not isinstance(rec.get("samples"), list):
                out.damaged += 1
                continue
            steps[step] = rec["samples"]
        out.ranks[int(_RANK_FILE.fullmatch(name).group(1))] = steps
    return out


@dataclass
class Comparison:
    """This run against ``other``: ``loss_diff`` (step, this - other) at the steps both logged a loss;
    ``same_samples`` step -> every rank both runs logged consumed the same samples (None: a run kept no consumed
    log); ``ranks``: the ranks compared."""

    other: RunLog
    name: str
    loss_diff: list[tuple[int, float]]
    same_samples: dict[int, bool] | None
    ranks: list[int]
    damaged: int = 0

    @property
    def first_difference(self) -> int | None:
        return next((s for s, same in sorted((self.same_samples or {}).items()) if not same), None)

    @property
    def largest_loss_difference(self) -> tuple[int, float] | None:
        return max(self.loss_diff, key=lambda p: abs(p[1]), default=None)


def compare(run_dir: str, log: RunLog, other_dir: str) -> Comparison:
    other = read_log(other_dir)
    mine = {r["step"]: v for r in log.training if (v := number(r.get("loss"))) is not None}
    theirs = {r["step"]: v for r in other.training if (v := number(r.get("loss"))) is not None}
    diff = [(s, mine[s] - theirs[s]) for s in sorted(mine.keys() & theirs.keys())]
    a, b = read_consumed(run_dir), read_consumed(other_dir)
    same: dict[int, bool] | None = None
    ranks: list[int] = []
    damaged = 0
    if a is not None and b is not None:
        ranks = sorted(a.ranks.keys() & b.ranks.keys())
        damaged = a.damaged + b.damaged
        steps = sorted(set.intersection(*(set(a.ranks[r]) & set(b.ranks[r]) for r in ranks))) if ranks else []
        same = {s: all(a.ranks[r][s] == b.ranks[r][s] for r in ranks) for s in steps}
    name = os.path.basename(os.path.abspath(other_dir))
    return Comparison(other, name, diff, same, ranks, damaged)


def summary_rows(c: Comparison) -> list[tuple[str, str]]:
    """The summary's lines about the comparison."""
    from .report import _fmt

    rows = [("compared with", f"{c.other.path} ({len(c.loss_diff)} steps logged by both)"),
            ("loss difference max", _loss_difference(c, _fmt))]
    if c.same_samples is None:
        rows.append(("same samples", "not recorded (a run without consumed/rank-*.jsonl: data.consumed_log)"))
    else:
        n, same = len(c.same_samples), sum(c.same_samples.values())
        first = c.first_difference
        rows.append(("same samples", f"{same} of {n} steps (ranks {', '.join(map(str, c.ranks)) or 'none'})"
                     + (f"; first difference at step {first}" if first is not None else "")))
    return rows


def _loss_difference(c: Comparison, fmt) -> str:
    largest = c.largest_loss_difference
    if largest is None:
        return "no step logged by both"
    if largest[1] == 0:
        return f"0 (equal losses at all {len(c.loss_diff)} steps)"
    return f"{fmt(largest[1])} (step {largest[0]})"


def metadata(c: Comparison) -> dict[str, str]:
    return {"compared log": c.other.path, "compared log blake2b": c.other.digest}


def draw_panel(ax, c: Comparison, colours: dict[str, str]) -> None:
    """The loss difference (this - other) at each common step, and on a second axis whether the step consumed
    the same samples (1) or not (0)."""
    from .report import _legend, _line, drawable

    diff = [(s, v) for s, v in c.loss_diff if drawable(v) is not None]
    _line(ax, diff, f"loss - loss of {c.name}", color=colours["loss_difference"])
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_ylabel(f"vs {c.name}"[:40])
    twins = []
    if c.same_samples:
        twin = ax.twinx()
        steps = sorted(c.same_samples)
        values = [1.0 if c.same_samples[s] else 0.0 for s in steps]
        twin.plot(steps, values, drawstyle="steps-mid", color=colours["same_samples"], linewidth=1.2,
                  label="same consumed samples (1) / not (0)")
        differ = [s for s in steps if not c.same_samples[s]]
        if differ:
            twin.plot(differ, [0.0] * len(differ), "x", color=colours["samples_differ"], label="samples differ")
        twin.set_ylim(-0.1, 1.4)           # room above "same" for the text
        twin.set_yticks([0, 1], ["differ", "same"])
        twins.append(twin)
    n = len(c.same_samples or {})
    same = sum((c.same_samples or {}).values())
    first = c.first_difference
    text = ("consumed samples: not recorded (no consumed/ log in one of the runs)" if c.same_samples is None
            else f"same consumed samples at {same} of {n} steps"
            + (f" (first difference at step {first})" if first is not None else ""))
    text += "; loss difference max " + _loss_difference(c, lambda v: f"{v:.3g}")
    ax.text(0.01, 0.97, text, transform=ax.transAxes, ha="left", va="top", fontsize=8, color="0.2")
    _legend(ax, *twins, loc="lower right")

