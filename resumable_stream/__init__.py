"""Exactly resumable, rank-aware, shuffled streams over HuggingFace datasets."""

from .config import MixtureConfig, StreamConfig
from .errors import ConfigError, ResumableStreamError, SidecarError, SourceError, StreamMismatchError
from .mixture import MixtureStream, open_stream
from .stream import ResumableStream

__all__ = [
    "StreamConfig",
    "ResumableStream",
    "MixtureConfig",
    "MixtureStream",
    "open_stream",
    "ConfigError",
    "StreamMismatchError",
    "SidecarError",
    "SourceError",
    "ResumableStreamError",
]
__version__ = "0.1.0"
