"""Streams: the partition reader and its windows, the stream core, the single stream, the mixture."""

from .mixture import MixtureStream, open_stream
from .single import ResumableStream

__all__ = ["MixtureStream", "ResumableStream", "open_stream"]
