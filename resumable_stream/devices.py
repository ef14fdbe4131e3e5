"""Pick the accelerator and the matching distributed backend: CUDA/nccl, Ascend NPU/hccl, or CPU/gloo.

``torch_npu`` is imported only when it is installed; nothing here needs it to import the package.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


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
