"""Device and backend choice; nothing NPU-specific is needed to import the package."""

import subprocess
import sys
import types

import pytest
import torch

from resumable_stream import ConfigError
from resumable_stream.runtime import devices


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


@pytest.mark.slow
def test_import_does_not_touch_torch_npu():
    code = ("import sys, resumable_stream, resumable_stream.integrations.transformers, resumable_stream.runtime.devices; "
            "print('torch_npu' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


# ------------------------------------------------------------------ data parallelism: what accelerate makes of it
@pytest.mark.parametrize(("kind", "expected"), [
    ("cpu", {"use_cpu": True, "ddp_backend": "gloo"}),
    ("cuda", {"ddp_backend": "nccl"}),
    ("npu", {"ddp_backend": "hccl"}),
])
def test_data_parallel_arguments_per_device(kind, expected):
    assert devices.data_parallel_arguments(kind, 2, {}) == expected
    # a single process needs no backend; on CPU use_cpu stays (it only names the device)
    assert devices.data_parallel_arguments(kind, 1, {}) == {k: v for k, v in expected.items() if k == "use_cpu"}
    # the user's own (valid) choice is kept
    assert "ddp_backend" not in devices.data_parallel_arguments(kind, 2, {"ddp_backend": expected["ddp_backend"]})


def test_a_backend_the_device_cannot_run_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.ddp_backend: got 'nccl'; allowed on cpu: gloo"):
        devices.data_parallel_arguments("cpu", 2, {"ddp_backend": "nccl"})
    with pytest.raises(ConfigError, match=r"train.ddp_backend: got 'gloo'; allowed on npu: hccl"):
        devices.data_parallel_arguments("npu", 2, {"ddp_backend": "gloo"})


@pytest.mark.parametrize(("kind", "distributed_type"), [("cpu", "MULTI_CPU"), ("cuda", "MULTI_GPU"),
                                                        ("npu", "MULTI_NPU")])
def test_accelerate_wraps_the_model_for_data_parallelism_on_every_device(monkeypatch, kind, distributed_type):
    """accelerate's own detection (what TrainingArguments hands PartialState: cpu=use_cpu, backend=ddp_backend),
    under torchrun's environment, with the device faked present: a data-parallel type on each device kind."""
    import accelerate.state
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: kind == "cuda")
    monkeypatch.setattr(accelerate.state, "is_npu_available", lambda *a, **k: kind == "npu")
    if hasattr(accelerate.state, "get_torch_accelerator_backend"):    # accelerate >= 1.16 asks torch.accelerator
        monkeypatch.setattr(accelerate.state, "get_torch_accelerator_backend",
                            lambda *a, **k: (None, None) if kind == "cpu" else (kind, None))
    args = devices.data_parallel_arguments(kind, 2, {})
    backend, found = PartialState._prepare_backend(object(), cpu=args.get("use_cpu", False),
                                                   backend=args.get("ddp_backend"))
    assert (found, backend) == (getattr(DistributedType, distributed_type), args["ddp_backend"])
    if kind == "cpu":   # the bug this guards against: without use_cpu, accelerate does not wrap the model
        assert PartialState._prepare_backend(object(), cpu=False, backend="gloo")[1] == DistributedType.NO
