"""A loader's ``state_dict()`` is the job's: gathered from every rank at save time, it restores every rank
whichever rank's copy was kept (rank 0's alone, as accelerate and Lightning keep it), and a job of another size
under ``data.elastic``. Plain values only (``torch.load(weights_only=True)``). A state that could not restore
every rank is refused when it is written. Two real processes over gloo (torch.multiprocessing)."""

from __future__ import annotations

import io
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import parquet_config

from resumable_stream import ConfigError, ResumableStream, SidecarError, StreamMismatchError
from resumable_stream.loader import StreamLoader
from resumable_stream.state.job_state import STATE_KEY

BATCH = 4


def _loader(data: str, rank: int, world: int, workers: int = 0, **kw) -> StreamLoader:
    cfg = parquet_config(data, shuffle=True, buffer_size=32, num_partitions=4, **kw)
    return StreamLoader(ResumableStream(cfg, rank=rank, world_size=world, num_workers=workers), BATCH,
                        collate_fn=lambda rows: [r["id"] for r in rows], num_workers=workers)


def _rank(rank: int, world: int, init: str, data: str, out: str, workers: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        first = _loader(data, rank, world, workers)
        it = iter(first)
        for _ in range(3 + 2 * rank):           # the ranks stand at different batches when the state is taken
            next(it)
        state = first.state_dict()
        nxt = [next(it) for _ in range(6)]
        if rank == 0:                          # as accelerate / Lightning / rank-0 torch.save keep it
            torch.save(state, os.path.join(out, "state.pt"))
        torch.save({"state": state, "next": nxt}, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        kept = torch.load(os.path.join(out, "state.pt"), weights_only=True)
        again = _loader(data, rank, world, workers)
        again.load_state_dict(kept)
        got = list(itertools.islice(again, 6))
        torch.save({"got": got}, os.path.join(out, f"resumed{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(parquet_small, tmp_path_factory):
    """Each of 2 ranks (gloo, 2 DataLoader workers) reads 3 / 5 batches, takes state_dict(), reads 6 more; rank 0's
    copy alone is then loaded by fresh loaders on both ranks."""
    out = str(tmp_path_factory.mktemp("job_state"))
    init = f"file://{os.path.join(out, 'store')}"
    mp.start_processes(_rank, args=(2, init, parquet_small, out, 2), nprocs=2, join=True, start_method="fork")
    return out


def test_rank_zeros_copy_restores_every_rank(two_ranks):
    for rank in range(2):
        expected = torch.load(os.path.join(two_ranks, f"rank{rank}.pt"), weights_only=True)["next"]
        got = torch.load(os.path.join(two_ranks, f"resumed{rank}.pt"), weights_only=True)["got"]
        assert got == expected, f"rank {rank} resumed from rank 0's copy of the state on other batches"


def test_every_ranks_copy_is_the_same_plain_value(two_ranks):
    states = [torch.load(os.path.join(two_ranks, f"rank{r}.pt"), weights_only=True)["state"] for r in range(2)]
    assert set(states[0]) == {STATE_KEY} and isinstance(states[0][STATE_KEY], bytes)
    assert states[0] == states[1], "DCP keeps one rank's copy of a key every rank has: they must be the same"


def test_the_job_state_resumes_on_one_rank_with_elastic(two_ranks, parquet_small):
    """Every partition of the 2-rank job continues from its cursor on 1 rank (data.elastic): the samples of the
    two ranks' next batches are among the next ones read, none of the samples consumed before. The ranks saved
    at different batches, inside their rounds (what data.elastic_determinism refuses on another topology,
    tests/test_global_batches.py): with it off, the rounds start afresh."""
    state = torch.load(os.path.join(two_ranks, "state.pt"), weights_only=True)
    with pytest.raises(StreamMismatchError, match="saved inside a round of micro-batches: rank 0 of the 2"):
        _loader(parquet_small, 0, 1, elastic=True).load_state_dict(state)
    one = _loader(parquet_small, 0, 1, elastic=True, elastic_determinism=False)
    one.load_state_dict(state)
    resumed = {i for batch in itertools.islice(one, 60) for i in batch}
    expected = {i for r in range(2) for batch in torch.load(os.path.join(two_ranks, f"rank{r}.pt"),
                                                            weights_only=True)["next"] for i in batch}
    assert expected <= resumed
    with pytest.raises(StreamMismatchError, match="topology"):      # without elastic: refused, named
        _loader(parquet_small, 0, 1).load_state_dict(state)


def test_several_ranks_without_a_process_group_are_refused_when_the_state_is_written(parquet_small):
    loader = _loader(parquet_small, 1, 2)
    next(iter(loader))
    with pytest.raises(ConfigError, match="rank 1 of 2.*torch.distributed.*save_sidecar"):
        loader.state_dict()
    per_rank = _loader(parquet_small, 1, 2)
    per_rank.per_rank_state = True             # VeOmni / HyperParallel: each rank's own, no collective
    batches = iter(per_rank)
    next(batches)
    state = per_rank.state_dict()
    expected = next(batches)
    again = _loader(parquet_small, 1, 2)
    again.load_state_dict(state)
    assert next(iter(again)) == expected
    with pytest.raises(StreamMismatchError, match="rank 1's"):          # another rank refuses it, named
        _loader(parquet_small, 0, 2).load_state_dict(state)


def test_a_damaged_or_foreign_state_dict_is_refused_naming_it(parquet_small):
    loader = _loader(parquet_small, 0, 1)
    good = loader.state_dict()
    buf = io.BytesIO()
    torch.save(good, buf)
    assert torch.load(io.BytesIO(buf.getvalue()), weights_only=True) == good
    damaged = bytearray(good[STATE_KEY])
    damaged[-5] ^= 0xFF
    for bad, match in (({STATE_KEY: bytes(damaged)}, "its own digest"), ({STATE_KEY: "text"}, "got str"),
                       ({"epoch": 3}, "allowed: what StreamLoader.state_dict"), ([1, 2], "allowed")):
        with pytest.raises(SidecarError, match=match):
            _loader(parquet_small, 0, 1).load_state_dict(bad, where="the trainer's checkpoint")
