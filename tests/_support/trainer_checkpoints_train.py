"""One training run whose data position is kept by another package's own checkpointing (tests/trainings/
test_trainer_checkpoints.py): each rank logs, per step, the ids of the samples it trained on and its loss.

    python -m torch.distributed.run --nproc_per_node W trainer_checkpoints_train.py VIA OUT DATA \
        --steps S --every K [--hold]

VIA is how the state is saved and restored, each through that package's own calls:

* ``dcp``: torch.distributed.checkpoint (torchtitan's pattern): ``dcp.save({"model", "optimizer", "dataloader":
  loader, "train": step})`` into ``OUT/ckpt/step-N``, ``dcp.load`` of the same dict on restart;
* ``accelerate``: ``Accelerator.register_for_checkpointing(loader)``, ``save_state`` / ``load_state`` (it writes
  rank 0's ``loader.state_dict()`` only);
* ``lightning``: Lightning's ``Trainer`` with the loader as its train dataloader, its ``ModelCheckpoint`` every K
  steps and ``fit(ckpt_path="last")`` (rank 0 writes the checkpoint; its fit loop takes one batch ahead:
  ``StreamLoader(trainer_prefetch=1)``);
* ``statefuldl``: torchdata's ``StatefulDataLoader`` over the bare stream, its state saved per rank with
  ``torch.save`` (its semantics: a state per rank, from its workers).

``--hold``: once the checkpoint of step K is complete and step S is trained, every rank writes ``held-R`` and
sleeps until it is SIGKILLed (the test kills the whole process group). The restart (no ``--hold``) resumes from
the newest complete checkpoint and trains to step S. Model, optimizer and data are seeded alike in every run,
so the resumed steps K+1..S must repeat the held run's exactly: the same sample ids, the same losses.

``--accumulate`` (dcp, accelerate, statefuldl's loop): ``data.elastic`` with each optimizer step accumulating
``loader.micro_batches_per_step`` micro-batches (one of each of the 4 partitions, data.elastic_determinism) and
the loss summed over the global batch, logged all-reduced: a restart on another number of ranks trains the
same steps (its logged loss the same up to the order of the float additions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader

BATCH = 4
FEATURES = 8


def features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression sample per id: 8 features in [0, 1) and a target."""
    x = ((ids[:, None] * torch.arange(1, FEATURES + 1)[None, :] * 7919) % 1000).float() / 1000.0
    return x, x.sum(dim=1, keepdim=True) * 0.5 + (ids[:, None] % 3).float()


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([int(r["id"]) for r in rows], dtype=torch.int64)
    x, y = features(ids)
    return {"ids": ids, "x": x, "y": y}


def config(data: str, elastic: bool = False) -> StreamConfig:
    return StreamConfig.from_dict({"dataset_name_or_path": "parquet", "data_files": os.path.join(data, "*.parquet"),
                                   "shuffle": True, "shuffle_seed": 3, "buffer_size": 32, "num_partitions": 4,
                                   "elastic": elastic})


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Log:
    """Each trained step of this rank, one JSON line: step, sample ids, loss (appended: a restart adds its own)."""

    def __init__(self, out: str, rank: int, run: str):
        self.path, self.run = os.path.join(out, f"log-rank{rank}.jsonl"), run

    def step(self, step: int, ids: torch.Tensor, loss: torch.Tensor) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"run": self.run, "step": step, "ids": ids.tolist(), "loss": loss.item()}) + "\n")


def hold(out: str, rank: int) -> None:
    with open(os.path.join(out, f"held-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(60)


def mark_complete(path: str) -> None:
    """After a save returned on every rank: rank 0 marks the checkpoint complete (what a restart looks for)."""
    if dist.is_initialized():
        dist.barrier()
    if rank_of() == 0:
        with open(os.path.join(path, "complete"), "w") as f:
            f.write("1")


def newest_complete(root: str) -> tuple[int, str | None]:
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")
                   and os.path.isfile(os.path.join(root, n, "complete"))) if os.path.isdir(root) else []
    return (steps[-1], os.path.join(root, f"step-{steps[-1]}")) if steps else (0, None)


def rank_of() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_of() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def accumulated_step(net, optimizer, batches, per_step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of ``per_step`` micro-batches per rank, the loss summed and divided by the global
    batch's samples (DDP averages the gradients over ranks: the global mean's gradient on any number of
    ranks). Returns this rank's sample ids and the global loss (all-reduced)."""
    optimizer.zero_grad()
    ids, squared = [], torch.zeros(())
    global_samples = BATCH * per_step * world
    for _ in range(per_step):
        batch = next(batches)
        errors = ((net(batch["x"]) - batch["y"]) ** 2).sum()
        (errors * world / global_samples).backward()
        ids.append(batch["ids"])
        squared += errors.detach()
    optimizer.step()
    if dist.is_initialized():
        dist.all_reduce(squared)
    return torch.cat(ids), squared / global_samples


def train_step(net, optimizer, batch) -> torch.Tensor:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(net(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss.detach()


def run_loop(args, via: str) -> None:
    """dcp, accelerate, statefuldl: a plain loop; only the saving and restoring differ."""
    accelerator = None
    if via == "accelerate":       # it sets up the process group (gloo on CPU)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    rank, world = rank_of(), world_of()
    log = Log(args.out, rank, "held" if args.hold else "resumed")
    stream = ResumableStream(config(args.data, elastic=args.accumulate), rank=rank, world_size=world, num_workers=2)
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    if via == "statefuldl":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(stream, batch_size=BATCH, collate_fn=collate, num_workers=2)
    else:
        loader = StreamLoader(stream, BATCH, collate_fn=collate, num_workers=2)
    if via == "accelerate":
        net, optimizer = accelerator.prepare(net, optimizer)
        accelerator.register_for_checkpointing(loader)
    elif world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    root = os.path.join(args.out, "ckpt")
    start, path = newest_complete(root)
    if path is not None:
        if via == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optimizer_state = get_state_dict(net, optimizer)    # the optimizer's, initialized
            state = {"model": model_state, "optimizer": optimizer_state, "dataloader": loader}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        elif via == "accelerate":
            accelerator.load_state(path)
        else:
            net.load_state_dict(torch.load(os.path.join(path, "model.pt"), weights_only=True))
            optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
            loader.load_state_dict(torch.load(os.path.join(path, f"loader-rank{rank}.pt"), weights_only=True))
    step = start
    batches = iter(loader)
    for batch in batches:
        step += 1
        if args.accumulate:     # this batch is the step's first micro-batch
            log.step(step, *accumulated_step(net, optimizer, itertools.chain([batch], batches),
                                             loader.micro_batches_per_step, world))
        else:
            log.step(step, batch["ids"], train_step(net, optimizer, batch))
        if step % args.every == 0:
            path = os.path.join(root, f"step-{step}")
            if via == "dcp":
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict

                model_state, optimizer_state = get_state_dict(net, optimizer)
                dcp.save({"model": model_state, "optimizer": optimizer_state, "dataloader": loader},
                         checkpoint_id=path)
            elif via == "accelerate":
                accelerator.save_state(path)
            else:
                os.makedirs(path, exist_ok=True)
                if rank == 0:
                    torch.save(net.state_dict(), os.path.join(path, "model.pt"))
                    torch.save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
                torch.save(loader.state_dict(), os.path.join(path, f"loader-rank{rank}.pt"))
            mark_complete(path)
        if step == args.steps:
            if args.hold:
                hold(args.out, rank)
            break


def run_lightning(args) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(pl.LightningModule):
        def __init__(self, log: Log):
            super().__init__()
            self.net, self.log_file = model(), log

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
            self.log_file.step(self.trainer.global_step + 1, batch["ids"], loss.detach())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step == args.steps and args.hold:
                last = os.path.join(args.out, "ckpt", f"step-{args.steps - args.steps % args.every}.ckpt")
                while not os.path.isfile(last):      # rank 0 writes it after this step's ModelCheckpoint
                    time.sleep(0.1)
                hold(args.out, self.global_rank)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    stream = ResumableStream(config(args.data), rank=rank, world_size=world, num_workers=2)
    loader = StreamLoader(stream, BATCH, collate_fn=collate, num_workers=2, trainer_prefetch=args.trainer_prefetch)
    root = os.path.join(args.out, "ckpt")
    checkpoints = ModelCheckpoint(dirpath=root, filename="step-{step}", every_n_train_steps=args.every,
                                  save_top_k=-1, save_last=True, auto_insert_metric_name=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         max_steps=args.steps, callbacks=[checkpoints], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    resume = os.path.join(root, "last.ckpt")
    module = Module(Log(args.out, rank, "held" if args.hold else "resumed"))
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume if os.path.isfile(resume) else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("via", choices=["dcp", "accelerate", "lightning", "statefuldl"])
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--trainer-prefetch", type=int, default=1, help="lightning: StreamLoader(trainer_prefetch)")
    parser.add_argument("--accumulate", action="store_true",
                        help="data.elastic, steps of one micro-batch per partition (not lightning)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.via == "lightning":
        run_lightning(args)
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.via != "accelerate":
        dist.init_process_group("gloo")
    run_loop(args, args.via)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
