"""Rows lost, duplicated and reordered by a resume: VeOmni's own iterable dataset beside ours, inside VeOmni.

    .ci/veomni builds .venv-veomni; then (2 ranks, gloo, CPU):
    .venv-veomni/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/veomni_resume.py [--rows 2000]

Both run VeOmni 0.1.12's own data path up to the trainer: its ``build_dataset`` / ``build_dataloader`` registries,
its ``MakeMicroBatchCollator``, and the state its ``CheckpointerCallback`` saves (``train_dataloader.state_dict()``
on every rank) and loads into a fresh dataloader before the first step of a resume. The trainer's model is left
out: a step is ``next(dataloader)``, whose micro-batches carry the row ids.

- ``veomni``: ``datasets_type: iterable`` (``build_iterable_dataset``: ``load_dataset(streaming=True)``,
  ``.shuffle(seed, buffer_size=10_000)``, ``split_dataset_by_node``) in its ``native`` dataloader
  (torchdata's ``StatefulDataLoader``, ``dyn_bsz: false``, snapshots every ``save_steps``). Its buffer is a
  constant in that function; the 100-row case makes the same three calls with ``buffer_size=100``.
- ``ours``: ``datasets_type`` / ``dataloader.type: resumable_stream`` over the same files, shuffled through a
  window of the same size.

A run reads ``--steps`` steps (at most an epoch), saves at ``--save`` and is killed at ``--kill``; the resume
loads the saved state and reads on to ``--steps`` or the end of its data. Against an uninterrupted run's steps
after the save (every rank's): ``lost`` rows it read that the resume never did, ``duplicated`` rows the resume
read that were read before the save (or twice), ``steps differing`` steps whose rows are not the uninterrupted
run's, ``steps after resume`` how many the resume read.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _ids_of_step(item) -> list[int]:
    return [i for micro in item for i in micro]


class _RowList:
    """VeOmni's transform slot: a row -> [row] (its collator takes the first of each)."""

    def __call__(self, row, **kwargs):
        return [row]


class _Ids:
    """VeOmni's internal collator slot: a micro-batch of rows -> their ids."""

    def __call__(self, features):
        return [int(f["id"]) for f in features]


def build(system: str, data_dir: str, yml: str, buffer: int, batch: int, num_workers: int, save: int):
    from veomni.data.data_loader import build_dataloader
    from veomni.data.dataset import IterativeDataset, build_dataset, get_data_files
    from veomni.distributed.parallel_state import get_parallel_state

    if system == "ours":
        dataset = build_dataset("resumable_stream", train_path=yml, transform=_RowList(),
                                dataloader={"type": "resumable_stream"})
        dl_type = "resumable_stream"
    elif buffer == 10_000:                 # VeOmni's own builder, as it is
        dataset = build_dataset("iterable", train_path=data_dir, transform=_RowList(), seed=42)
        dl_type = "native"
    else:                                  # the same three calls with another buffer
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        files, ext = get_data_files(data_dir)
        hf = load_dataset(ext, data_files=files, split="train", streaming=True).shuffle(seed=42, buffer_size=buffer)
        ps = get_parallel_state()
        dataset = IterativeDataset(split_dataset_by_node(hf, ps.dp_rank, ps.dp_size), transform=_RowList())
        dl_type = "native"
    ps = get_parallel_state()
    return build_dataloader(dl_type, dataset=dataset, micro_batch_size=batch // 2, global_batch_size=batch * ps.dp_size,
                            dataloader_batch_size=batch, max_seq_len=64, train_steps=10**6, dyn_bsz=False,
                            num_workers=num_workers, pin_memory=False, prefetch_factor=2 if num_workers else None, collate_fn=_Ids(),
                            save_steps=save, seed=42)


def read(loader, steps: int) -> list[list[int]]:
    out, it = [], iter(loader)
    for _ in range(steps):
        try:
            out.append(_ids_of_step(next(it)))
        except StopIteration:
            break
    return out


def measure(system: str, args, data_dir: str, yml: str, buffer: int, workers: int) -> dict:
    straight = read(build(system, data_dir, yml, buffer, args.batch, workers, args.save), args.steps)
    loader = build(system, data_dir, yml, buffer, args.batch, workers, args.save)
    it, state, t0 = iter(loader), None, 0.0
    for step in range(1, args.kill + 1):
        next(it)
        if step == args.save:
            state = loader.state_dict()          # what CheckpointerCallback saves at save_steps
    del it, loader                               # the kill
    resumed_loader = build(system, data_dir, yml, buffer, args.batch, workers, args.save)
    t0 = time.perf_counter()
    try:
        resumed_loader.load_state_dict(state)
        after = read(resumed_loader, args.steps - args.save)
    except Exception as e:                        # the resume itself fails: reported as such
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    first = time.perf_counter() - t0
    before = {i for s in straight[:args.save] for i in s}
    want = straight[args.save:]
    got_rows = [i for s in after for i in s]
    want_rows = {i for s in want for i in s}
    dup = sum(1 for i in got_rows if i in before) + (len(got_rows) - len(set(got_rows)))
    differing = sum(1 for k in range(max(len(want), len(after)))
                    if k >= len(want) or k >= len(after) or sorted(want[k]) != sorted(after[k]))
    return {"lost": len(want_rows - set(got_rows)), "duplicated": dup, "steps_differing": differing,
            "steps_expected": len(want), "steps_after_resume": len(after), "rows_expected": len(want_rows),
            "resume_s": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="rows per step and rank")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers per rank")
    p.add_argument("--save", type=int, default=10)
    p.add_argument("--kill", type=int, default=13)
    p.add_argument("--steps", type=int, default=30, help="steps of a run (the resume reads on to this step)")
    p.add_argument("--buffers", type=int, nargs="+", default=[10_000, 100])
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo")
    from veomni.distributed.parallel_state import init_parallel_state

    import resumable_stream.integrations.veomni  # noqa: F401  (registers resumable_stream)
    from resumable_stream.testing import write_parquet_dataset

    init_parallel_state(dp_size=dist.get_world_size(), dp_shard_size=dist.get_world_size(), device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = [tempfile.mkdtemp(prefix="veomni-bench-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    data_dir = os.path.join(root[0], "data")
    if rank == 0:
        write_parquet_dataset(data_dir, rows=args.rows, files=args.files, row_group_size=100)
    dist.barrier()
    results = []
    for buffer in args.buffers:
        yml = os.path.join(root[0], f"stream-{buffer}.yml")
        if rank == 0:
            with open(yml, "w", encoding="utf-8") as f:
                f.write(f"data:\n  dataset_name_or_path: parquet\n  data_files: {data_dir}/*.parquet\n"
                        f"  shuffle: true\n  shuffle_seed: 42\n  buffer_size: {buffer}\n")
        dist.barrier()
        for workers in args.workers:
            for system in ("veomni", "ours"):
                mine = measure(system, args, data_dir, yml, buffer, workers)
                every = [None] * world
                dist.all_gather_object(every, mine)
                results.append((system, buffer, workers, every))
    if rank == 0:
        print(f"{args.rows} rows in {args.files} parquet files, {world} ranks, {args.batch} rows per step and "
              f"rank; saved at step {args.save}, killed at step {args.kill}, resumed to step {args.steps}")
        print("| system | buffer | workers | rows lost | rows duplicated | steps differing | steps after resume |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for system, buffer, workers, every in results:
            errors = [r["error"] for r in every if "error" in r]
            if errors:
                print(f"| {system} | {buffer:,} | {workers} | resume fails: {errors[0]} | | | |")
                continue
            tot = {k: sum(r[k] for r in every) for k in ("lost", "duplicated", "rows_expected")}
            differing = max(r["steps_differing"] for r in every)
            after = min(r["steps_after_resume"] for r in every)
            expected = every[0]["steps_expected"]
            print(f"| {system} | {buffer:,} | {workers} | {tot['lost']} of {tot['rows_expected']} | "
                  f"{tot['duplicated']} | {differing} of {expected} | {after} of {expected} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
