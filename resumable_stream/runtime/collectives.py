"""What rank 0 found, told to every rank of a ``torch.distributed`` job (JSON bytes, never pickle)."""

from __future__ import annotations


def shared_over_dist(rank: int, world_size: int) -> bool:
    """The ranks ``rank`` of ``world_size`` are those of an initialized process group (so collectives reach
    them all)."""
    if world_size <= 1:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size
            and dist.get_rank() == rank)


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (its length, then its bytes as a uint8 tensor); the others pass None."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


def max_over_ranks(value: int) -> int:
    """The largest of every rank's ``value`` (an all-reduce of one int64)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def max_each_over_ranks(values: list[int]) -> list[int]:
    """Each of ``values``, the largest over every rank (one all-reduce of len(values) int64)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.cpu().tolist()]
