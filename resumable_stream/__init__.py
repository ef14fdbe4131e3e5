"""Exactly resumable, rank-aware, shuffled streams over HuggingFace datasets."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import ConfigError, ResumableStreamError, SidecarError, SourceError, StreamMismatchError

if TYPE_CHECKING:
    from .config.stream_config import MixtureConfig, StreamConfig
    from .integrations.checkpoints import Checkpoints
    from .loader import StreamLoader
    from .stream.base import Stream
    from .stream.mixture import MixtureStream, open_stream
    from .stream.single import ResumableStream

# The public names whose modules import torch, pyarrow and datasets: loaded on first use (PEP 562), so that
# `resumable-stream --help` and the other modules of the package start in well under a second.
_LAZY = {
    "StreamConfig": "config.stream_config",
    "MixtureConfig": "config.stream_config",
    "ResumableStream": "stream.single",
    "MixtureStream": "stream.mixture",
    "open_stream": "stream.mixture",
    "Stream": "stream.base",
    "StreamLoader": "loader",
    "Checkpoints": "integrations.checkpoints",
}

__all__ = [
    "StreamConfig",
    "ResumableStream",
    "MixtureConfig",
    "MixtureStream",
    "open_stream",
    "Stream",
    "StreamLoader",
    "Checkpoints",
    "ConfigError",
    "StreamMismatchError",
    "SidecarError",
    "SourceError",
    "ResumableStreamError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value     # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

