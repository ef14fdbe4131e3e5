"""``resumable-stream report RUN_DIR``: the PNG and the text summary of a run, drawn from its train_log.jsonl.

A real run (SIGKILLed after a checkpoint, then resumed) is reported and the picture is checked: its pixel size,
that something was drawn, and that its metadata names the very log bytes and resume steps it was drawn from.
The summary's figures are recomputed here from the log, and from a log written here with the per-interval
``data_*`` fields. Bad input is one line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
from repo_paths import REPO_ROOT

from resumable_stream.app.cli import main
from resumable_stream.app.compare_runs import compare
from resumable_stream.app.report import (
    LOG_NAME,
    META_PREFIX,
    RESUME_COLOUR,
    SIZE_PX,
    figure,
    format_summary,
    read_log,
    report,
    summarize,
)

ROOT = REPO_ROOT


def _summary(text: str) -> dict[str, str]:
    """The summary's ``name: value`` lines."""
    rows = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        rows[name.strip()] = value.strip()
    return rows


def _records(path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _write_log(directory, lines) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOG_NAME)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def _png_info(path):
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        return im.size, dict(im.info), len(colours)


def _data_record(step: int) -> dict:
    """A training line with the per-interval data fields (the contract of train_log.jsonl), numbers of ours."""
    no_requests = step % 4 == 0
    return {
        "step": step, "loss": 7.0 - 0.1 * step, "learning_rate": 1e-3, "samples_per_s": 100.0 + step, "epoch": 0.1,
        "data_wait_s": 0.01 * step, "data_step_s": 0.5, "data_wait_share": (step % 5) / 10,
        "data_samples_per_s": 200.0 + step, "data_tokens_per_s": 12_800.0 + 10 * step,
        "data_requests": 0 if no_requests else step, "data_bytes_read": 1000 * step, "data_retries": step % 2,
        "data_retry_causes": {"timeout": step % 2},
        "data_response_ms_p50": None if no_requests else 10.0 + step,
        "data_response_ms_p90": None if no_requests else 20.0 + step,
        "data_response_ms_p99": None if no_requests else 30.0 + 2 * step,
        "data_cache_hits": step, "data_cache_misses": 10 - step % 10,
        "data_cache_hit_rate": step / (step + 10 - step % 10),
        "data_prefetch_depth": 4, "data_epoch": step / 100,
        "data_ranks": [{"wait_share": (step % 5) / 10, "requests": step}],
    }


# ------------------------------------------------------------------------------------------------ a real run
@pytest.mark.slow
def test_report_of_a_killed_and_resumed_training_run(procs, tmp_path, capsys):
    from training_helpers import PAUSED_TRAIN, TRAIN_LM, complete_checkpoints, write_config

    config, out = write_config(str(tmp_path), "run", max_steps=16, save_steps=4, save_total_limit=None)
    pause = tmp_path / "pause"
    pause.mkdir()
    killed = procs.start(config, "killed", script=PAUSED_TRAIN,
                         env={"RS_TEST_PAUSE_AT": "10", "RS_TEST_PAUSE_DIR": str(pause)})
    killed.wait_until(lambda: (pause / "paused").exists(), "the run paused at step 10")
    killed.kill()
    resume_step = complete_checkpoints(out)[-1]
    assert resume_step == 8, complete_checkpoints(out)
    resumed = procs.start(config, "resumed", script=TRAIN_LM).wait_ok()
    assert f"resuming from {os.path.join(out, f'checkpoint-{resume_step}')}" in resumed.stderr

    log_file = os.path.join(out, LOG_NAME)
    records = _records(log_file)
    with open(log_file, "rb") as f:
        digest = hashlib.blake2b(f.read()).hexdigest()

    capsys.readouterr()
    assert main(["report", out]) == 0
    captured = capsys.readouterr()
    png = os.path.join(out, "report.png")
    size, info, colours = _png_info(png)
    assert size == SIZE_PX == (1000, 1500)
    assert colours >= 8, f"only {colours} colours: a blank picture"
    training = [r for r in records if "loss" in r]
    # the resumed run marked its first line with the checkpoint it started from
    marks = [(r["step"], r["resumed_from"]) for r in records if "resumed_from" in r]
    assert marks == [(resume_step + 1, f"checkpoint-{resume_step}")]
    resume_steps = [resume_step]
    assert info[META_PREFIX + "log blake2b"] == digest
    assert info[META_PREFIX + "log"] == LOG_NAME
    assert json.loads(info[META_PREFIX + "resume steps"]) == resume_steps
    assert int(info[META_PREFIX + "records"]) == len(training) == 16

    rows = _summary(captured.out)
    steps = [r["step"] for r in training]
    assert steps == list(range(1, 17)), "the resumed run's log is not steps 1..16 once each"
    assert rows["steps"] == f"{steps[0]}..{steps[-1]} ({len(training)} training records)"
    assert float(rows["first loss"]) == pytest.approx(training[0]["loss"], rel=1e-5)
    assert float(rows["last loss"]) == pytest.approx(training[-1]["loss"], rel=1e-5)
    rates = [r["samples_per_s"] for r in training if r.get("samples_per_s") is not None]
    assert float(rows["samples/s mean"]) == pytest.approx(sum(rates) / len(rates), rel=1e-5)
    waits = [r["data_wait_share"] for r in training if r.get("data_wait_share") is not None]
    if waits:   # the per-step data metrics (issue 23, item 1) are in the log
        assert float(rows["data wait share mean"]) == pytest.approx(sum(waits) / len(waits), rel=1e-5)
        assert float(rows["data wait share max"]) == pytest.approx(max(waits), rel=1e-5)
    else:
        assert rows["data wait share mean"] == "not recorded"
    assert rows["resume points"] == ", ".join(map(str, resume_steps))
    assert rows["png"] == png and rows["damaged lines skipped"] == "0"
    assert captured.err == ""


# ------------------------------------------------------------------------------------------- data fields
def test_summary_reports_the_per_interval_data_fields(tmp_path):
    steps = range(1, 21)
    recs = [_data_record(s) for s in steps]
    recs[10]["resumed_from"] = "checkpoint-10"
    _write_log(tmp_path / "run", [*recs[:10], {"step": 10, "eval_loss": 6.0}, *recs[10:]])
    log = read_log(str(tmp_path / "run"))
    assert log.resumes == [10] and len(log.evals) == 1 and len(log.training) == 20
    rows = _summary(format_summary(summarize(log), None))
    waits = [r["data_wait_share"] for r in recs]
    assert float(rows["data wait share mean"]) == pytest.approx(sum(waits) / len(waits))
    assert float(rows["data wait share max"]) == pytest.approx(0.4)
    assert int(rows["requests total"]) == sum(r["data_requests"] for r in recs)
    p99 = sorted(r["data_response_ms_p99"] for r in recs if r["data_response_ms_p99"] is not None)
    p50 = sorted(r["data_response_ms_p50"] for r in recs if r["data_response_ms_p50"] is not None)
    assert len(p99) == 15
    assert float(rows["response ms p99"]) == pytest.approx(p99[len(p99) // 2])   # median of an odd count
    assert float(rows["response ms p50"]) == pytest.approx(p50[len(p50) // 2])
    assert float(rows["data tokens/s mean"]) == pytest.approx(sum(r["data_tokens_per_s"] for r in recs) / 20)
    assert float(rows["data samples/s mean"]) == pytest.approx(sum(r["data_samples_per_s"] for r in recs) / 20)
    assert rows["cache hit rate at end"] == f"{recs[-1]['data_cache_hit_rate']:.6g} (per interval, step 20)"
    assert rows["resume points"] == "10"


def test_an_old_log_falls_back_to_the_cumulative_cache_hit_rate_and_says_what_is_not_recorded(tmp_path):
    recs = [{"step": s, "loss": 5.0 - s / 10, "learning_rate": 1e-3, "samples_per_s": None if s == 1 else 50.0,
             "cache_hits": s, "cache_misses": 3, "cache_hit_rate": s / (s + 3)} for s in range(1, 6)]
    recs[2]["samples_per_s"], recs[3]["samples_per_s"] = float("nan"), 10**400   # NaN, too large for a float
    _write_log(tmp_path / "run", recs)
    rows = _summary(format_summary(summarize(read_log(str(tmp_path / "run"))), None))
    assert rows["cache hit rate at end"] == f"{5 / 8:.6g} (cumulative, step 5)"
    assert float(rows["samples/s mean"]) == 50.0     # the null, NaN and huge values are not recorded, not zeros
    for name in ("data wait share mean", "data wait share max", "data tokens/s mean", "requests total",
                 "response ms p50", "response ms p99"):
        assert rows[name] == "not recorded", name
    assert rows["resume points"] == "none"


def test_the_cli_draws_and_summarizes_a_log_with_damaged_lines(tmp_path, capsys):
    """Damaged lines (not JSON, not a record, no int step, a cut last line) are skipped and counted, with one
    warning line; the picture goes where -o says, with the records it drew in its metadata."""
    recs = [_data_record(s) for s in range(1, 9)]
    damaged = ["garbage\x0c\u2028more", '["step", 4]', {"step": "5", "loss": 1.0}]   # one line each
    path = _write_log(tmp_path / "run", [*recs[:3], *damaged, *recs[3:], "[" * 100_000, {"step": 10**400, "loss": 1.0}])
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 9, "lo')
    png = str(tmp_path / "picture.png")
    assert main(["report", str(tmp_path / "run"), "-o", png]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "6 damaged lines skipped (line 4, 5, 6, 12, 13, 14)" in captured.err
    rows = _summary(captured.out)
    assert rows["damaged lines skipped"] == "6" and rows["steps"] == "1..8 (8 training records)"
    assert rows["png"] == png and not os.path.exists(tmp_path / "run" / "report.png")
    size, info, colours = _png_info(png)
    assert size == SIZE_PX and colours >= 8
    assert info[META_PREFIX + "records"] == "8" and json.loads(info[META_PREFIX + "resume steps"]) == []
    with open(path, "rb") as f:
        assert info[META_PREFIX + "log blake2b"] == hashlib.blake2b(f.read()).hexdigest()


# ------------------------------------------------------------------------------------------------ bad input
def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("resumable-stream: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert "Traceback" not in err
    return err


def test_a_missing_run_dir_or_log_is_an_error_naming_the_path(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    _fails(capsys, ["report", missing], missing, "not found")
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["report", str(tmp_path / "empty")], str(tmp_path / "empty" / LOG_NAME), "not found")
    (tmp_path / "file").write_text("x")
    _fails(capsys, ["report", str(tmp_path / "file")], str(tmp_path / "file"), "not a directory")
    _write_log(tmp_path / "junk", ["garbage", '{"step": 3, "eval_loss": 1.0}'])
    _fails(capsys, ["report", str(tmp_path / "junk")], "no training lines", "1 damaged lines skipped")
    _write_log(tmp_path / "ok", [_data_record(1)])
    _fails(capsys, ["report", str(tmp_path / "ok"), "-o", str(tmp_path / "no" / "dir.png")], "does not exist")


def test_a_log_outside_the_run_dir_or_not_a_regular_file_is_refused(tmp_path, capsys):
    outside = _write_log(tmp_path / "other", [_data_record(1)])
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / LOG_NAME)
    _fails(capsys, ["report", str(tmp_path / "run")], "outside the run directory")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / LOG_NAME)
    _fails(capsys, ["report", str(tmp_path / "fifo")], "not a regular file")
    # a link inside the run directory is followed
    (tmp_path / "inside").mkdir()
    _write_log(tmp_path / "inside" / "logs", [_data_record(1)])
    os.symlink(os.path.join("logs", LOG_NAME), tmp_path / "inside" / LOG_NAME)
    assert read_log(str(tmp_path / "inside")).training[0]["step"] == 1


@pytest.mark.slow   # a fresh interpreter importing the package (torch): ~2 s of CPU, like test_cli's subprocesses
def test_without_matplotlib_the_report_names_the_extra(tmp_path):
    run = tmp_path / "run"
    _write_log(run, [_data_record(1)])
    code = ("import sys; sys.modules['matplotlib'] = None; from resumable_stream.app.cli import main; "
            f"sys.exit(main(['report', {str(run)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("resumable-stream: error: resumable-stream report needs matplotlib to draw the "
                           "picture: pip install 'resumable-stream[report]'\n")
    assert not os.path.exists(run / "report.png")



# ------------------------------------------------------------------------------- any number the log holds
def _train_log(run_dir, lines, resumed_at: int = 0) -> str:
    """``train_log.jsonl`` written as a training run writes it: by TrainLogCallback itself (its json.dumps
    writes NaN, Infinity and -Infinity as such), one ``(step, the Trainer's logs)`` per line."""
    from types import SimpleNamespace

    from resumable_stream.integrations.transformers.callbacks import TrainLogCallback

    writer = TrainLogCallback(str(run_dir), samples_per_step=8)
    state = SimpleNamespace(is_world_process_zero=True, global_step=resumed_at)
    writer.on_train_begin(None, state, None)
    for step, logs in lines:
        state.global_step = step
        writer.on_log(None, state, None, logs=logs)
    return writer.path


def _reported(run_dir, capsys) -> tuple[dict[str, str], str]:
    """main(["report", RUN_DIR]) exits 0 and draws the picture: (the summary's rows, stderr)."""
    capsys.readouterr()
    code = main(["report", str(run_dir)])
    captured = capsys.readouterr()
    assert "unexpected error" not in captured.err and "Traceback" not in captured.err, captured.err
    assert code == 0, captured.err
    size, _, colours = _png_info(os.path.join(run_dir, "report.png"))
    assert size == SIZE_PX and colours >= 8
    return _summary(captured.out), captured.err


@pytest.mark.filterwarnings("error::RuntimeWarning")    # numpy's overflow warnings would be more stderr lines
@pytest.mark.parametrize("value", [1e308, -1e308, sys.float_info.max, float("inf"), float("-inf"), float("nan")],
                         ids=["1e308", "-1e308", "max", "inf", "-inf", "nan"])
def test_any_number_in_the_log_is_reported_and_what_cannot_be_drawn_is_named(tmp_path, capsys, value):
    """Issue 35: losses of +-1e308 made matplotlib's ticks overflow (`unexpected error: ValueError: arange`,
    exit 1). Each drawn field holds ``value`` as a constant series, and the loss goes from ``value`` to
    ``-value`` between ordinary losses: the picture is drawn from the other points, one warning line names
    the values left out, and the summary's means and medians do not overflow."""
    run = tmp_path / "run"
    plotted = ("data_wait_share", "data_samples_per_s", "data_tokens_per_s", "data_requests",
               "data_response_ms_p50", "data_response_ms_p99", "data_cache_hit_rate")
    losses = [1.0, value, -value, 2.0, value, 3.0]
    lines = [(step, {"loss": loss, "learning_rate": 1e-3, "epoch": 0.1, **{k: value for k in plotted}})
             for step, loss in enumerate(losses, 1)]
    path = _train_log(run, [*lines[:3], (3, {"eval_loss": value}), *lines[3:]])
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 7 and records[3] == {"step": 3, "eval_loss": value} or math.isnan(value)
    assert records[1]["loss"] == value or math.isnan(value) and math.isnan(records[1]["loss"])   # NaN as NaN
    rows, err = _reported(run, capsys)
    assert rows["steps"] == "1..6 (6 training records)" and rows["first loss"] == "1" and rows["last loss"] == "3"
    finite = math.isfinite(value)
    for name in ("data wait share mean", "data samples/s mean", "data tokens/s mean", "response ms p50",
                 "response ms p99"):
        assert rows[name] == (f"{value:.6g}" if finite else "not recorded"), name
    assert err.count("\n") == 1, err
    undrawn = 3 + 7 * 6 + 1     # three losses, seven constant fields of six lines, the eval loss
    shown = f"loss at step 2 ({value:.6g}), data_wait_share at step 2 ({value:.6g})"
    assert err.startswith(f"resumable-stream: warning: {path}: {undrawn} values not drawn (not finite, or beyond "
                          "+-1e+300): data_wait_share at step 1"), err
    assert shown in err and err.endswith(", ...\n"), err


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_single_point_a_constant_series_and_huge_step_numbers_are_drawn(tmp_path, capsys):
    one = tmp_path / "one"
    _train_log(one, [(1, {"loss": 2.5, "learning_rate": 0.0})])
    rows, err = _reported(one, capsys)
    assert rows["steps"] == "1..1 (1 training records)" and rows["first loss"] == "2.5" and err == ""
    last = 10**15                                   # the largest step read (MAX_STEP)
    huge = tmp_path / "huge"
    steps = [last - 4, last - 3, last - 1, last]
    _train_log(huge, [(s, {"loss": 1e300, "data_wait_share": 0.0, "data_requests": 7}) for s in steps],
               resumed_at=last - 5)
    rows, err = _reported(huge, capsys)
    assert rows["steps"] == f"{last - 4}..{last} (4 training records)" and err == ""
    assert rows["first loss"] == rows["last loss"] == "1e+300" and rows["requests total"] == "28"
    assert rows["resume points"] == str(last - 5)


def test_a_picture_that_cannot_be_laid_out_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """Whatever else matplotlib refuses to lay out is exit 2 and one line naming the log, not exit 1."""
    from matplotlib.figure import Figure

    def refuse(*args, **kwargs):
        raise ValueError("arange: cannot compute length")

    monkeypatch.setattr(Figure, "savefig", refuse)
    path = _train_log(tmp_path / "run", [(1, {"loss": 1.0})])
    _fails(capsys, ["report", str(tmp_path / "run")], f"{path!r}: its records cannot be drawn",
           "ValueError: arange: cannot compute length")
    assert os.listdir(tmp_path / "run") == [LOG_NAME]          # no picture, no temporary file left


# ------------------------------------------------------------------------------------------ the figure itself
def _local_run(run_dir):
    """20 records over steps 5..100 (logging_steps 5), resumed from checkpoint-50; a local run: 0 requests."""
    recs = []
    for step in range(5, 101, 5):
        rec = {**_data_record(step), "data_requests": 0, "data_response_ms_p50": None,
               "data_response_ms_p90": None, "data_response_ms_p99": None}
        if step == 55:
            rec["resumed_from"] = "checkpoint-50"
        recs.append(rec)
    _write_log(run_dir, recs)
    return figure(read_log(str(run_dir)))


def _series(fig):
    """(axes, label, colour) of every drawn series (not the resume lines)."""
    from matplotlib.colors import to_rgba

    return [(ax, line.get_label(), to_rgba(line.get_color())) for ax in fig.axes for line in ax.get_lines()
            if line.get_label() != "resume" and not line.get_label().startswith("_")]


def test_the_title_counts_records_over_steps(tmp_path):
    fig = _local_run(tmp_path / "run")
    assert fig.get_suptitle() == "run: 20 log records over steps 5..100, resumed at step 50"
    _write_log(tmp_path / "one", [_data_record(7)])
    assert figure(read_log(str(tmp_path / "one"))).get_suptitle() == "one: 1 log record at step 7, no resume"


def test_an_all_zero_panel_gets_an_axis_from_zero_and_rates_start_at_zero(tmp_path):
    fig = _local_run(tmp_path / "run")
    by_label = {label: ax for ax, label, _ in _series(fig)}
    assert by_label["requests / interval"].get_ylim() == (-0.03, 1.0)         # not -0.04..0.04
    assert by_label["data wait share"].get_ylim() == (-0.03 * 1.05, 1.05)     # a share, all zeros here too
    for label, most in (("samples/s (data)", 200 + 100), ("tokens/s (data)", 12_800 + 10 * 100)):
        low, high = by_label[label].get_ylim()
        assert low == -0.03 * high and high >= most, (label, low, high)


def test_data_samples_and_tokens_per_s_are_in_panels_of_their_own(tmp_path):
    """Proportional series on twin axes lie on one another: tokens/s gets its own panel."""
    fig = _local_run(tmp_path / "run")
    by_label = {label: ax for ax, label, _ in _series(fig)}
    samples, tokens = by_label["samples/s (data)"], by_label["tokens/s (data)"]
    assert samples is by_label["samples/s (trainer)"]
    assert samples.get_position().bounds != tokens.get_position().bounds, "the two share a panel"
    assert by_label["samples/s (data)"].get_lines()[1].get_linestyle() == "--"   # over the trainer's, visible


def test_every_series_has_its_own_colour_and_none_the_resume_lines(tmp_path):
    from matplotlib.colors import to_rgba

    recs = [_data_record(s) for s in range(1, 21)]
    recs[10]["resumed_from"] = "checkpoint-10"
    _write_log(tmp_path / "run", [*recs, {"step": 20, "eval_loss": 5.0}])
    fig = figure(read_log(str(tmp_path / "run")))
    series = _series(fig)
    labels = [label for _, label, _ in series]
    assert {"loss", "eval_loss", "data wait share", "samples/s (trainer)", "samples/s (data)", "tokens/s (data)",
            "requests / interval", "response p50 ms", "response p99 ms"} <= set(labels), labels
    colours = [colour for _, _, colour in series]
    assert len(set(colours)) == len(colours), list(zip(labels, colours))
    assert to_rgba(RESUME_COLOUR) not in colours
    resume_lines = [line for ax in fig.axes for line in ax.get_lines() if line.get_color() == RESUME_COLOUR]
    assert len(resume_lines) == 6 and all(list(line.get_xdata()) == [10, 10] for line in resume_lines)


# ------------------------------------------------------------------------------------------------ issue 49
def _panel_texts(ax) -> str:
    return " | ".join(t.get_text() for t in ax.texts)


def test_panels_empty_for_local_data_say_why(tmp_path):
    """A local run without a block cache: the requests and cache panels said only "not recorded", or drew zeros."""
    fig = _local_run(tmp_path / "run")
    by_ylabel = {ax.get_ylabel(): ax for ax in fig.axes}
    assert "no remote requests: the data is read from local files" in _panel_texts(by_ylabel["requests"])
    assert "response ms" not in by_ylabel     # no empty twin axis beside it
    recs = [{**_data_record(s), "data_cache_hits": 0, "data_cache_misses": 0, "data_cache_hit_rate": None}
            for s in range(1, 5)]
    _write_log(tmp_path / "nocache", recs)
    fig = figure(read_log(str(tmp_path / "nocache")))
    cache = next(ax for ax in fig.axes if ax.get_ylabel() == "cache hit rate")
    assert "no block cache lookups: data.cache_dir is not set" in _panel_texts(cache)


def test_the_resume_line_stays_on_every_panel_in_a_scaled_down_view(tmp_path):
    """At 896 pixels wide (a viewer fitting the picture) the data-wait panel's 1-pixel line vanished."""
    import numpy as np
    from PIL import Image

    fig = _local_run(tmp_path / "run")
    fig.canvas.draw()
    full = np.asarray(fig.canvas.buffer_rgba())[:, :, :3]
    height, width = full.shape[:2]
    scaled = np.asarray(Image.fromarray(full).resize((896, int(height * 896 / width)), Image.LANCZOS)).astype(int)
    x = fig.axes[0].transData.transform((50, 0))[0] * 896 / width
    for ax in fig.axes[:6]:
        _, y0, _, h = ax.get_position().bounds       # figure fractions, from the bottom
        top = int((1 - (y0 + h)) * scaled.shape[0]) + 3
        bottom = int((1 - y0) * scaled.shape[0]) - 3
        band = scaled[top:bottom, int(x) - 2:int(x) + 3]
        red = (band[:, :, 0] > 150) & (band[:, :, 1] < 110) & (band[:, :, 2] < 110)
        assert red.any(axis=1).mean() > 0.3, f"{ax.get_ylabel()}: the resume line is not visible scaled down"


def _run_with_consumed(directory, losses: dict[int, float], samples: dict[int, list], ranks=(0,), resume=None):
    recs = [{**_data_record(s), "loss": loss} for s, loss in losses.items()]
    if resume is not None:
        next(r for r in recs if r["step"] == resume + 1)["resumed_from"] = f"checkpoint-{resume}"
    _write_log(directory, recs)
    os.makedirs(os.path.join(directory, "consumed"), exist_ok=True)
    for rank in ranks:
        with open(os.path.join(directory, "consumed", f"rank-{rank:05d}.jsonl"), "w", encoding="utf-8") as f:
            for s, keys in samples.items():
                f.write(json.dumps({"step": s, "samples": [f"{rank}/{k}" for k in keys]}) + "\n")
    return str(directory)


def test_compare_draws_same_as_uninterrupted_as_a_picture(tmp_path, capsys):
    from PIL import Image

    losses = {s: 7.0 - 0.1 * s for s in range(1, 21)}
    samples = {s: [f"0:{s * 4 + i}" for i in range(4)] for s in range(1, 21)}
    ref = _run_with_consumed(tmp_path / "uninterrupted", losses, samples, ranks=(0, 1))
    resumed = _run_with_consumed(tmp_path / "resumed", losses, samples, ranks=(0, 1), resume=10)
    capsys.readouterr()
    assert main(["report", resumed, "--compare", ref]) == 0
    rows = _summary(capsys.readouterr().out)
    assert rows["compared with"] == f"{ref}/{LOG_NAME} (20 steps logged by both)"
    assert rows["loss difference max"] == "0 (equal losses at all 20 steps)"
    assert rows["same samples"] == "20 of 20 steps (ranks 0, 1)"
    with Image.open(os.path.join(resumed, "report.png")) as im:
        assert im.size == (1000, 1750)
        with open(os.path.join(ref, LOG_NAME), "rb") as f:
            assert im.info[META_PREFIX + "compared log blake2b"] == hashlib.blake2b(f.read()).hexdigest()
    fig = figure(read_log(resumed), compare(resumed, ref))
    assert "loss of uninterrupted" in [line.get_label() for line in fig.axes[0].get_lines()]
    assert "same consumed samples at 20 of 20 steps; loss difference max 0" in _panel_texts(fig.axes[6])


def test_compare_names_the_first_step_that_differs(tmp_path, capsys):
    losses = {s: 7.0 - 0.1 * s for s in range(1, 11)}
    samples = {s: [f"0:{s}"] for s in range(1, 11)}
    ref = _run_with_consumed(tmp_path / "a", losses, samples)
    other = _run_with_consumed(tmp_path / "b", {**losses, 7: losses[7] + 0.25, 8: losses[8] - 0.5},
                               {**samples, 7: ["0:99"], 9: ["0:98"]})
    summary = report(other, comparison=compare(other, ref), out=io.StringIO())
    assert summary["compared"]["same samples"] == "8 of 10 steps (ranks 0); first difference at step 7"
    assert summary["compared"]["loss difference max"] == "-0.5 (step 8)"
    assert [s for s, same in sorted(summary["same_samples"].items()) if not same] == [7, 9]


def test_compare_without_consumed_logs_and_with_hostile_ones(tmp_path, capsys):
    losses = {s: 1.0 for s in range(1, 4)}
    plain = tmp_path / "plain"
    _write_log(plain, [{**_data_record(s), "loss": v} for s, v in losses.items()])
    ref = _run_with_consumed(tmp_path / "ref", losses, {s: ["k"] for s in losses})
    capsys.readouterr()
    assert main(["report", str(plain), "--compare", ref]) == 0
    assert _summary(capsys.readouterr().out)["same samples"].startswith("not recorded")
    outside = _run_with_consumed(tmp_path / "outside", losses, {s: ["k"] for s in losses})
    link = tmp_path / "linked"
    _write_log(link, [{**_data_record(s), "loss": v} for s, v in losses.items()])
    os.symlink(os.path.join(outside, "consumed"), link / "consumed")
    assert main(["report", str(link), "--compare", ref]) == 2
    assert "a link outside the run directory; refused" in capsys.readouterr().err
    assert main(["report", ref, "--compare", str(tmp_path / "none")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "ref" / "consumed" / "rank-00001.jsonl").write_text('{"step": 1, "samples": "x"}\nnot json\n')
    assert main(["report", ref, "--compare", ref]) == 0      # damaged lines are skipped, not a traceback
