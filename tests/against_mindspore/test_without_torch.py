"""The stream core with no torch installed at all: read, save, resume exactly (single stream, a mixture, the
loader in this process, the text transform with numpy outputs)."""

import importlib.util
import os
import sys

import ms_helpers
import numpy as np
import pytest

from resumable_stream import ConfigError, MixtureConfig, ResumableStream, open_stream
from resumable_stream.loader import StreamLoader


def test_torch_is_not_installed():
    assert importlib.util.find_spec("torch") is None
    assert "torch" not in sys.modules     # nothing imported so far pulled it in


def ids(stream, n):
    out = []
    for sample in stream:
        out.append(sample["id"])
        if len(out) == n:
            return out


@pytest.mark.parametrize("partitions", [1, 3])
def test_a_stream_reads_saves_and_resumes_exactly(tmp_path, partitions):
    cfg = ms_helpers.stream_config(num_partitions=partitions)
    reference = ids(ResumableStream(cfg, rank=0, world_size=1), 300)
    first = ResumableStream(cfg, rank=0, world_size=1)
    head = ids(first, 137)
    first.save_sidecar(str(tmp_path / "state"))
    resumed = ResumableStream(cfg, rank=0, world_size=1)
    resumed.load_sidecar(str(tmp_path / "state"))
    assert head + ids(resumed, 163) == reference
    assert "torch" not in sys.modules


def test_a_mixture_resumes_exactly(tmp_path):
    data = ms_helpers.DATA["data_files"]
    cfg = MixtureConfig.from_dict({"sources": [
        {"label": "lm", "dataset_name_or_path": "parquet", "data_files": data, "weight": 0.7},
        {"label": "notes", "dataset_name_or_path": "parquet",
         "data_files": os.path.join(ms_helpers.TINY, "data_notes", "*.parquet"), "weight": 0.3}],
        "shuffle": True, "buffer_size": 32})
    reference = ids(open_stream(cfg, rank=0, world_size=1), 200)
    first = open_stream(cfg, rank=0, world_size=1)
    head = ids(first, 77)
    first.save_sidecar(str(tmp_path / "mix"))
    resumed = open_stream(cfg, rank=0, world_size=1)
    resumed.load_sidecar(str(tmp_path / "mix"))
    assert head + ids(resumed, 123) == reference


def test_the_loader_with_the_text_transform_resumes_exactly_with_numpy_batches(tmp_path):
    tok = ms_helpers.tokenizer()

    def loader():
        return StreamLoader(ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1), 4,
                            collate_fn=lambda ex: ms_helpers.collate_numpy(ex, tok.pad_token_id),
                            processor_factory=ms_helpers.processor_factory(tok))

    reference = ms_helpers.take(loader(), 20)
    first = loader()
    batches = []
    for batch in first:
        assert isinstance(batch["input_ids"], np.ndarray) and batch["input_ids"].dtype == np.int64
        batches.append(batch["input_ids"].tolist())
        if len(batches) == 9:
            break
    first.save_sidecar(str(tmp_path / "state"))
    resumed = loader()
    resumed.load_sidecar(str(tmp_path / "state"))
    assert batches + ms_helpers.take(resumed, 11) == reference
    assert first.data_metrics()["tokens_per_s"] > 0      # numpy batches count their tokens too


def test_workers_need_torch_and_say_so():
    stream = ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1, num_workers=2)
    with pytest.raises(ConfigError, match=r"needs torch's DataLoader, and torch is not installed"):
        next(iter(StreamLoader(stream, 4, num_workers=2)))
