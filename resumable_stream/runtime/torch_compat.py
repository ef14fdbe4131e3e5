"""torch where it is installed, nothing where it is not: the stream core (config, plan, partitions, sources,
sidecars, cache, checkpoint, the loader without workers) runs without torch, e.g. under MindSpore.

A stream is a ``torch.utils.data.IterableDataset`` when torch is importable (so a DataLoader takes it as
before), a plain object otherwise; ``worker_info()`` is then None (no DataLoader worker can be reading it)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

try:
    import torch.utils.data as _torch_data
except ImportError:       # not installed (or blocked): the core needs none of it
    _torch_data = None

HAVE_TORCH = _torch_data is not None
IterableDataset: Any = _torch_data.IterableDataset if HAVE_TORCH else object


def worker_info() -> Any:
    """torch's ``get_worker_info()``: the DataLoader worker this code runs in, None in the main process."""
    return _torch_data.get_worker_info() if HAVE_TORCH else None


def data_loader(dataset: Any, what: str, **kwargs: Any) -> Any:
    """A ``torch.utils.data.DataLoader``; without torch a ``ConfigError`` naming ``what`` needed it."""
    if not HAVE_TORCH:
        raise ConfigError(f"{what}: needs torch's DataLoader, and torch is not installed; install torch, or "
                          "read the stream in this process (num_workers=0, pin_memory=False)")
    return _torch_data.DataLoader(dataset, **kwargs)
