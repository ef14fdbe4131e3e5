"""HyperParallel's dataset and dataloader contracts with our builders (resumable_stream.integrations.hyper_parallel).

HyperParallel (mindspore-ai/hyper-parallel) is not on the package index and cannot be installed here: these tests
build the dataset and dataloader from examples/hyper_parallel/train_stream.yaml's ``_target_`` nodes with the
keyword arguments its trainer passes, and run tests/_support/hp_trainer.py, a harness of the calls its
BaseTrainer / TextTrainer, HyperIter and CheckpointerCallback make (the files it follows are named there), under
torchrun with a real SIGKILL."""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from hp_trainer import PadCollator, PlaintextTransform, PrefetchIter, Target
from training_helpers import Run

from resumable_stream.errors import ConfigError, UnknownKeyError
from resumable_stream.integrations.hyper_parallel import build_dataloader, build_dataset
from resumable_stream.testing import write_parquet_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "hyper_parallel", "train_stream.yaml")
HARNESS = os.path.join(ROOT, "tests", "_support", "hp_trainer.py")
TOKENIZER = os.path.join(ROOT, "examples", "tiny", "tokenizer")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("hp_data")
    write_parquet_dataset(str(d), rows=600, files=4, row_group_size=25)
    return str(d)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _nodes(data: str, **dataloader: object) -> tuple[dict, dict]:
    """The example's dataset and dataloader nodes, reading ``data`` (in a small window)."""
    with open(EXAMPLE, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    ds, dl = doc["dataset"], doc["dataloader"]
    for key in ("model_assets", "data_transform"):       # the trainer builds these, not the dataset target
        ds.pop(key)
    ds.update(data_files=os.path.join(data, "*.parquet"), buffer_size=64, num_partitions=4)
    dl.update(dataloader)
    return ds, dl


def _build(data: str, tokenizer, rank: int = 0, world: int = 1, micro: int = 2, **dataloader):
    """Dataset and dataloader as BaseTrainer._build_dataset and data.batching.build_dataloader build them."""
    ds_node, dl_node = _nodes(data, **dataloader)
    mesh = SimpleNamespace(dp_rank=rank, dp_size=world)
    training = SimpleNamespace(micro_batch_size=micro, global_batch_size=micro * world, seed=42)
    dl_target = Target(dl_node)
    dataset = Target(ds_node).build(transform=PlaintextTransform(tokenizer, 16), tokenizer=tokenizer,
                                    mesh_context=mesh, training_config=training)
    loader = dl_target.build(dataset=dataset, collate_fn=PadCollator(tokenizer.pad_token_id), batch_sampler=None,
                             batch_size=micro, sampler_type=getattr(dl_target, "sampler_type", "single"),
                             dp_world_size=world, max_seq_len=16, seed=42)
    return dataset, loader


def test_the_build_kwargs_give_an_iterable_dataset_and_an_unsized_loader_of_collated_items(data, tokenizer):
    dataset, loader = _build(data, tokenizer, num_workers=0)
    assert isinstance(dataset, torch.utils.data.IterableDataset)      # HyperParallel makes no batch sampler
    with pytest.raises(TypeError):                                    # _compute_train_iters: unsized
        len(loader)
    loader.set_epoch(0)
    items = [item for _, item in zip(range(6), loader)]
    assert [len(i["ids"]) for i in items] == [2] * 6                  # micro_batch_size rows per item
    assert set(items[0]) == {"input_ids", "labels", "attention_mask", "ids"}     # the trainer's collate_fn
    ids = [i for item in items for i in item["ids"]]
    assert len(set(ids)) == 12 and ids != sorted(ids)                 # distinct rows, shuffled


def test_the_ranks_of_a_mesh_read_disjoint_rows(data, tokenizer):
    seen = []
    for rank in range(2):
        _, loader = _build(data, tokenizer, rank=rank, world=2, num_workers=0)
        seen.append({i for _, item in zip(range(10), loader) for i in item["ids"]})
    assert len(seen[0]) == len(seen[1]) == 20 and not seen[0] & seen[1]


def test_a_state_taken_after_every_item_is_local_small_and_restores_before_the_first_step(data, tokenizer,
                                                                                          monkeypatch):
    """HyperIter's prefetch thread calls state_dict() after each item: no collective, a size that does not
    grow with the items consumed, and the state of the item training took restores the next items."""
    import torch.distributed as dist

    called = []
    for name in ("all_gather_object", "all_gather", "all_reduce", "broadcast", "broadcast_object_list",
                 "gather_object", "barrier", "all_to_all"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: called.append(_n))
    _, loader = _build(data, tokenizer, num_workers=2)
    it = PrefetchIter(loader, prefetch=True)
    taken, states, seconds = [], [], []
    for _ in range(30):
        taken.append(next(it)["ids"])
        states.append(it.state_dict())           # the state of the item just handed to training
    for _ in range(50):                          # what a state_dict() call costs after 30 items
        t = time.perf_counter()
        loader.state_dict()
        seconds.append(time.perf_counter() - t)
    assert called == []
    sizes = [len(pickle.dumps(s)) for s in states]
    assert max(sizes) - min(sizes) < 64, sizes   # O(partitions): the same size after 1 item and after 30
    assert statistics.median(seconds) < 0.005, seconds
    # restored before the first step (CheckpointerCallback._load_checkpoint), a fresh loader continues exactly
    _, fresh = _build(data, tokenizer, num_workers=2)
    skeleton = fresh.state_dict()                 # the restore's skeleton: called before anything is read
    assert isinstance(skeleton, dict)
    fresh.load_state_dict(states[19])
    assert [item["ids"] for _, item in zip(range(10), fresh)] == taken[20:30]


@pytest.mark.parametrize("change, match", [
    (dict(loader={"shuffle": True}), r"dataloader: unknown keys \['shuffle'\]"),
    (dict(loader={"drop_last": False}), r"dataloader\.drop_last: got False"),
    (dict(loader={"sampler_type": "random"}), r"dataloader\.sampler_type: got 'random'"),
])
def test_what_the_dataloader_refuses_is_named(data, tokenizer, change, match):
    with pytest.raises(ConfigError, match=match):
        _build(data, tokenizer, **change["loader"])


def test_what_the_dataset_refuses_is_named(data, tokenizer):
    with pytest.raises(ConfigError, match="no data keys"):
        build_dataset(transform=None, tokenizer=None, mesh_context=None, training_config=None)
    with pytest.raises(ConfigError, match="one of them"):
        build_dataset(config="x.yml", dataset_name_or_path="parquet")
    with pytest.raises(UnknownKeyError, match="data.packing"):       # our transform keys: the transform is theirs
        build_dataset(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), packing=True)
    with pytest.raises(ConfigError, match="dp_rank=2, dp_size=2"):
        build_dataset(mesh_context=SimpleNamespace(dp_rank=2, dp_size=2), dataset_name_or_path="parquet",
                      data_files=os.path.join(data, "*.parquet"))
    dataset = build_dataset(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"))
    with pytest.raises(ConfigError, match="batch_sampler"):
        build_dataloader(dataset=dataset, batch_sampler=[[0, 1]])
    with pytest.raises(ConfigError, match="dp_world_size: got 4"):
        build_dataloader(dataset=build_dataset(mesh_context=SimpleNamespace(dp_rank=0, dp_size=2),
                                               dataset_name_or_path="parquet",
                                               data_files=os.path.join(data, "*.parquet")), dp_world_size=4)
    with pytest.raises(ConfigError, match="build_dataloader"):
        iter(dataset)


def test_a_resumable_stream_yaml_can_be_named_instead_of_the_keys(data, tmp_path):
    path = tmp_path / "stream.yml"
    path.write_text(yaml.safe_dump({"data": {"dataset_name_or_path": "parquet", "shuffle": True,
                                             "data_files": os.path.join(data, "*.parquet")}}))
    dataset = build_dataset(config=str(path), mesh_context=SimpleNamespace(dp_rank=1, dp_size=2))
    assert dataset.config.shuffle is True and (dataset.rank, dataset.world_size) == (1, 2)


# ------------------------------------------------------------------------- the harness under torchrun, SIGKILL
STEPS, SAVE, HOLD = 9, 3, 7         # checkpoints at 3 and 6; killed after step 7


def _harness_yaml(tmp_path, data: str, nproc: int, name: str) -> str:
    ds, dl = _nodes(data)           # the example's nodes: 2 workers, the background prefetcher
    doc = {"model": {"tokenizer": TOKENIZER},
           "training": {"seed": 3, "train_iters": STEPS, "global_batch_size": 2 * nproc, "micro_batch_size": 1,
                        "max_seq_len": 16},
           "checkpoint": {"checkpoint_dir": str(tmp_path / name), "save_steps": SAVE, "restore_from": "LATEST"},
           "dataset": ds, "dataloader": dl}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _run(config: str, log_dir: str, nproc: int, hold: int | None = None) -> None:
    """Run the harness to its end (``hold``: until every rank is past that step, then SIGKILL it)."""
    run = _start(config, log_dir, nproc, hold)
    try:
        if hold is None:
            run.wait_ok(300)
            return
        run.wait_until(lambda: all(hold in _records(log_dir, r) for r in range(nproc)),
                       f"every rank past step {hold}", timeout=300)
    finally:
        run.kill()


def _start(config: str, log_dir: str, nproc: int, hold: int | None = None) -> Run:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(HARNESS)])}
    if hold:
        env["HP_TEST_HOLD_AFTER"] = str(hold)
    # training_helpers.Run: torchrun starts its ranks in sessions of their own, so a kill of its process group
    # would leave them running; Run kills every process of the run by an environment tag
    return Run(config, f"{log_dir}-{'held' if hold else 'run'}-{time.monotonic_ns()}", env=env,
               command=[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        f"--master_port={port}", HARNESS, config, log_dir])


def _records(log_dir: str, rank: int) -> dict[int, dict]:
    path = os.path.join(log_dir, f"rank-{rank}.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, f))}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_after_a_checkpoint_resumes_exactly_through_the_contract(tmp_path, data, nproc):
    straight = _harness_yaml(tmp_path, data, nproc, "straight")
    uninterrupted = _start(straight, str(tmp_path / "log_straight"), nproc)    # side by side with the killed run
    try:
        killed = _harness_yaml(tmp_path, data, nproc, "killed")
        _run(killed, str(tmp_path / "log_killed"), nproc, hold=HOLD)
        uninterrupted.wait_ok(300)
    finally:
        uninterrupted.kill()
    assert (tmp_path / "killed" / "latest").read_text() == "global_step_6"
    _run(killed, str(tmp_path / "log_killed"), nproc)        # restore_from: LATEST, before the first step
    for r in range(nproc):
        want, got = _records(str(tmp_path / "log_straight"), r), _records(str(tmp_path / "log_killed"), r)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for step in want:
            assert got[step]["ids"] == want[step]["ids"], f"rank {r} step {step}"
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-6), f"rank {r} step {step}"
        # HyperIter's prefetch thread took a state after every item: at least one call per micro-batch trained
        assert want[STEPS]["state_calls"] >= STEPS * 2
        ids = [i for rec in want.values() for mb in rec["ids"] for i in mb]
        assert len(ids) == len(set(ids)) == STEPS * 2
    if nproc == 2:
        ranks = [{i for rec in _records(str(tmp_path / "log_straight"), r).values() for mb in rec["ids"] for i in mb}
                 for r in range(2)]
        assert not ranks[0] & ranks[1]
