"""Exactly resumable, rank-aware, shuffled streams over HuggingFace datasets."""

from .config import MixtureConfig, StreamConfig
from .errors import ConfigError, ResumableStreamError, SidecarError, SourceError, StreamMismatchError
from .mixture import MixtureStream, open_stream
from .sources import webdataset  # noqa: F401  (registers the indexed WebDataset tar format with source.py)
from .stream import ResumableStream
from .stream_base import Stream

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
