"""Transforms from raw rows to training examples (text and chat messages, optional packing)."""

from .config import TransformConfig
from .errors import TransformError
from .text import IGNORE_INDEX, TextProcessor, collate, tokenizer_digest

__all__ = ["IGNORE_INDEX", "TextProcessor", "TransformConfig", "TransformError", "collate", "tokenizer_digest"]
