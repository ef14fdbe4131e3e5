"""MindSporeSource under the real mindspore.dataset.GeneratorDataset: what is saved is what the loop consumed,
not what the pipeline prefetched, and a resume continues with the very next batch."""

import time

import ms_helpers
import numpy as np
import pytest

from resumable_stream import ConfigError
from resumable_stream.integrations.mindspore import ID_COLUMN, MindSporeSource, mindspore_topology


@pytest.fixture(scope="module")
def reference():
    source = ms_helpers.mindspore_source()
    return ms_helpers.take(source.iterate(source.dataset()), 40)


def test_batches_are_the_loaders(reference):
    # the same stream read by a StreamLoader in this process: MindSpore's pipeline changes nothing
    assert reference == ms_helpers.take(_numpy_loader(), 40)


def _numpy_loader():
    tok = ms_helpers.tokenizer()
    from resumable_stream import ResumableStream
    from resumable_stream.loader import StreamLoader

    return StreamLoader(ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1), ms_helpers.BATCH,
                        collate_fn=lambda ex: ms_helpers.collate_numpy(ex, tok.pad_token_id),
                        processor_factory=ms_helpers.processor_factory(tok))


@pytest.mark.parametrize("stop_at", [1, 7, 23])
def test_the_state_is_what_was_consumed_not_what_was_prefetched(tmp_path, reference, stop_at):
    source = ms_helpers.mindspore_source()
    rows = source.iterate(source.dataset())
    head = ms_helpers.take(rows, stop_at)
    # MindSpore's pipeline reads ahead in its own thread. Watched through read_ahead, never through the stream:
    # partition_state() from this thread built the reader's next window while the producer thread read it, and
    # 1 run in ~90 beside two CPU hogs failed ("the source gave 16 rows where its row count promised 16 from row
    # 16 (the data changed while it was read)"). The deadline only turns a pipeline that never reads ahead into
    # a failure instead of a hang; it is no part of what is measured.
    deadline = time.monotonic() + 120
    while source.read_ahead == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.read_ahead > 0, "no prefetch: this test would see nothing"
    source.save_sidecar(str(tmp_path / "state"))
    rows.close()
    resumed = ms_helpers.mindspore_source()
    resumed.load_sidecar(str(tmp_path / "state"))
    assert head + ms_helpers.take(resumed.iterate(resumed.dataset()), 40 - stop_at) == reference


def test_a_new_iteration_continues_after_the_last_row_handed_out(reference):
    source = ms_helpers.mindspore_source()
    dataset = source.dataset()
    parts = [ms_helpers.take(source.iterate(dataset), n) for n in (5, 1, 14)]
    assert sum(parts, []) == reference[:20]


def test_rows_batched_by_mindspore_count_every_id(tmp_path, reference):
    # MindSpore's own .batch() over rows of one example each: each batch holds several ids, all recorded
    tok = ms_helpers.tokenizer()
    from resumable_stream import ResumableStream

    def source():
        return MindSporeSource(ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1), 1,
                               ms_helpers.COLUMNS, lambda ex: ms_helpers.collate_numpy(ex, tok.pad_token_id)
                               if False else {k: v[0] for k, v in ms_helpers.collate_numpy(ex, tok.pad_token_id).items()},
                               ms_helpers.processor_factory(tok))

    first = source()
    rows = first.iterate(first.dataset().batch(ms_helpers.BATCH))
    head = ms_helpers.take(rows, 6)
    first.save_sidecar(str(tmp_path / "state"))
    rows.close()
    resumed = source()
    resumed.load_sidecar(str(tmp_path / "state"))
    tail = ms_helpers.take(resumed.iterate(resumed.dataset().batch(ms_helpers.BATCH)), 4)
    assert head + tail == reference[:10]       # packed rows have one length: the same batches as ours


def test_mapped_columns_keep_the_ids(reference):
    source = ms_helpers.mindspore_source()
    dataset = source.dataset().map(lambda x: x * 1, input_columns=["input_ids"], num_parallel_workers=2)
    assert ms_helpers.take(source.iterate(dataset), 12) == reference[:12]
    assert source.loader.batches_consumed == 12


def test_bad_arguments_name_themselves():
    tok = ms_helpers.tokenizer()
    from resumable_stream import ResumableStream

    stream = ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1)
    collate = lambda ex: ms_helpers.collate_numpy(ex, tok.pad_token_id)   # noqa: E731
    with pytest.raises(ConfigError, match=r"columns: got \[\]"):
        MindSporeSource(stream, 4, [], collate)
    with pytest.raises(ConfigError, match=rf"columns: got \['a', '{ID_COLUMN}'\]"):
        MindSporeSource(stream, 4, ["a", ID_COLUMN], collate)
    with pytest.raises(ConfigError, match=r"collate_fn: got 3"):
        MindSporeSource(stream, 4, ["a"], 3)
    source = MindSporeSource(stream, 4, ["input_ids"], collate, ms_helpers.processor_factory(tok))
    with pytest.raises(ConfigError, match=r"num_parallel_workers: got 2; allowed: 1"):
        source.dataset(num_parallel_workers=2)
    with pytest.raises(ConfigError, match=r"collate_fn: returned \['attention_mask', 'input_ids', 'labels'\]"):
        ms_helpers.take(source.iterate(source.dataset()), 1)
    workers = ResumableStream(ms_helpers.stream_config(), rank=0, world_size=1, num_workers=2)
    with pytest.raises(ConfigError, match=r"num_workers: got a stream created with num_workers=2"):
        MindSporeSource(workers, 4, ["input_ids"], collate)


def test_reordered_rows_are_refused(reference):
    # a loop over the dataset's own iterator tells the source the ids it handed out
    source = ms_helpers.mindspore_source()
    it = source.dataset().create_dict_iterator(num_epochs=1, output_numpy=True)
    rows = [next(it) for _ in range(6)]
    ids = [int(row[ID_COLUMN]) for row in rows]
    assert [row["input_ids"].tolist() for row in rows] == reference[:6]
    source.consumed(np.array(ids[:2]))
    assert source.loader.batches_consumed == 2
    with pytest.raises(ConfigError, match=rf"{ID_COLUMN}: got {ids[1]} after {ids[1]}"):
        source.consumed([ids[1]])
    source.consumed([ids[5]])             # rows 2-4 dropped by the pipeline (e.g. a filter)
    with pytest.raises(ConfigError, match=rf"{ID_COLUMN}: got {ids[3]} after {ids[5]}"):
        source.consumed([ids[3]])
    it.stop()


def test_topology_without_initialised_communication_is_the_given_one():
    assert mindspore_topology() == (None, None)
    assert mindspore_topology(1, 4) == (1, 4)


def test_a_mixture_of_raw_samples_resumes_exactly(tmp_path):
    # no transform: collate_fn gets the raw rows; a MixtureStream opened by from_config (topology: explicit)
    import os

    from resumable_stream import MixtureConfig

    cfg = MixtureConfig.from_dict({"sources": [
        {"label": "lm", "dataset_name_or_path": "parquet", "data_files": ms_helpers.DATA["data_files"], "weight": 0.7},
        {"label": "notes", "dataset_name_or_path": "parquet",
         "data_files": os.path.join(ms_helpers.TINY, "data_notes", "*.parquet"), "weight": 0.3}],
        "shuffle": True, "buffer_size": 32})

    def source():
        return MindSporeSource.from_config(cfg, 5, ["id"], lambda rows: {"id": np.array([r["id"] for r in rows])},
                                           rank=0, world_size=1)

    def ids(src, n):
        return [row["id"].tolist() for _, row in zip(range(n), src.iterate(src.dataset()))]

    reference = ids(source(), 30)
    first = source()
    head = ids(first, 11)
    first.save_sidecar(str(tmp_path / "mix"))
    resumed = source()
    resumed.load_sidecar(str(tmp_path / "mix"))
    assert head + ids(resumed, 19) == reference
    assert resumed.loader.rank_state()["stream"]["kind"] == "mixture"
