"""Exactly resumable, rank-aware, shuffled streams over HuggingFace datasets."""

from .config import StreamConfig
from .errors import ConfigError, ResumableStreamError, SidecarError, SourceError, StreamMismatchError
from .stream import ResumableStream

__all__ = [
    "StreamConfig",
    "ResumableStream",
    "ConfigError",
    "StreamMismatchError",
    "SidecarError",
    "SourceError",
    "ResumableStreamError",
]
__version__ = "0.1.0"
