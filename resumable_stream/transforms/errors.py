"""The error a sample meets in the text transform."""

from __future__ import annotations

from ..errors import ResumableStreamError


class TransformError(ResumableStreamError, ValueError):
    """A sample cannot be turned into a training example under the configured policy
    (empty text, over-length with ``overlong: error``, malformed messages, ...).

    The message names the sample key and what was wrong; ``key`` holds the sample key.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key
