"""The transform protocol (``resumable_stream.transforms.Processor``): the text and VL processors satisfy it with the
optional hooks they use (LLaMA-Factory's: tests/against_llamafactory/test_llamafactory_epochs.py), a processor
written with the required methods only is driven with the hooks' defaults, and one that sets some hooks without
subclassing is refused rather than half-read."""

from __future__ import annotations

import os

import numpy as np
import pytest
from repo_paths import REPO_ROOT
from transformers import AutoTokenizer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader
from resumable_stream.testing import write_parquet_dataset
from resumable_stream.transforms import Processor, TextProcessor, TransformConfig, VLProcessor, load_processor
from resumable_stream.transforms.protocol import as_processor

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
REQUIRED = ("feed", "ready", "take", "state", "load_state", "fingerprint", "stats")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


def _satisfies(proc) -> None:
    assert isinstance(proc, Processor) and Processor in type(proc).__mro__
    assert as_processor(proc) is proc                  # driven as it is, with its own hooks
    for name in REQUIRED:                              # every required method is its own, not the protocol's stub
        assert getattr(type(proc), name) is not getattr(Processor, name), name


def test_text_processor_satisfies_the_protocol_and_declares_its_hooks(tok):
    mixture = TransformConfig.from_dict({"format": "text", "sources": [
        {"label": "a", "dataset_name_or_path": "parquet", "data_files": "a.parquet"},
        {"label": "b", "dataset_name_or_path": "parquet", "data_files": "b.parquet", "format": "alpaca"}]})
    for cfg, per_source in ((TransformConfig(), False), (mixture, True)):
        proc = TextProcessor(tok, cfg)
        _satisfies(proc)
        assert (proc.takes_source, proc.counts_key_tokens, proc.epoch_bound) == (per_source, True, False)
        proc.feed({"text": "one two three"}, "k")
        ex = proc.take(with_key_tokens=True)
        assert ex["keys"] == ["k"] and ex["key_tokens"] == [len(ex["input_ids"])]


def test_vl_processor_satisfies_the_protocol_without_optional_hooks():
    proc = VLProcessor(load_processor(os.path.join(TINY, "vl")), TransformConfig(format="vl"))
    _satisfies(proc)
    assert (proc.takes_source, proc.counts_key_tokens, proc.epoch_bound, proc.epoch_tail()) == (False, False, False, 0)


class _Counting:
    """Only the required methods, no Processor base: groups every two samples into one example."""

    def __init__(self):
        self.fed, self.out = [], []

    def feed(self, sample, key):          # no source parameter: takes_source defaults to False
        self.fed.append(key)
        if len(self.fed) == 2:
            self.out.append({"ids": [0], "keys": self.fed})
            self.fed = []

    def ready(self):
        return len(self.out)

    def take(self):                       # no with_key_tokens: counts_key_tokens defaults to False
        return self.out.pop(0)

    def state(self):
        return {"tensors": {"n": np.asarray([len(self.fed)], np.int64)}, "meta": {"fed": list(self.fed)}}

    def load_state(self, state):
        self.fed = list(state["meta"]["fed"])

    def fingerprint(self):
        return {"counting": 1}

    def stats(self):
        return {}


def test_a_processor_with_the_required_methods_only_gets_the_defaults(tmp_path):
    proc = as_processor(_Counting())
    assert isinstance(proc, Processor) and not isinstance(proc.inner, Processor)
    assert (proc.takes_source, proc.counts_key_tokens, proc.epoch_bound, proc.data_epoch) == (False, False, False, None)
    proc.feed({"x": 1}, "a", source="ignored")
    proc.feed({"x": 2}, "b")
    assert proc.ready() == 1 and proc.take(with_key_tokens=True) == {"ids": [0], "keys": ["a", "b"]}
    proc.flush()                          # nothing carried to flush: the default does nothing
    assert proc.epoch_tail() == 0 and proc.fingerprint() == {"counting": 1}

    # and the loader drives it through the wrapper: every sample fed once, two per example
    write_parquet_dataset(str(tmp_path / "d"), rows=40, files=2, row_group_size=10)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=str(tmp_path / "d" / "*.parquet"))
    stream = ResumableStream(cfg, rank=0, world_size=1)
    stream.set_epoch(0)
    loader = StreamLoader(stream, batch_size=4, processor_factory=_Counting, keep_keys=True)
    batches = list(loader)
    assert sum(len(b) for b in batches) == 20 and len(set(loader.pop_consumed_keys())) == 40


class _HalfDeclared(_Counting):
    takes_source = True                   # a hook, but the class is no Processor: it would be ignored


def test_a_processor_that_sets_some_hooks_without_subclassing_is_refused():
    with pytest.raises(TypeError, match=r"_HalfDeclared: defines takes_source but not every member of "
                                        r"resumable_stream\.transforms\.Processor; subclass it"):
        as_processor(_HalfDeclared())


def test_a_subclass_inherits_the_hooks_it_does_not_set():
    class Mine(_Counting, Processor):
        takes_source = True

        def feed(self, sample, key, source=None):
            super().feed(sample, f"{source}/{key}")

    proc = Mine()
    assert as_processor(proc) is proc and (proc.takes_source, proc.epoch_bound) == (True, False)
    proc.end_epoch(3)                     # the default: only the epoch is recorded
    assert proc.data_epoch == 3 and proc.epoch_tail() == 0


def test_the_package_exports_the_protocol_beside_the_processors():
    import resumable_stream.transforms as transforms

    assert transforms.Processor is Processor and {"Processor", "TextProcessor", "VLProcessor"} <= set(transforms.__all__)
