"""A plain PyTorch training loop over a resumable stream, with DataLoader workers, checkpointed and resumed exactly.

    python examples/torch_loop.py OUTPUT_DIR STEPS     # run it again with more steps: it continues where it saved
    torchrun --nproc_per_node 2 examples/torch_loop.py OUTPUT_DIR STEPS     # the same on 2 ranks
"""

import os
import sys

import torch
import torch.distributed as dist

from resumable_stream import Checkpoints, ResumableStream, StreamConfig, StreamLoader


def batch_of(rows):          # collate_fn: rows (dicts with the dataset's columns) -> what the model trains on
    ids = torch.tensor([row["id"] for row in rows])
    return ids, (ids % 7).float().unsqueeze(1)


if __name__ == "__main__":
    output_dir, steps = sys.argv[1], int(sys.argv[2])
    if "WORLD_SIZE" in os.environ:              # torchrun
        dist.init_process_group("gloo")
    config = StreamConfig.from_yaml(os.path.join(os.path.dirname(__file__), "tiny", "stream.yaml"))
    loader = StreamLoader(ResumableStream(config, num_workers=2), batch_size=8, collate_fn=batch_of, num_workers=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)

    checkpoints = Checkpoints(output_dir, keep=2)
    start = checkpoints.resume(loader)          # the newest complete checkpoint's step (0: none); the loader is restored
    if start:
        saved = torch.load(os.path.join(checkpoints.path(start), "model.pt"))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    for step, (ids, target) in enumerate(loader, start=start + 1):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(ids.float().unsqueeze(1) / 1000), target)
        loss.backward()
        optimizer.step()
        print(step, ids.tolist(), loss.item())
        if step % 5 == 0 or step == steps:
            with checkpoints.save(step, loader) as path:     # your files first; then the data's state, on every rank
                if not dist.is_initialized() or dist.get_rank() == 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                               os.path.join(path, "model.pt"))
        if step == steps:
            break
