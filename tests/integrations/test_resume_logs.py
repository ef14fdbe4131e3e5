"""On resume, consumed_log and train_log.jsonl are cut back to the resumed step line by line, by each
line's own step: a damaged line costs none of the others."""

import json
import logging

from resumable_stream.integrations.transformers.callbacks import truncate_jsonl


def _lines(steps):
    return [json.dumps({"step": s, "samples": [f"0:{s}"]}) + "\n" for s in steps]


def test_a_damaged_line_is_kept_with_a_warning_and_later_lines_survive(tmp_path, caplog):
    path = tmp_path / "rank-00000.jsonl"
    good = _lines(range(1, 9))
    damaged = '{"step": 4, "samp\x00\x00 les": [\n'
    not_a_record = '["step", 5]\n'
    path.write_text("".join(good[:3] + [damaged] + good[3:5] + [not_a_record] + good[5:]) + '{"step": 9, "sam')
    with caplog.at_level(logging.WARNING):
        truncate_jsonl(str(path), last_step=6)
    kept = path.read_text().splitlines(keepends=True)
    # steps 1..6 kept in order, both damaged lines kept where they were, steps 7, 8 and the cut line dropped
    assert kept == good[:3] + [damaged] + good[3:5] + [not_a_record] + [good[5]]
    warned = [r.getMessage() for r in caplog.records]
    assert sum("does not parse" in m for m in warned) == 2 and any("line 4" in m for m in warned)


def test_lines_after_the_resumed_step_are_dropped_even_after_a_damaged_line(tmp_path):
    path = tmp_path / "train_log.jsonl"
    path.write_text("".join(_lines([1, 2]) + ["garbage\n"] + _lines([3, 4, 5])))
    truncate_jsonl(str(path), last_step=3)
    assert path.read_text() == "".join(_lines([1, 2]) + ["garbage\n"] + _lines([3]))
