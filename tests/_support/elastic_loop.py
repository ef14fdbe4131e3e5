"""A plain PyTorch loop (StreamLoader, resumable_stream.Checkpoints, DistributedDataParallel over gloo) whose
optimizer steps accumulate ``loader.micro_batches_per_step`` micro-batches per rank: one from each of the
``data.num_partitions`` partitions per step (``data.elastic_determinism``), so it may resume on another number of
ranks and workers (tests/trainings/test_elastic_training.py).

    python -m torch.distributed.run --nproc_per_node W elastic_loop.py OUT DATA --steps S --workers K

Every 3 steps a checkpoint (model, optimizer, the loader's state); a restart resumes from the newest complete one.
Rank 0 appends one line per step to ``OUT/steps.jsonl``: the step, the ranks, the sorted ids of every rank's
samples of the step (gathered) and the step's loss (the mean squared error over the global batch, all-reduced).
The loss is summed per sample and divided by the global batch's size, so the gradient is the same on any number
of ranks (up to the order of the float additions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from resumable_stream import Checkpoints, ResumableStream, StreamConfig, StreamLoader

BATCH, FEATURES = 2, 8


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([int(r["id"]) for r in rows], dtype=torch.int64)
    x = ((ids[:, None] * torch.arange(1, FEATURES + 1)[None, :] * 7919) % 1000).float() / 1000.0
    return {"ids": ids, "x": x, "y": x.sum(dim=1, keepdim=True) * 0.5 + (ids[:, None] % 3).float()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    config = StreamConfig.from_dict({"dataset_name_or_path": "parquet", "data_files": os.path.join(args.data, "*.parquet"),
                                     "shuffle": True, "shuffle_seed": 5, "buffer_size": 16, "num_partitions": 12,
                                     "elastic": True})
    loader = StreamLoader(ResumableStream(config, num_workers=args.workers), BATCH, collate_fn=collate,
                          num_workers=args.workers)
    per_step = loader.micro_batches_per_step              # 12 / ranks: one micro-batch of every partition
    global_samples = BATCH * per_step * world
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    model = torch.nn.parallel.DistributedDataParallel(net) if dist.is_initialized() else net

    checkpoints = Checkpoints(args.out)
    start = checkpoints.resume(loader)
    log = os.path.join(args.out, "steps.jsonl")
    if start:
        saved = torch.load(os.path.join(checkpoints.path(start), "model.pt"), weights_only=True)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    if rank == 0 and os.path.isfile(log):              # the steps after the checkpoint are trained again
        with open(log, encoding="utf-8") as f:
            kept = [line for line in f if json.loads(line)["step"] <= start]
        with open(log, "w", encoding="utf-8") as f:
            f.writelines(kept)
    batches = iter(loader)
    for step in range(start + 1, args.steps + 1):
        optimizer.zero_grad()
        ids, squared = [], torch.zeros(())
        for _ in range(per_step):
            batch = next(batches)
            errors = ((model(batch["x"]) - batch["y"]) ** 2).sum()
            (errors * world / global_samples).backward()     # DDP averages over ranks: the global mean's gradient
            ids += batch["ids"].tolist()
            squared += errors.detach()
        optimizer.step()
        if dist.is_initialized():
            dist.all_reduce(squared)
            every = [None] * world
            dist.all_gather_object(every, ids)
            ids = [i for rank_ids in every for i in rank_ids]
        if rank == 0:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "ranks": world, "ids": sorted(ids),
                                    "loss": squared.item() / global_samples}) + "\n")
        if step % 3 == 0:
            with checkpoints.save(step, loader) as path:
                if rank == 0:
                    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()},
                               os.path.join(path, "model.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
