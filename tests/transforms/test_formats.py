"""LLaMA-Factory's dataset formats: ``data.format: alpaca | sharegpt`` with ``data.columns`` / ``data.tags``,
turned into conversations the SFT transform trains on (loss on assistant turns only), on the bundled
examples ``tests/data/alpaca.jsonl`` and ``tests/data/sharegpt.jsonl``."""

from __future__ import annotations

import json
import os

import pytest
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream.errors import ConfigError, StreamMismatchError
from resumable_stream.transforms import IGNORE_INDEX, TextProcessor, TransformConfig, TransformError

ROOT = REPO_ROOT
DATA = os.path.join(ROOT, "tests", "data")
TOK_DIR = os.path.join(ROOT, "examples", "tiny", "tokenizer")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOK_DIR)


def _rows(name: str) -> list[dict]:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _encode(tok, cfg: TransformConfig, row: dict, key: str = "k") -> dict:
    proc = TextProcessor(tok, cfg)
    proc.feed(row, key)
    assert proc.ready() == 1, proc.stats()
    return proc.take()


def _trained_runs(tok, ex: dict) -> list[str]:
    """The decoded runs of consecutive labelled tokens."""
    runs, cur = [], []
    for t, label in zip(ex["input_ids"], ex["labels"]):
        if label == IGNORE_INDEX:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert label == t
            cur.append(t)
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def _chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


# ---------------------------------------------------------------------------------------------- alpaca
def test_alpaca_rows_render_and_train_only_the_responses(tok):
    rows = _rows("alpaca.jsonl")
    cfg = TransformConfig(format="alpaca", columns={"system": "system", "history": "history"}, max_seq_len=512)
    # row 0: system, instruction + input joined by a newline, output
    ex = _encode(tok, cfg, rows[0])
    assert tok.decode(ex["input_ids"]) == _chatml(("system", "You are a terse assistant."),
                                                  ("user", "Add the two numbers.\n3 and 11"),
                                                  ("assistant", "3 + 11 = 14."))
    assert _trained_runs(tok, ex) == ["3 + 11 = 14.<|im_end|>"]
    # row 3: a history pair before the current turn (both responses trained), empty input and system
    ex = _encode(tok, cfg, rows[3])
    assert tok.decode(ex["input_ids"]) == _chatml(("user", "Add the two numbers.\n24 and 50"),
                                                  ("assistant", "24 + 50 = 74."),
                                                  ("user", "And now multiply them."),
                                                  ("assistant", "24 x 50 = 1200."))
    assert _trained_runs(tok, ex) == ["24 + 50 = 74.<|im_end|>", "24 x 50 = 1200.<|im_end|>"]


def test_alpaca_equals_the_same_conversation_in_messages_form(tok):
    """Every bundled alpaca row gives exactly the tokens and labels of its conversation written as messages."""
    alpaca = TransformConfig(format="alpaca", columns={"system": "system", "history": "history"}, max_seq_len=512)
    messages = TransformConfig(format="messages", max_seq_len=512)
    for row in _rows("alpaca.jsonl"):
        conv = [{"role": "system", "content": row["system"]}] if row["system"] else []
        for q, a in row["history"]:
            conv += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        conv += [{"role": "user", "content": "\n".join(t for t in (row["instruction"], row["input"]) if t)},
                 {"role": "assistant", "content": row["output"]}]
        assert _encode(tok, alpaca, row) == _encode(tok, messages, {"messages": conv}), row["id"]


def test_alpaca_column_mapping(tok):
    row = {"q": "Say hi.", "ctx": "politely", "a": "Hello!", "sys": "Be kind."}
    cfg = TransformConfig(format="alpaca", columns={"prompt": "q", "query": "ctx", "response": "a", "system": "sys"})
    ex = _encode(tok, cfg, row)
    assert tok.decode(ex["input_ids"]) == _chatml(("system", "Be kind."), ("user", "Say hi.\npolitely"),
                                                  ("assistant", "Hello!"))
    assert _trained_runs(tok, ex) == ["Hello!<|im_end|>"]
    # the default query column (input) may be absent from a dataset
    ex = _encode(tok, TransformConfig(format="alpaca"), {"instruction": "Say hi.", "output": "Hello!"})
    assert tok.decode(ex["input_ids"]) == _chatml(("user", "Say hi."), ("assistant", "Hello!"))


@pytest.mark.parametrize("row,columns,needle", [
    ({"instruction": "x"}, None, "column 'output' (data.columns.response) is missing"),
    ({"output": "y"}, None, "column 'instruction' (data.columns.prompt) is missing"),
    ({"instruction": "x", "output": "y"}, {"system": "sys"}, "column 'sys' (data.columns.system) is missing"),
    ({"instruction": 3, "output": "y"}, None, "column 'instruction' (data.columns.prompt) holds int"),
    ({"instruction": "x", "output": "y", "h": [["only one"]]}, {"history": "h"},
     "column 'h' (data.columns.history) entry 0 is ['only one']"),
])
def test_alpaca_bad_rows_follow_bad_sample(tok, row, columns, needle):
    cfg = TransformConfig(format="alpaca", columns=columns)
    with pytest.raises(TransformError) as ei:
        TextProcessor(tok, cfg).feed(row, "file-3:17")
    assert "sample 'file-3:17'" in str(ei.value) and needle in str(ei.value) and ei.value.key == "file-3:17"
    proc = TextProcessor(tok, cfg.replace(bad_sample="skip"))
    proc.feed(row, "file-3:17")
    proc.feed({"instruction": "x", "output": "y", "sys": "", "h": []}, "ok")
    assert proc.ready() == 1 and proc.take()["keys"] == ["ok"]
    assert proc.stats()["skipped_bad"] == 1


def test_alpaca_empty_response_follows_data_empty(tok):
    row = {"instruction": "x", "output": ""}
    proc = TextProcessor(tok, TransformConfig(format="alpaca"))
    proc.feed(row, "k")
    assert proc.ready() == 0 and proc.stats()["skipped_empty"] == 1
    with pytest.raises(TransformError, match="sample 'k': the alpaca conversation has no assistant turn"):
        TextProcessor(tok, TransformConfig(format="alpaca", empty="error")).feed(row, "k")


# ---------------------------------------------------------------------------------------------- sharegpt
def test_sharegpt_rows_render_and_train_only_the_model_turns(tok):
    rows = _rows("sharegpt.jsonl")
    ex = _encode(tok, TransformConfig(format="sharegpt", max_seq_len=512), rows[0])
    call = '{"name": "add", "arguments": {"a": 2, "b": 7}}'
    assert tok.decode(ex["input_ids"]) == _chatml(
        ("system", "Answer in one line."), ("user", "Reverse the words: red blue sky"), ("assistant", "sky blue red"),
        ("user", "What is 2 + 7?"), ("assistant", call), ("tool", "9"), ("assistant", "2 + 7 = 9."))
    # replies and function calls are trained, the system prompt, user turns and tool results are not
    assert _trained_runs(tok, ex) == ["sky blue red<|im_end|>", f"{call}<|im_end|>", "2 + 7 = 9.<|im_end|>"]
    ex = _encode(tok, TransformConfig(format="sharegpt"), rows[1])
    assert tok.decode(ex["input_ids"]) == _chatml(("user", "Reverse the words: green slate sky"),
                                                  ("assistant", "sky slate green"))
    assert _trained_runs(tok, ex) == ["sky slate green<|im_end|>"]


def test_sharegpt_every_bundled_row_is_valid(tok):
    proc = TextProcessor(tok, TransformConfig(format="sharegpt", max_seq_len=512))
    rows = _rows("sharegpt.jsonl")
    for row in rows:
        proc.feed(row, str(row["id"]))
    assert proc.ready() == len(rows) and proc.stats()["skipped_empty"] == 0


def test_sharegpt_custom_tags_and_system_column(tok):
    """The OpenAI-style layout LLaMA-Factory reads with tags role/content/user/assistant."""
    row = {"msgs": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "sp": "Be brief."}
    cfg = TransformConfig(format="sharegpt", columns={"messages": "msgs", "system": "sp"},
                          tags={"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                "assistant_tag": "assistant"})
    ex = _encode(tok, cfg, row)
    assert tok.decode(ex["input_ids"]) == _chatml(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"))
    assert _trained_runs(tok, ex) == ["Hello<|im_end|>"]


@pytest.mark.parametrize("turns,needle", [
    ([{"from": "bot", "value": "x"}], "turn 0: 'from' is 'bot'; allowed: 'human', 'gpt', 'observation', "
                                      "'function_call', 'system' (data.tags)"),
    ([{"from": "gpt", "value": "x"}], "turn 0: 'gpt' out of order"),
    ([{"from": "human", "value": "x"}, {"from": "human", "value": "y"}], "turn 1: 'human' out of order"),
    ([{"from": "human", "value": "x"}], "ends with a user turn"),
    ([{"from": "human", "value": 5}, {"from": "gpt", "value": "y"}], "turn 0: 'value' holds int"),
    ([{"from": "human", "value": "x"}, {"from": "system", "value": "s"}, {"from": "gpt", "value": "y"}],
     "turn 1: a system turn is allowed only first"),
    ("not a list", "column 'conversations' (data.columns.messages) holds str"),
])
def test_sharegpt_bad_conversations_follow_bad_sample(tok, turns, needle):
    cfg = TransformConfig(format="sharegpt")
    with pytest.raises(TransformError) as ei:
        TextProcessor(tok, cfg).feed({"conversations": turns}, "shard-0:4")
    assert str(ei.value).startswith("sample 'shard-0:4': ") and needle in str(ei.value), str(ei.value)
    proc = TextProcessor(tok, cfg.replace(bad_sample="skip"))
    proc.feed({"conversations": turns}, "shard-0:4")
    assert proc.ready() == 0 and proc.stats()["skipped_bad"] == 1


def test_sharegpt_missing_column_names_it_and_the_sample(tok):
    with pytest.raises(TransformError, match=r"sample 'r9': column 'conversations' \(data.columns.messages\) is "
                                             r"missing; the row has 'messages'"):
        TextProcessor(tok, TransformConfig(format="sharegpt")).feed({"messages": []}, "r9")


# ---------------------------------------------------------------------------------------------- config, state
@pytest.mark.parametrize("section,needle", [
    ({"format": "text", "columns": {"prompt": "q"}}, "data.columns: got {'prompt': 'q'} with data.format 'text'"),
    ({"format": "alpaca", "columns": {"messages": "m"}}, "data.columns.messages: not a column of format 'alpaca'"),
    ({"format": "sharegpt", "columns": {"prompt": "q"}}, "data.columns.prompt: not a column of format 'sharegpt'"),
    ({"format": "alpaca", "columns": {"answer": "a"}}, "data.columns: got {'answer': 'a'}; allowed: null or a mapping"),
    ({"format": "alpaca", "columns": {"prompt": ""}}, "data.columns: got {'prompt': ''}"),
    ({"format": "alpaca", "tags": {"role_tag": "role"}}, "data.tags: got {'role_tag': 'role'} with data.format "
                                                          "'alpaca'; allowed only with format sharegpt"),
    ({"format": "sharegpt", "tags": {"speaker": "x"}}, "data.tags: got {'speaker': 'x'}; allowed: null or a mapping"),
    ({"format": "sharegpt", "tags": ["from"]}, "data.tags: got ['from']"),
    ({"format": "sharegpt", "tags": {"assistant_tag": "human"}}, "user_tag, assistant_tag have the same value"),
    ({"format": "alpacca"}, "data.format: got 'alpacca'; allowed: one of text, messages, vl, alpaca, sharegpt"),
])
def test_format_config_errors_name_the_key(section, needle):
    with pytest.raises(ConfigError) as ei:
        TransformConfig.from_dict(section)
    assert needle in str(ei.value), str(ei.value)


def test_columns_and_tags_are_in_the_fingerprint(tok):
    rows = _rows("sharegpt.jsonl")
    cfg = TransformConfig(format="sharegpt", packing=True, max_seq_len=32)
    proc = TextProcessor(tok, cfg)
    proc.feed(rows[0], "a")
    state = proc.state()
    fp = proc.fingerprint()
    assert fp["columns"] == {"messages": "conversations", "system": None}
    assert fp["tags"]["assistant_tag"] == "gpt"
    TextProcessor(tok, cfg).load_state(state)      # same settings: loads
    for other in (cfg.replace(tags={"assistant_tag": "bot"}), cfg.replace(columns={"messages": "turns"}),
                  cfg.replace(format="alpaca")):
        with pytest.raises(StreamMismatchError, match=r"transform\.(tags|columns|format)"):
            TextProcessor(tok, other).load_state(state)


def test_yaml_data_section_with_a_llamafactory_mapping(tmp_path):
    """The docs' dataset_info.json example, as a data section."""
    from resumable_stream.config.trainer import TrainerConfig

    doc = {"model": {"config": {"model_type": "qwen3"}, "tokenizer": TOK_DIR},
           "data": {"dataset_name_or_path": "json", "data_files": os.path.join(DATA, "sharegpt.jsonl"),
                    "format": "sharegpt", "columns": {"messages": "conversations"},
                    "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}},
           "train": {"output_dir": str(tmp_path), "max_steps": 1}}
    cfg = TrainerConfig.from_dict(doc)
    assert cfg.transform.format == "sharegpt" and cfg.transform.tags["user_tag"] == "human"
    assert cfg.stream.dataset_name_or_path == "json"


def test_trainer_column_check_names_the_formats_column(tmp_path):
    from resumable_stream.app.train import _check_columns
    from resumable_stream.config.trainer import TrainerConfig

    def trainer_cfg(**data):
        return TrainerConfig.from_dict({
            "model": {"config": {"model_type": "qwen3"}, "tokenizer": TOK_DIR},
            "data": {"dataset_name_or_path": "json", "data_files": os.path.join(DATA, "alpaca.jsonl"), **data},
            "train": {"output_dir": str(tmp_path), "max_steps": 1}})

    columns = ["id", "instruction", "input", "output"]
    _check_columns(trainer_cfg(format="alpaca"), columns)
    with pytest.raises(ConfigError, match=r"data.columns.prompt: got 'question'; the dataset's columns are: id, "):
        _check_columns(trainer_cfg(format="alpaca", columns={"prompt": "question"}), columns)
    with pytest.raises(ConfigError, match=r"data.columns.messages: got 'conversations'"):
        _check_columns(trainer_cfg(format="sharegpt"), columns)
    _check_columns(trainer_cfg(format="sharegpt", map="map_hooks:alpaca_from_text"), columns)   # map: not checked
