"""Pick the accelerator and the matching distributed backend: CUDA/nccl, Ascend NPU/hccl, or CPU/gloo.

``torch_npu`` is imported only when it is installed; nothing here needs it to import the package.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Device:
    kind: str      # "cuda" | "npu" | "cpu"
    backend: str   # "nccl" | "hccl" | "gloo"


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def detect_device() -> Device:
    if torch.cuda.is_available():
        return Device("cuda", "nccl")
    if npu_available():
        return Device("npu", "hccl")
    return Device("cpu", "gloo")


# The collective backends each device kind can run data parallelism with.
BACKENDS = {"cpu": ("gloo",), "cuda": ("nccl", "gloo"), "npu": ("hccl",)}


def data_parallel_arguments(kind: str, world_size: int, train: dict) -> dict:
    """TrainingArguments values that make every rank of a ``world_size`` job train one model (DDP) on a ``kind``
    device: on CPU accelerate reports ``DistributedType.NO`` unless ``use_cpu`` is set, and each rank would train
    its own copy; with ``deepspeed`` its engine does the data parallelism."""
    allowed = BACKENDS[kind]
    backend = train.get("ddp_backend")
    if backend is not None and world_size > 1 and backend not in allowed:
        raise ConfigError(f"train.ddp_backend: got {backend!r}; allowed on {kind}: {', '.join(allowed)}")
    values = {}
    # DeepSpeed sets CPU ranks up itself (its CPU accelerator); use_cpu would keep accelerate off its path
    if kind == "cpu" and not train.get("use_cpu") and not train.get("deepspeed"):
        values["use_cpu"] = True
    if world_size > 1 and backend is None:
        values["ddp_backend"] = allowed[0]
    return values
