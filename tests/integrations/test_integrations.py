"""Other resumable data loaders over a ResumableStream: torchdata's StatefulDataLoader (works, with
workers), accelerate's register_for_checkpointing (one rank works; across ranks a clear error saying
what to do instead)."""

import itertools

import pytest
from helpers import parquet_config

from resumable_stream import ConfigError, ResumableStream
from resumable_stream.loader import StreamLoader
from resumable_stream.sources import open_source


def ids(rows):
    return [row["id"] for row in rows]


@pytest.fixture(scope="module")
def setup(parquet_small):
    cfg = parquet_config(parquet_small, shuffle=True, buffer_size=40)
    return cfg, open_source(cfg.source_spec)


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_exactly(setup, workers):
    """The README recipe: StatefulDataLoader over the bare stream, its state_dict() saved, a new loader over a
    new stream loads it and continues with exactly the next batches (workers prefetching or not)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    cfg, source = setup

    def loader():
        stream = ResumableStream(cfg, rank=0, world_size=1, num_workers=workers, source=source)
        return StatefulDataLoader(stream, batch_size=8, num_workers=workers, collate_fn=ids)

    whole = list(itertools.islice(loader(), 30))
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(13)]
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + list(itertools.islice(resumed, 17)) == whole


def test_accelerate_register_for_checkpointing_one_rank_and_the_error_across_ranks(setup, tmp_path):
    """accelerate saves registered objects from the main process only (custom_checkpoint_0.pkl). One rank:
    the StreamLoader resumes exactly. Several ranks: the state is the job's, gathered with torch.distributed
    (tests/trainings/test_trainer_checkpoints.py runs it on 2 ranks); without a process group that cannot
    be, so save_state refuses it, naming why, instead of writing a state that rank 1 could not resume from."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cfg, source = setup

    def stream_loader(rank=0, world_size=1):
        stream = ResumableStream(cfg, rank=rank, world_size=world_size, source=source)
        return StreamLoader(stream, batch_size=8, collate_fn=ids)

    try:
        whole = list(itertools.islice(stream_loader(), 12))
        saved = stream_loader()
        accelerator = Accelerator(cpu=True)
        accelerator.register_for_checkpointing(saved)
        head = list(itertools.islice(saved, 5))
        accelerator.save_state(str(tmp_path / "one"))
        again = stream_loader()
        accelerator = Accelerator(cpu=True)
        accelerator.register_for_checkpointing(again)
        accelerator.load_state(str(tmp_path / "one"))
        assert head + list(itertools.islice(again, 7)) == whole

        rank0 = stream_loader(0, 2)
        accelerator = Accelerator(cpu=True)
        accelerator.register_for_checkpointing(rank0)
        list(itertools.islice(rank0, 3))
        with pytest.raises(ConfigError, match=r"rank 0 of 2.*torch\.distributed.*save_sidecar\(dir\)"):
            accelerator.save_state(str(tmp_path / "two"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
