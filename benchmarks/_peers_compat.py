"""Import shims for the peers in the benchmark venv (see benchmarks/make_bench_venv.sh).

``import streaming`` (mosaicml-streaming 0.13.0) imports ``streaming.vision``, which imports two names of
torchvision; no torchvision build loads beside torch 2.13.0, and the benchmark reads no images, so those two
names are stubbed (a call to them raises). Nothing else of either peer is changed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


def stub_torchvision() -> bool:
    """Put a minimal ``torchvision`` in ``sys.modules`` unless a real one imports. True when stubbed."""
    if "torchvision" in sys.modules:
        return False
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401

            return False
        except Exception:
            pass

    def unavailable(*args, **kwargs):
        raise RuntimeError("torchvision is stubbed in the benchmark venv (benchmarks/_peers_compat.py)")

    class VisionDataset:   # streaming.vision.base subclasses it; never instantiated here
        def __init__(self, *args, **kwargs):
            unavailable()

    root = types.ModuleType("torchvision")
    ds = types.ModuleType("torchvision.datasets")
    ds.VisionDataset = VisionDataset
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    fn.to_tensor = unavailable
    root.datasets, root.transforms, tr.functional = ds, tr, fn
    root.__version__ = "0.0-stub"
    for name, mod in (("torchvision", root), ("torchvision.datasets", ds), ("torchvision.transforms", tr),
                      ("torchvision.transforms.functional", fn)):
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
    return True


def litdata_allow_http() -> None:
    """Let litdata's obstore downloads reach a plain-http endpoint (the loopback S3 server).

    litdata 0.2.76 downloads chunks with obstore when it is installed, with client options that do not allow
    http (real S3 is https), so against ``http://127.0.0.1`` every chunk GET fails with ``BadScheme``. This
    adds ``allow_http`` to those options and changes nothing else: chunks still go through obstore, as they
    would on AWS."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
