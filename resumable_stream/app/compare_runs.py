"""Two runs side by side, for ``resumable-stream report RUN --compare OTHER``: the losses at the steps both logged
and, where both kept ``consumed/rank-NNNNN.jsonl``, whether every rank consumed the same samples at each step.
Files are read as the report's log is (report.py): regular files inside the run directory, bounded."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import RunLogError
from .report import RunLog, number, read_log, read_log_bytes, records

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
        for _, rec, step in records(read_log_bytes(path, real)):
            if step is None or not isinstance(rec.get("samples"), list):
                out.damaged += 1
                continue
            steps[step] = rec["samples"]
        out.ranks[int(_RANK_FILE.fullmatch(name).group(1))] = steps
    return out


@dataclass
class Comparison:
    """This run (``log``) against ``other``: ``loss_diff`` (step, this - other) at the steps both logged a loss;
    ``same_samples`` step -> every rank both runs logged consumed the same samples (None: a run kept no consumed
    log); ``ranks``: the ranks compared. Drawn and summarized by report.py."""

    log: RunLog
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


def compare(run_dir: str, other_dir: str) -> Comparison:
    """RUN_DIR's run against OTHER_DIR's: their logs (report.read_log, with its checks) and consumed logs."""
    log, other = read_log(run_dir), read_log(other_dir)
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
    return Comparison(log, other, name, diff, same, ranks, damaged)
