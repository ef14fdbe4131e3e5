"""Per-source transform settings in a mixture (``data.sources[i].format / columns / tags / map / ...``): a
plain-text corpus and an alpaca corpus mixed into one stream, each transformed its own way, resumed
exactly, with every source's settings in the fingerprint."""

from __future__ import annotations

import functools
import itertools
import os

import pytest
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream import StreamConfig
from resumable_stream.errors import ConfigError, StreamMismatchError
from resumable_stream.loader import StreamLoader
from resumable_stream.stream.mixture import open_stream
from resumable_stream.transforms import IGNORE_INDEX, TextProcessor, TransformConfig

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
ALPACA = os.path.join(ROOT, "tests", "data", "alpaca.jsonl")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


def _section(**alpaca_overrides) -> dict:
    alpaca = {"label": "chat", "dataset_name_or_path": "json", "data_files": ALPACA, "weight": 1,
              "format": "alpaca", "columns": {"system": "system", "history": "history"}, **alpaca_overrides}
    return {"sources": [{"label": "lm", "dataset_name_or_path": "parquet",
                         "data_files": os.path.join(TINY, "data", "*.parquet"), "weight": 1}, alpaca],
            "stopping": "all_exhausted", "shuffle": True, "buffer_size": 32, "num_partitions": 1,
            "format": "text", "max_seq_len": 96, "id_column": "id"}


def _examples(batch):
    return [(ex["input_ids"], ex["labels"]) for ex in batch]


def _loader(tok, section: dict) -> StreamLoader:
    stream = open_stream(StreamConfig.from_dict(section))
    factory = functools.partial(TextProcessor, tok, TransformConfig.from_dict(section))
    return StreamLoader(stream, batch_size=4, collate_fn=_examples, processor_factory=factory, keep_keys=True)


def _batches(loader: StreamLoader, n: int) -> list:
    out = []
    for batch in itertools.islice(loader, n):
        out.append((loader.pop_consumed_keys(), batch))
    return out


def test_each_source_is_transformed_its_own_way(tok):
    out = _batches(_loader(tok, _section()), 12)
    examples = [(k, ids, labels) for keys, batch in out for k, (ids, labels) in zip(keys, batch)]
    chat = [e for e in examples if e[0].startswith("chat/")]
    text = [e for e in examples if e[0].startswith("lm/")]
    assert len(chat) >= 8 and len(text) >= 8, [e[0] for e in examples]
    for key, ids, labels in text:      # plain text: every token trained, EOS appended
        assert labels == ids and ids[-1] == tok.eos_token_id, key
    for key, ids, labels in chat:      # alpaca: a chat-template rendering, only the responses trained
        rendered = tok.decode(ids)
        assert rendered.startswith("<|im_start|>") and "<|im_start|>user\n" in rendered, key
        trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
        assert trained.endswith("<|im_end|>") and "<|im_start|>" not in trained, key
        assert IGNORE_INDEX in labels


def test_mixture_with_per_source_transforms_resumes_exactly(tok, tmp_path):
    section = _section()
    ref = _batches(_loader(tok, section), 24)
    first = _loader(tok, section)
    assert _batches(first, 9) == ref[:9]
    path = first.save_sidecar(str(tmp_path / "state"))
    resumed = _loader(tok, section)
    resumed.load_sidecar(path)
    assert _batches(resumed, 15) == ref[9:]


@pytest.mark.parametrize("change", [{"columns": {"system": "system"}}, {"format": "sharegpt", "columns": None},
                                    {"map": "map_hooks:fails_on_seven"}])
def test_per_source_settings_are_in_the_fingerprint(tok, tmp_path, change):
    loader = _loader(tok, _section())
    _batches(loader, 3)
    path = loader.save_sidecar(str(tmp_path / "state"))
    fp = TextProcessor(tok, TransformConfig.from_dict(_section())).fingerprint()
    assert fp["sources"] == {"chat": {"format": "alpaca", "columns": {
        "prompt": "instruction", "query": "input", "response": "output", "system": "system", "history": "history"}}}
    other = _loader(tok, _section(**change))
    with pytest.raises(StreamMismatchError, match=r"transform\.sources"):
        other.load_sidecar(path)


def test_a_source_mapped_into_another_format(tok):
    """A text source whose rows a per-source data.map turns into alpaca rows."""
    section = _section()
    section["sources"][0].update(format="alpaca", map="map_hooks:alpaca_from_text")
    out = _batches(_loader(tok, section), 6)
    lm = [labels for keys, batch in out for k, (_, labels) in zip(keys, batch) if k.startswith("lm/")]
    assert lm and all(IGNORE_INDEX in labels for labels in lm)


@pytest.mark.parametrize("entry,needle", [
    ({"format": "alpacca"}, "data.sources[1].format: got 'alpacca'"),
    ({"columns": {"prompt": 3}}, "data.sources[1].columns: got {'prompt': 3}"),
    ({"map": "no_such_module_rs:f"}, "data.sources[1].map: got 'no_such_module_rs:f'; module"),
    ({"format": "vl"}, "data.sources[1]: sets format, columns; per-source transform settings are for text"),
    ({"tags": {"role_tag": "r"}}, "data.sources[1].tags: got {'role_tag': 'r'} with data.sources[1].format 'alpaca'"),
])
def test_bad_per_source_settings_name_the_source(entry, needle):
    section = _section(**entry)
    with pytest.raises(ConfigError) as ei:
        TransformConfig.from_dict(section)
    assert needle in str(ei.value), str(ei.value)


def test_per_source_keys_are_accepted_by_the_stream_config_and_others_still_refused():
    cfg = StreamConfig.from_dict(_section())
    assert cfg.labels == ("lm", "chat")
    section = _section(max_seq_len=12)
    with pytest.raises(ConfigError, match=r"data.sources\[1\].max_seq_len: not a per-source key"):
        StreamConfig.from_dict(section)


def test_the_docs_mixture_config_reads_as_documented(tmp_path, monkeypatch):
    """docs/formats.md's per-source example (marker ``tested-config: formats-mixture``)."""
    import re

    import yaml

    with open(os.path.join(ROOT, "docs", "formats.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"<!-- tested-config: formats-mixture -->\n```yaml\n(.*?)```", text, re.S).group(1)
    section = yaml.safe_load(block)["data"]
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data_hooks.py").write_text("def clean(row):\n    return row\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert StreamConfig.from_dict(section).labels == ("web", "chat")
    cfg = TransformConfig.from_dict(section)
    web, chat = cfg.for_source("web"), cfg.for_source("chat")
    assert (web.format, web.map, web.text_column) == ("text", "my_project.data_hooks:clean", "text")
    assert (chat.format, chat.map, chat.columns) == ("alpaca", None, {"system": "system", "history": "history"})
    assert cfg.packing and chat.packing and cfg.max_seq_len == chat.max_seq_len == 1024
