"""Text transform: config validation, text/packing/messages encoding, exact resume of the processor
state, fingerprints, collate, and the tiny offline assets (tokenizer, SFT data, a tiny Qwen3)."""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from transformers import AutoTokenizer

from resumable_stream.errors import ConfigError, ResumableStreamError, SidecarError, StreamMismatchError
from resumable_stream.transforms import IGNORE_INDEX, TextProcessor, TransformConfig, TransformError, collate

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
TOK_DIR = os.path.join(TINY, "tokenizer")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOK_DIR)


@pytest.fixture(scope="module")
def texts():
    rows = []
    for f in sorted(glob.glob(os.path.join(TINY, "data", "*.parquet"))):
        rows += pq.read_table(f, columns=["text"]).column("text").to_pylist()
    # docs of very different lengths: single rows and runs of 2..12 rows joined
    docs = []
    for i in range(120):
        k = 1 + (i * 7) % 12
        docs.append(" ".join(rows[i * 3:i * 3 + k]))
    return docs


@pytest.fixture(scope="module")
def convs():
    rows = []
    for f in sorted(glob.glob(os.path.join(TINY, "data_sft", "*.parquet"))):
        rows += pq.read_table(f).to_pylist()
    return rows


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _drain(proc):
    out = []
    while proc.ready():
        out.append(proc.take())
    return out


def _run(tok, cfg, samples):
    p = TextProcessor(tok, cfg)
    for key, s in samples:
        p.feed(s, key)
    return p, _drain(p)


# ---------------------------------------------------------------------------------------------- config
BAD_VALUES = [
    ("format", "chat", "one of text, messages"),
    ("format", None, "one of text, messages"),
    ("text_column", "", "non-empty column name"),
    ("text_column", 3, "non-empty column name"),
    ("messages_column", "  ", "non-empty column name"),
    ("max_seq_len", 7, "from 8 to 1000000"),
    ("max_seq_len", 1_000_001, "from 8 to 1000000"),
    ("max_seq_len", 512.0, "from 8 to 1000000"),
    ("max_seq_len", True, "from 8 to 1000000"),
    ("max_seq_len", "1024", "from 8 to 1000000"),
    ("packing", "yes", "true or false"),
    ("packing", 1, "true or false"),
    ("overlong", "split", "one of truncate, drop, error"),
    ("empty", "drop", "one of skip, error"),
    ("add_eos", None, "true or false"),
    ("id_column", "", "null or a non-empty column name"),
    ("id_column", 5, "null or a non-empty column name"),
    ("consumed_log", 0, "null or false (off), true (train.output_dir/consumed) or a directory"),
]


@pytest.mark.parametrize("key,value,allowed", BAD_VALUES)
def test_config_rejects_bad_values(key, value, allowed):
    with pytest.raises(ConfigError) as ei:
        TransformConfig.from_dict({"dataset_name_or_path": "parquet", key: value})
    msg = str(ei.value)
    assert msg.startswith(f"data.{key}: got {value!r}"), msg
    assert allowed in msg, msg


def test_config_defaults_and_own_keys_only():
    cfg = TransformConfig.from_dict({"dataset_name_or_path": "parquet", "buffer_size": 7, "format": "messages",
                                     "packing": True, "max_seq_len": 8, "consumed_log": "log.jsonl"})
    assert (cfg.format, cfg.packing, cfg.max_seq_len, cfg.consumed_log) == ("messages", True, 8, "log.jsonl")
    d = TransformConfig().to_dict()
    assert d == {"format": "text", "text_column": "text", "messages_column": "messages", "max_seq_len": 1024,
                 "packing": False, "packing_mode": "concat", "overlong": "truncate", "empty": "skip",
                 "add_eos": True, "id_column": None,
                 "consumed_log": None, "images_column": "images", "image_dir": None, "bad_sample": "error",
                 "max_image_bytes": 64 << 20, "allow_absolute_image_paths": False, "max_image_pixels": None,
                 "columns": None, "tags": None,
                 "map": None, "map_version": None}
    assert tuple(d) == TransformConfig.KEYS
    assert TransformConfig.from_dict(None) == TransformConfig()
    with pytest.raises(ConfigError, match=r"^data: got list"):
        TransformConfig.from_dict(["format"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_seq_len = 9


# ---------------------------------------------------------------------------------------------- text
def test_text_one_example_per_sample_with_eos(tok, texts):
    cfg = TransformConfig(max_seq_len=4096)
    p, out = _run(tok, cfg, [(f"k{i}", {"text": t}) for i, t in enumerate(texts[:20])])
    assert len(out) == 20
    for i, ex in enumerate(out):
        want = _ids(tok, texts[i]) + [tok.eos_token_id]
        assert ex["input_ids"] == want and ex["labels"] == want and ex["keys"] == [f"k{i}"]
    assert p.stats() == {"skipped_empty": 0, "dropped_overlong": 0, "truncated": 0, "samples": 20, "examples": 20,
                         "skipped_bad": 0, "dropped_by_map": 0}
    _, out2 = _run(tok, cfg.replace(add_eos=False), [("a", {"text": texts[0]})])
    assert out2[0]["input_ids"] == _ids(tok, texts[0])


def test_text_overlong_policies(tok, texts):
    short, long_ = texts[0], texts[5]  # 1 row (~15 tokens) and several rows
    n_long = len(_ids(tok, long_)) + 1
    assert len(_ids(tok, short)) + 1 <= 32 < n_long
    samples = [("s", {"text": short}), ("l", {"text": long_}), ("s2", {"text": short})]

    p, out = _run(tok, TransformConfig(max_seq_len=32, overlong="truncate"), samples)
    assert [e["keys"] for e in out] == [["s"], ["l"], ["s2"]]
    assert out[1]["input_ids"] == (_ids(tok, long_) + [tok.eos_token_id])[:32]
    assert out[1]["labels"] == out[1]["input_ids"]
    assert p.stats()["truncated"] == 1 and p.stats()["dropped_overlong"] == 0

    p, out = _run(tok, TransformConfig(max_seq_len=32, overlong="drop"), samples)
    assert [e["keys"] for e in out] == [["s"], ["s2"]]
    assert p.stats()["dropped_overlong"] == 1 and p.stats()["examples"] == 2 and p.stats()["samples"] == 3

    p = TextProcessor(tok, TransformConfig(max_seq_len=32, overlong="error"))
    p.feed(*samples[0][::-1])
    with pytest.raises(TransformError) as ei:
        p.feed(samples[1][1], "l")
    assert isinstance(ei.value, ResumableStreamError)
    assert "'l'" in str(ei.value) and str(n_long) in str(ei.value) and "32" in str(ei.value)
    assert ei.value.key == "l"

    # exactly max_seq_len is not over-long
    exact = TextProcessor(tok, TransformConfig(max_seq_len=n_long, overlong="error"))
    exact.feed({"text": long_}, "l")
    assert len(exact.take()["input_ids"]) == n_long


@pytest.mark.parametrize("value,what", [("", "empty"), ("  \n\t", "empty"), (None, "null"), ("<absent>", "missing")])
def test_text_empty_policies(tok, value, what):
    sample = {"id": 1} if value == "<absent>" else {"text": value}
    p, out = _run(tok, TransformConfig(), [("a", {"text": "hello"}), ("e", sample), ("b", {"text": "world"})])
    assert [e["keys"] for e in out] == [["a"], ["b"]]
    assert p.stats()["skipped_empty"] == 1 and p.stats()["samples"] == 3

    p = TextProcessor(tok, TransformConfig(empty="error", text_column="text"))
    with pytest.raises(TransformError) as ei:
        p.feed(sample, "e")
    assert "'e'" in str(ei.value) and "'text'" in str(ei.value) and what in str(ei.value)


def test_text_wrong_type_is_an_error(tok):
    p = TextProcessor(tok, TransformConfig())
    with pytest.raises(TransformError, match=r"sample 'x'.*holds int, expected a string"):
        p.feed({"text": 5}, "x")


def test_custom_text_column(tok):
    _, out = _run(tok, TransformConfig(text_column="body"), [("a", {"text": "no", "body": "yes please"})])
    assert out[0]["input_ids"] == _ids(tok, "yes please") + [tok.eos_token_id]


# ---------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("max_seq_len", [8, 13, 64, 500])
def test_packing_is_exact(tok, texts, max_seq_len):
    samples = [(f"k{i}", {"text": t}) for i, t in enumerate(texts)]
    samples.insert(7, ("empty", {"text": "  "}))
    p, out = _run(tok, TransformConfig(packing=True, max_seq_len=max_seq_len, overlong="error"), samples)
    stream = [t for i, txt in enumerate(texts) for t in _ids(tok, txt) + [tok.eos_token_id]]
    assert all(len(e["input_ids"]) == max_seq_len for e in out)
    assert all(e["labels"] == e["input_ids"] for e in out)
    got = [t for e in out for t in e["input_ids"]]
    carry = p.state()["tensors"]["carry_input_ids"].tolist()
    assert got + carry == stream  # nothing dropped, nothing reordered
    assert len(carry) < max_seq_len and len(out) == len(stream) // max_seq_len
    # keys: the samples that contributed tokens to each block, in order
    owner = [f"k{i}" for i, txt in enumerate(texts) for _ in range(len(_ids(tok, txt)) + 1)]
    for b, e in enumerate(out):
        want = []
        for k in owner[b * max_seq_len:(b + 1) * max_seq_len]:
            if not want or want[-1] != k:
                want.append(k)
        assert e["keys"] == want
    st_ = p.stats()
    assert st_["examples"] == len(out) and st_["skipped_empty"] == 1 and st_["truncated"] == 0
    # flush emits the carried tail as one shorter example
    p.flush()
    tail = _drain(p)
    assert [t for e in tail for t in e["input_ids"]] == carry and p.state()["tensors"]["carry_input_ids"].size == 0


def test_packing_long_doc_spans_blocks(tok, texts):
    doc = " ".join(texts[:30])
    n = len(_ids(tok, doc)) + 1
    p, out = _run(tok, TransformConfig(packing=True, max_seq_len=16, overlong="drop"), [("big", {"text": doc})])
    assert len(out) == n // 16 and all(e["keys"] == ["big"] for e in out)
    assert p.stats()["dropped_overlong"] == 0 and p.stats()["truncated"] == 0


# ---------------------------------------------------------------------------------------------- resume
def _roundtrip(state):
    """Through the sidecar formats: safetensors for tensors, JSON for meta."""
    b = st_save(state["tensors"], metadata={"meta": json.dumps(state["meta"])})
    return {"tensors": st_load(b), "meta": json.loads(json.dumps(state["meta"]))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(0, 60), max_seq_len=st.sampled_from([8, 9, 16, 31, 64, 200]), packing=st.booleans(),
       take_frac=st.floats(0, 1), fmt=st.sampled_from(["text", "messages"]))
def test_resume_is_exact(tok, texts, convs, k, max_seq_len, packing, take_frac, fmt):
    if fmt == "text":
        samples = [(f"t{i}", {"text": t}) for i, t in enumerate(texts[:60])]
        samples[3] = ("t3", {"text": ""})
    else:
        samples = [(f"c{r['id']}", r) for r in convs[:60]]
    cfg = TransformConfig(format=fmt, max_seq_len=max_seq_len, packing=packing, overlong="truncate")
    ref, ref_out = _run(tok, cfg, samples)

    a = TextProcessor(tok, cfg)
    for key, s in samples[:k]:
        a.feed(s, key)
    taken = [a.take() for _ in range(int(a.ready() * take_frac))]
    state = _roundtrip(a.state())
    b = TextProcessor(tok, cfg)
    b.load_state(state)
    for key, s in samples[k:]:
        b.feed(s, key)
    assert taken + _drain(b) == ref_out
    assert b.stats() == ref.stats()
    assert {n: v.tolist() for n, v in b.state()["tensors"].items()} == \
        {n: v.tolist() for n, v in ref.state()["tensors"].items()}


def test_state_is_int64_and_json(tok, texts):
    p = TextProcessor(tok, TransformConfig(packing=True, max_seq_len=47))
    for i, t in enumerate(texts[:9]):
        p.feed({"text": t}, f"k{i}")
    s = p.state()
    assert s["tensors"]["carry_input_ids"].size > 0 and s["tensors"]["pending_lengths"].size > 0
    assert all(isinstance(v, np.ndarray) and v.dtype == np.int64 and v.ndim == 1 for v in s["tensors"].values())
    assert json.loads(json.dumps(s["meta"])) == s["meta"]
    assert s["meta"]["stats"] == p.stats()


def test_load_state_rejects_other_settings_and_corrupt_state(tok, texts):
    cfg = TransformConfig(packing=True, max_seq_len=47)
    p = TextProcessor(tok, cfg)
    for i, t in enumerate(texts[:9]):
        p.feed({"text": t}, f"k{i}")
    s = p.state()
    assert s["tensors"]["carry_input_ids"].size > 0 and s["tensors"]["pending_lengths"].size > 0
    TextProcessor(tok, cfg).load_state(copy.deepcopy(s))  # the intact state loads
    other = TextProcessor(tok, cfg.replace(max_seq_len=64))
    with pytest.raises(StreamMismatchError) as ei:
        other.load_state(s)
    assert ("transform.max_seq_len", 47, 64) in ei.value.differences
    for name in ("carry_labels", "carry_input_ids", "pending_labels", "pending_lengths"):
        bad = copy.deepcopy(s)
        bad["tensors"][name] = bad["tensors"][name][:-1]
        with pytest.raises(SidecarError, match="inconsistent"):
            TextProcessor(tok, cfg).load_state(bad)
    bad = copy.deepcopy(s)
    bad["meta"]["carry_keys"].append("extra")
    with pytest.raises(SidecarError, match="inconsistent"):
        TextProcessor(tok, cfg).load_state(bad)
    bad = copy.deepcopy(s)
    bad["meta"]["version"] = 99
    with pytest.raises(SidecarError, match="version 99"):
        TextProcessor(tok, cfg).load_state(bad)
    with pytest.raises(SidecarError):
        TextProcessor(tok, cfg).load_state({"tensors": s["tensors"]})


# ---------------------------------------------------------------------------------------------- messages
def _labelled_runs(tok, ex):
    runs, cur = [], []
    for t, lab in zip(ex["input_ids"], ex["labels"]):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_messages_labels_are_exactly_assistant_turns(tok, convs):
    cfg = TransformConfig(format="messages", max_seq_len=4096)
    p, out = _run(tok, cfg, [(str(r["id"]), r) for r in convs[:300]])
    assert len(out) == 300
    for r, ex in zip(convs, out):
        msgs = r["messages"]
        assert ex["keys"] == [str(r["id"])]
        assert ex["input_ids"] == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert _labelled_runs(tok, ex) == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
        # cross-check with transformers' own mask from the template's {% generation %} markers
        mask = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)["assistant_masks"]
        assert [int(lab != IGNORE_INDEX) for lab in ex["labels"]] == list(mask)
        # no system/user text is ever labelled
        unlabelled = tok.decode([t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab == IGNORE_INDEX])
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"] in unlabelled
    assert p.stats()["examples"] == 300


def test_messages_tricky_contents(tok):
    # assistant content equal to role/header words, and repeated from the user turn
    msgs = [{"role": "system", "content": "assistant"},
            {"role": "user", "content": "yes"},
            {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "assistant"},
            {"role": "assistant", "content": "assistant"}]
    _, out = _run(tok, TransformConfig(format="messages"), [("t", {"messages": msgs})])
    assert _labelled_runs(tok, out[0]) == ["yes<|im_end|>", "assistant<|im_end|>"]
    mask = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)["assistant_masks"]
    assert [int(lab != IGNORE_INDEX) for lab in out[0]["labels"]] == list(mask)


QWEN3_LIKE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a bot.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_messages_labels_with_a_qwen3_like_template(convs):
    tok2 = AutoTokenizer.from_pretrained(TOK_DIR)
    tok2.chat_template = QWEN3_LIKE  # default system prompt; last turn rendered differently from a prefix
    _, out = _run(tok2, TransformConfig(format="messages"), [(str(r["id"]), r) for r in convs[:100]])
    for r, ex in zip(convs, out):
        want = [m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"]
        assert _labelled_runs(tok2, ex) == want
        assert "You are a bot." in tok2.decode(ex["input_ids"]) or r["messages"][0]["role"] == "system"


QWEN25_LIKE = (  # indexes messages[0] (fails on an empty conversation) and injects a default system prompt
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant. Start here.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("first", ["helpful", "a", "Start here.", "You are"])
def test_a_conversation_opened_by_the_assistant_is_not_labelled_inside_the_system_prompt(first):
    tok2 = AutoTokenizer.from_pretrained(TOK_DIR)
    tok2.chat_template = QWEN25_LIKE
    msgs = [{"role": "assistant", "content": first}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "fine"}]
    _, out = _run(tok2, TransformConfig(format="messages"), [("k", {"messages": msgs})])
    assert _labelled_runs(tok2, out[0]) == [first + "<|im_end|>", "fine<|im_end|>"]


def test_messages_template_without_end_of_turn_token():
    # the next turn's opening token directly follows the content: it is not an end-of-turn marker
    tok2 = AutoTokenizer.from_pretrained(TOK_DIR)
    tok2.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '\\n' }}"
                          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    msgs = [{"role": "user", "content": "q one"}, {"role": "assistant", "content": "a one"},
            {"role": "user", "content": "q two"}, {"role": "assistant", "content": "a two"}]
    _, out = _run(tok2, TransformConfig(format="messages"), [("t", {"messages": msgs})])
    assert _labelled_runs(tok2, out[0]) == ["a one", "a two"]


def test_messages_template_that_is_not_prefix_stable():
    # the rendering of a prefix is never a prefix of the whole (the header counts the messages):
    # contents are then located in order, so the user's "yes" is not taken for the assistant's
    tok2 = AutoTokenizer.from_pretrained(TOK_DIR)
    tok2.chat_template = ("{{- '<|im_start|>system\\n' + (messages|length|string) + '<|im_end|>\\n' }}"
                          "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    msgs = [{"role": "user", "content": "yes"}, {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "no way"}, {"role": "assistant", "content": "no"}]
    _, out = _run(tok2, TransformConfig(format="messages"), [("t", {"messages": msgs})])
    assert _labelled_runs(tok2, out[0]) == ["yes<|im_end|>", "no<|im_end|>"]
    ids = out[0]["input_ids"]
    first = ids.index(tok2.convert_tokens_to_ids("<|im_start|>"), 3)  # the user turn
    assert all(lab == IGNORE_INDEX for lab in out[0]["labels"][:first + 4])


def test_messages_overlong(tok, convs):
    conv = max(convs[:200], key=lambda r: len(r["messages"]))  # 3 rounds
    msgs = conv["messages"]
    full = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    first_a = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    head = len(tok.apply_chat_template(msgs[:first_a], tokenize=True, return_dict=True,
                                       add_generation_prompt=True)["input_ids"])
    cut = head + 2  # keeps 2 tokens of the first assistant answer
    assert cut < len(full)

    p, out = _run(tok, TransformConfig(format="messages", max_seq_len=cut), [("c", conv)])
    assert out[0]["input_ids"] == full[:cut] and len(out[0]["labels"]) == cut
    assert sum(lab != IGNORE_INDEX for lab in out[0]["labels"]) == 2
    assert p.stats()["truncated"] == 1

    # truncation that removes every assistant token: dropped and counted
    p, out = _run(tok, TransformConfig(format="messages", max_seq_len=max(8, head - 1)), [("c", conv)])
    assert out == [] and p.stats()["dropped_overlong"] == 1 and p.stats()["truncated"] == 0

    p, out = _run(tok, TransformConfig(format="messages", max_seq_len=cut, overlong="drop"), [("c", conv)])
    assert out == [] and p.stats()["dropped_overlong"] == 1

    with pytest.raises(TransformError, match=rf"sample 'c': {len(full)} tokens.*max_seq_len {cut}"):
        _run(tok, TransformConfig(format="messages", max_seq_len=cut, overlong="error"), [("c", conv)])

    # with packing, a long conversation spans blocks and keeps per-token labels
    p, out = _run(tok, TransformConfig(format="messages", max_seq_len=16, packing=True), [("c", conv)])
    full_labels = _run(tok, TransformConfig(format="messages", max_seq_len=4096), [("c", conv)])[1][0]["labels"]
    p.flush()
    out += _drain(p)
    assert [t for e in out for t in e["input_ids"]] == full
    assert [t for e in out for t in e["labels"]] == full_labels
    assert all(len(e["input_ids"]) == 16 for e in out[:-1])


@pytest.mark.parametrize("messages", [
    None, [], [{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
])
def test_messages_empty_policies(tok, messages):
    sample = {} if messages is None else {"messages": messages}
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    p, out = _run(tok, TransformConfig(format="messages"), [("a", ok), ("e", sample), ("b", ok)])
    assert [e["keys"] for e in out] == [["a"], ["b"]] and p.stats()["skipped_empty"] == 1
    with pytest.raises(TransformError, match=r"sample 'e'.*'messages'"):
        _run(tok, TransformConfig(format="messages", empty="error"), [("e", sample)])


@pytest.mark.parametrize("messages", ["hello", [{"content": "x"}], [{"role": "user", "content": 3}]])
def test_messages_malformed_is_an_error(tok, messages):
    with pytest.raises(TransformError, match=r"sample 'm'"):
        _run(tok, TransformConfig(format="messages"), [("m", {"messages": messages})])


# ---------------------------------------------------------------------------------------------- fingerprint
def test_fingerprint(tok):
    base = TransformConfig(format="text", max_seq_len=64)
    fp = TextProcessor(tok, base).fingerprint()
    assert json.loads(json.dumps(fp)) == fp
    assert TextProcessor(tok, base.replace(consumed_log="x.jsonl")).fingerprint() == fp
    assert TextProcessor(tok, base.replace(messages_column="conv")).fingerprint() == fp  # unused by format text
    for change in [dict(max_seq_len=65), dict(packing=True), dict(add_eos=False), dict(text_column="body"),
                   dict(overlong="drop"), dict(empty="error"), dict(id_column="id"), dict(format="messages")]:
        assert TextProcessor(tok, base.replace(**change)).fingerprint() != fp, change
    # transient truncation settings on the backend do not change identity
    tok("some text", truncation=True, max_length=3)
    assert TextProcessor(tok, base).fingerprint() == fp
    # another tokenizer: different chat template, an added token, different merges
    t2 = AutoTokenizer.from_pretrained(TOK_DIR)
    t2.chat_template = QWEN3_LIKE
    assert TextProcessor(t2, base).fingerprint()["tokenizer"] != fp["tokenizer"]
    t3 = AutoTokenizer.from_pretrained(TOK_DIR)
    t3.add_tokens(["<extra>"])
    assert TextProcessor(t3, base).fingerprint()["tokenizer"] != fp["tokenizer"]
    assert TextProcessor(AutoTokenizer.from_pretrained(TOK_DIR), base).fingerprint() == fp


# ---------------------------------------------------------------------------------------------- collate
def test_collate_pads_right():
    exs = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "keys": ["a"]},
           {"input_ids": [9], "labels": [9], "keys": ["b", "c"]}]
    b = collate(exs, pad_token_id=0)
    assert set(b) == {"input_ids", "labels", "attention_mask"}
    assert all(v.dtype == torch.int64 for v in b.values())
    assert b["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [9, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError):
        collate([], 0)


# ---------------------------------------------------------------------------------------------- assets
QWEN3_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)


def test_tiny_tokenizer_assets(tok):
    assert tok.is_fast and tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok.all_special_tokens)
    assert 900 <= len(tok) <= 1100
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = "row 7: stream resume shard"
    assert tok.decode(_ids(tok, text)) == text
    sizes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(TOK_DIR, "*")))
    assert sizes < 100_000
    t = pq.read_table(os.path.join(TINY, "data_sft"))
    assert t.num_rows == 1000 and t.column_names == ["id", "messages"]
    assert t.column("id").to_pylist() == list(range(1000))


def test_tiny_qwen3_forward_with_collated_batch(tok, convs):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, **QWEN3_TINY)
    model = AutoModelForCausalLM.from_config(cfg)
    _, out = _run(tok, TransformConfig(format="messages", max_seq_len=128), [(str(r["id"]), r) for r in convs[:4]])
    batch = collate(out, tok.pad_token_id)
    res = model(**batch)
    assert res.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(res.loss) and res.loss.item() > 0


def test_make_assets_is_deterministic_and_committed_outputs_match():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(TINY, "make_assets.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "up to date" in r.stdout


def test_packing_names_a_document_once_per_block_it_fills(tok):
    """What docs/training.md says of the consumed log with packing: a block's keys are every document with tokens
    in it, so a long document's key repeats, block after block (and so step after step)."""
    p = TextProcessor(tok, TransformConfig(max_seq_len=16, packing=True))
    for key, words in (("k0", 3), ("k1", 30), ("k2", 4), ("k3", 5)):
        p.feed({"text": " ".join(["stream"] * words)}, key)
    blocks = []
    while p.ready():
        blocks.append(p.take()["keys"])
    assert blocks[0][0] == "k0" and all("k1" in b for b in blocks[:3]), blocks
    assert [k for b in blocks for k in b].count("k1") >= 2 and blocks[-1][-1] == "k3"
