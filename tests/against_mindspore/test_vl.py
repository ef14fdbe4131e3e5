"""The VL transform through MindSporeSource, without torch: numpy batches (pixel_values, image_grid_thw, ...) and
an exact resume, the same batches as a StreamLoader reading the stream in this process."""

import os

import ms_helpers
import numpy as np
import pytest

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.integrations.mindspore import MindSporeSource
from resumable_stream.loader import StreamLoader
from resumable_stream.transforms import TransformConfig, VLProcessor, collate_vl_numpy, load_processor

DATA = {"dataset_name_or_path": "parquet", "data_files": os.path.join(ms_helpers.TINY, "data_vl", "*.parquet"),
        "shuffle": True, "buffer_size": 64, "format": "vl", "messages_column": "messages", "images_column": "images",
        "max_seq_len": 256, "bad_sample": "skip"}
COLUMNS = ["input_ids", "labels", "attention_mask", "mm_token_type_ids", "image_grid_thw", "pixel_values"]


@pytest.fixture(scope="module")
def parts():
    processor = load_processor(os.path.join(ms_helpers.TINY, "vl"))
    transform = TransformConfig.from_dict(DATA)
    config = StreamConfig.from_dict({k: v for k, v in DATA.items() if k not in TransformConfig.KEYS})
    return (config, lambda: VLProcessor(processor, transform),
            lambda ex: collate_vl_numpy(ex, processor.tokenizer.pad_token_id))


def source(parts):
    config, factory, collate = parts
    return MindSporeSource(ResumableStream(config, rank=0, world_size=1), 2, COLUMNS, collate, factory)


def summary(batches, n):
    out = []
    for batch in batches:
        out.append((batch["input_ids"].tolist(), batch["image_grid_thw"].tolist(),
                    round(float(np.asarray(batch["pixel_values"], dtype=np.float64).sum()), 3)))
        if len(out) == n:
            return out


def test_vl_batches_resume_exactly(parts, tmp_path):
    config, factory, collate = parts
    reference = summary(StreamLoader(ResumableStream(config, rank=0, world_size=1), 2, collate_fn=collate,
                                     processor_factory=factory), 10)
    first = source(parts)
    rows = first.iterate(first.dataset())
    head = summary(rows, 4)
    first.save_sidecar(str(tmp_path / "state"))
    rows.close()
    resumed = source(parts)
    resumed.load_sidecar(str(tmp_path / "state"))
    assert head + summary(resumed.iterate(resumed.dataset()), 6) == reference
    assert all(grid for _, grid, _ in reference)        # every batch carries images
