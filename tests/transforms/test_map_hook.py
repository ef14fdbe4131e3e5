"""``data.map``: a user function of one row (a row, a list of rows or None) run before the built-in
transform in the DataLoader workers; exact resume inside a split row, errors following data.bad_sample,
the function's identity in the fingerprint, bad specs as ConfigErrors."""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import sys

import pytest
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import ConfigError, StreamMismatchError
from resumable_stream.loader import StreamLoader
from resumable_stream.transforms import TextProcessor, TransformConfig, TransformError

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
HOOK = "map_hooks:split_drop_rewrite"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


def _feed(tok, cfg, rows):
    proc = TextProcessor(tok, cfg)
    for r in rows:
        proc.feed(r, f"r{r['id']}")
    out = []
    while proc.ready():
        out.append(proc.take())
    return proc, out


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


# ---------------------------------------------------------------------------------------------- what it does
def test_map_splits_drops_and_rewrites_before_the_transform(tok):
    rows = [{"id": i, "text": f"w{i} alpha beta gamma delta epsilon zeta"} for i in (1, 3, 5, 7)]
    proc, out = _feed(tok, TransformConfig(map=HOOK, max_seq_len=64), rows)
    # 1: upper-cased; 3: three rows of two words, keys r3#0..2; 5: dropped; 7: upper-cased
    assert [ex["keys"] for ex in out] == [["r1"], ["r3#0"], ["r3#1"], ["r3#2"], ["r7"]]
    assert [ex["input_ids"] for ex in out] == [
        _ids(tok, "W1 ALPHA BETA GAMMA DELTA EPSILON ZETA"), _ids(tok, "w3 alpha"), _ids(tok, "beta gamma"),
        _ids(tok, "delta epsilon"), _ids(tok, "W7 ALPHA BETA GAMMA DELTA EPSILON ZETA")]
    assert proc.stats()["dropped_by_map"] == 1 and proc.stats()["samples"] == 4


def test_map_outputs_of_one_row_not_yet_taken_are_in_the_state(tok):
    cfg = TransformConfig(map=HOOK, max_seq_len=64)
    proc = TextProcessor(tok, cfg)
    proc.feed({"id": 3, "text": "a b c d e f"}, "r3")
    first = proc.take()
    resumed = TextProcessor(tok, cfg)
    resumed.load_state(proc.state())
    assert first["keys"] == ["r3#0"]
    assert [resumed.take()["keys"] for _ in range(resumed.ready())] == [["r3#1"], ["r3#2"]]


@pytest.mark.parametrize("spec,reason", [
    ("map_hooks:fails_on_seven", "data.map function 'map_hooks:fails_on_seven' raised ValueError: seven is not "
                                 "allowed"),
    ("map_hooks:returns_a_number", "data.map function 'map_hooks:returns_a_number' returned int; expected a row"),
])
def test_map_failures_name_the_sample_and_the_function_and_follow_bad_sample(tok, spec, reason):
    rows = [{"id": i, "text": f"text {i}"} for i in (6, 7)]
    with pytest.raises(TransformError) as ei:
        _feed(tok, TransformConfig(map=spec), rows)
    if "fails_on_seven" in spec:
        assert str(ei.value).startswith(f"sample 'r7': {reason}") and ei.value.key == "r7"
    else:
        assert str(ei.value).startswith(f"sample 'r6': {reason}")
    proc, out = _feed(tok, TransformConfig(map=spec, bad_sample="skip"), rows)
    skipped = 1 if "fails_on_seven" in spec else 2
    assert proc.stats()["skipped_bad"] == skipped and len(out) == 2 - skipped


@pytest.mark.parametrize("spec,needle", [
    ("map_hooks.split_drop_rewrite", "allowed: 'package.module:function'"),
    (":split", "allowed: 'package.module:function'"),
    (3, "data.map: got 3; allowed: null, 'package.module:function', or (from Python) a function"),
    ("no_such_module_rs:f", "module 'no_such_module_rs' not found"),
    ("map_hooks:nothing_here", "'map_hooks' has no attribute 'nothing_here'"),
    ("map_hooks:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
])
def test_bad_map_specs_are_config_errors_naming_the_key(spec, needle):
    with pytest.raises(ConfigError) as ei:
        TransformConfig.from_dict({"map": spec})
    assert str(ei.value).startswith("data.map: got") and needle in str(ei.value), str(ei.value)


def test_map_version_without_map_is_a_config_error():
    with pytest.raises(ConfigError, match="data.map_version: got 2 without data.map"):
        TransformConfig(map_version=2)


# ---------------------------------------------------------------------------------------------- fingerprint
def _write_module(directory, name: str, body: str) -> None:
    with open(os.path.join(directory, f"{name}.py"), "w", encoding="utf-8") as f:
        f.write(f"def hook(row):\n    {body}\n")


def test_a_changed_function_is_a_mismatch_unless_map_version_says_so(tok, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "rs_hook_under_test"
    _write_module(tmp_path, name, "return row")
    module = importlib.import_module(name)
    row = {"id": 1, "text": "one two three"}
    try:
        cfgs = {v: TransformConfig(map=f"{name}:hook", map_version=v, packing=True, max_seq_len=64)
                for v in (None, "v1")}
        states = {}
        for v, cfg in cfgs.items():
            proc = TextProcessor(tok, cfg)
            proc.feed(row, "r1")
            states[v] = proc.state()
        fp = TextProcessor(tok, cfgs[None]).fingerprint()["map"]
        assert fp["function"] == f"{name}:hook" and len(fp["source_digest"]) == 32
        assert TextProcessor(tok, cfgs["v1"]).fingerprint()["map"] == {"function": f"{name}:hook", "version": "v1"}

        _write_module(tmp_path, name, "return {'id': row['id'], 'text': row['text'] + ' changed'}")
        importlib.reload(module)
        with pytest.raises(StreamMismatchError, match=r"transform\.map: saved .*source_digest"):
            TextProcessor(tok, cfgs[None]).load_state(states[None])
        TextProcessor(tok, cfgs["v1"]).load_state(states["v1"])      # declared the same version: resumes
        with pytest.raises(StreamMismatchError, match=r"transform\.map: saved .*'version': 'v1'.*'version': 'v2'"):
            TextProcessor(tok, cfgs["v1"].replace(map_version="v2")).load_state(states["v1"])
    finally:
        sys.modules.pop(name, None)


def test_a_saved_state_never_imports_the_module_it_names(tok):
    proc = TextProcessor(tok, TransformConfig(map=HOOK, packing=True, max_seq_len=64))
    proc.feed({"id": 1, "text": "a b c"}, "r1")
    state = proc.state()
    state["meta"]["fingerprint"]["map"] = {"function": "rs_never_imported_module:f", "source_digest": "0" * 32}
    with pytest.raises(StreamMismatchError, match="rs_never_imported_module"):
        TextProcessor(tok, TransformConfig(map=HOOK, packing=True, max_seq_len=64)).load_state(state)
    assert "rs_never_imported_module" not in sys.modules


# ---------------------------------------------------------------------------------------------- exact resume
def _input_ids(batch):
    return [ex["input_ids"] for ex in batch]


def _loader(tok, workers: int) -> StreamLoader:
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(TINY, "data", "*.parquet"),
                       shuffle=True, buffer_size=64, num_partitions=2)
    stream = ResumableStream(cfg, num_workers=workers)
    factory = functools.partial(TextProcessor, tok, TransformConfig(map=HOOK, max_seq_len=64))
    return StreamLoader(stream, batch_size=5, collate_fn=_input_ids, processor_factory=factory, num_workers=workers,
                        keep_keys=True)


def _take(loader: StreamLoader, n: int) -> list[tuple[list, list]]:
    out = []
    for batch in itertools.islice(loader, n):
        out.append((loader.pop_consumed_keys(), batch))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_inside_a_split_row_is_exact(tok, tmp_path, workers):
    """Stop where the outputs of a split row straddle two batches; the resumed run continues with its
    remaining outputs and then exactly as the uninterrupted one."""
    ref = _take(_loader(tok, workers), 40)
    keys = [k for batch_keys, _ in ref for k in batch_keys]
    assert any(k.endswith("#1") for k in keys) and len(keys) == len(set(keys))
    cuts = [s for s in range(3, 30) if ref[s][0][-1].rsplit("#", 1)[-1] in ("0", "1")]
    assert cuts, "no batch ends inside a split row"
    for cut in cuts[:2]:
        first = _loader(tok, workers)
        assert _take(first, cut + 1) == ref[:cut + 1]
        path = first.save_sidecar(str(tmp_path / f"cut{cut}"))
        resumed = _loader(tok, workers)
        resumed.load_sidecar(path)
        rest = _take(resumed, 40 - cut - 1)
        assert rest == ref[cut + 1:], f"cut after batch {cut} ({ref[cut][0]})"
        # the row split across the cut continues with its next output in the next batch of its partition
        # (the two partitions take turns)
        key, part = ref[cut][0][-1].rsplit("#", 1)
        assert f"{key}#{int(part) + 1}" in rest[0][0] + rest[1][0]


def test_the_map_function_is_in_the_saved_stream_fingerprint(tok, tmp_path):
    loader = _loader(tok, 0)
    _take(loader, 3)
    path = loader.save_sidecar(str(tmp_path / "s"))
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(TINY, "data", "*.parquet"),
                       shuffle=True, buffer_size=64, num_partitions=2)
    other = StreamLoader(ResumableStream(cfg), batch_size=5, collate_fn=_input_ids,
                         processor_factory=functools.partial(TextProcessor, tok, TransformConfig(
                             map="map_hooks:fails_on_seven", max_seq_len=64)))
    with pytest.raises(StreamMismatchError, match="map_hooks:fails_on_seven"):
        other.load_sidecar(path)


def test_map_runs_before_the_vl_transform_too():
    import io

    from PIL import Image

    from resumable_stream.transforms import VLProcessor
    from resumable_stream.transforms.vl import load_processor

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    row = {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Red."}],
           "images": [{"bytes": buf.getvalue(), "path": None}]}
    processor = load_processor(os.path.join(TINY, "vl"))
    cfg = TransformConfig(format="vl", map="map_hooks:twice_unless_marked")
    proc = VLProcessor(processor, cfg)
    proc.feed(row, "a")
    proc.feed({**row, "drop": True}, "b")
    assert [proc.take()["keys"] for _ in range(proc.ready())] == [["a#0"], ["a#1"]]
    assert proc.stats()["dropped_by_map"] == 1
    assert proc.fingerprint()["map"]["function"] == "map_hooks:twice_unless_marked"
    with pytest.raises(TransformError, match=r"^sample 'c': data.map function 'map_hooks:twice_unless_marked' "
                                             r"raised RuntimeError: boom"):
        proc.feed({**row, "boom": True}, "c")
    skipping = VLProcessor(processor, cfg.replace(bad_sample="skip"))
    skipping.feed({**row, "boom": True}, "c")
    assert skipping.ready() == 0 and skipping.stats()["skipped_map"] == 1


# ---------------------------------------------------------------------------------------------- a function from Python
def _upper(row):
    return {**row, "text": row["text"].upper()}


def test_a_python_function_is_a_map_hook_fingerprinted_as_data_map_is(tok, tmp_path):
    """An existing `datasets` pipeline's ``.map(fn)`` moves over as ``TransformConfig(map=fn)``: the same rows as
    the named function, its name (module:qualname) and source digest in the fingerprint, a resume exact, and a
    changed function a mismatch naming it (unless map_version says it is the same)."""
    by_name = TransformConfig(map="test_map_hook:_upper", max_seq_len=64)
    by_function = TransformConfig(map=_upper, max_seq_len=64)
    rows = [{"id": i, "text": f"w{i} alpha beta"} for i in range(4)]
    assert _feed(tok, by_function, rows)[1] == _feed(tok, by_name, rows)[1]
    fp = TextProcessor(tok, by_function).fingerprint()["map"]
    assert fp["function"] == f"{__name__}:_upper" and len(fp["source_digest"]) == 32
    assert fp == TextProcessor(tok, by_name).fingerprint()["map"] | {"function": f"{__name__}:_upper"}

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(TINY, "data", "*.parquet"),
                       shuffle=True, buffer_size=64, num_partitions=2)

    def loader(fn, version=None):
        factory = functools.partial(TextProcessor, tok, TransformConfig(map=fn, map_version=version, max_seq_len=64))
        return StreamLoader(ResumableStream(cfg), batch_size=5, collate_fn=_input_ids, processor_factory=factory)

    ref = list(itertools.islice(loader(_upper), 8))
    first = loader(_upper)
    assert list(itertools.islice(first, 3)) == ref[:3]
    path = first.save_sidecar(str(tmp_path / "s"))
    resumed = loader(_upper)
    resumed.load_sidecar(path)
    assert list(itertools.islice(resumed, 5)) == ref[3:]

    def _upper_changed(row):
        return {**row, "text": row["text"].upper() + "!"}

    _upper_changed.__qualname__ = "_upper"        # the same name, other code: caught by the source digest
    with pytest.raises(StreamMismatchError, match=r"transform\.map\.source_digest: saved"):
        loader(_upper_changed).load_sidecar(path)
    same = loader(_upper, version="1")
    list(itertools.islice(same, 2))
    versioned = same.save_sidecar(str(tmp_path / "v"))
    loader(_upper_changed, version="1").load_sidecar(versioned)     # declared the same version: resumes
    with pytest.raises(ConfigError, match="data.map: got 3"):
        TransformConfig(map=3)
