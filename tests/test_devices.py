"""Device and backend choice; nothing NPU-specific is needed to import the package."""

import subprocess
import sys
import types

import torch

from resumable_stream import devices


def test_cpu_gloo_without_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    assert devices.detect_device() == devices.Device("cpu", "gloo")


def test_cuda_nccl_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.detect_device() == devices.Device("cuda", "nccl")


def test_npu_hccl_when_torch_npu_is_installed(monkeypatch):
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert devices.detect_device() == devices.Device("npu", "hccl")
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert devices.detect_device() == devices.Device("cpu", "gloo")


def test_import_does_not_touch_torch_npu():
    code = ("import sys, resumable_stream, resumable_stream.trainer_patch, resumable_stream.devices; "
            "print('torch_npu' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"
