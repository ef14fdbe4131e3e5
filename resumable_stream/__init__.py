"""Exactly resumable, rank-aware, shuffled streams over HuggingFace datasets."""

from .config.stream_config import MixtureConfig, StreamConfig
from .errors import ConfigError, ResumableStreamError, SidecarError, SourceError, StreamMismatchError
from .runtime import moved_modules
from .stream.base import Stream
from .stream.mixture import MixtureStream, open_stream
from .stream.single import ResumableStream

__all__ = [
    "StreamConfig",
    "ResumableStream",
    "MixtureConfig",
    "MixtureStream",
    "open_stream",
    "Stream",
    "ConfigError",
    "StreamMismatchError",
    "SidecarError",
    "SourceError",
    "ResumableStreamError",
]
__version__ = "0.1.0"

moved_modules.install()   # the module names of 0.x (runtime/moved_modules.py)
