"""What rank 0 found, told to every rank of a ``torch.distributed`` job (JSON bytes, never pickle)."""

from __future__ import annotations


def shared_over_dist(rank: int, world_size: int) -> bool:
    """The ranks ``rank`` of ``world_size`` are those of an initialized process group (collectives reach all)."""
    if world_size <= 1:
        return False
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size
            and dist.get_rank() == rank)


def barrier() -> None:
    """Wait for every rank (a no-op without an initialized torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _device():
    """Where the process group's collectives take their tensors: the current CUDA / NPU device for nccl / hccl,
    else the CPU (gloo)."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (its length, then its bytes as a uint8 tensor); the others pass None."""
    import torch
    import torch.distributed as dist

    device = _device()
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


def max_each_over_ranks(values: list[int]) -> list[int]:
    """Each of ``values``, the largest over every rank (one all-reduce of len(values) int64)."""
    import torch
    import torch.distributed as dist

    device = _device()
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.cpu().tolist()]


def max_over_ranks(value: int) -> int:
    """The largest of every rank's ``value`` (an all-reduce of one int64)."""
    return max_each_over_ranks([value])[0]


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (the lengths, then the bytes padded to the longest)."""
    import torch
    import torch.distributed as dist

    device, world = _device(), dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(t.item()) for t in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [bytes(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]
