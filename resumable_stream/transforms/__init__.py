"""Transforms from raw rows to training examples (text, chat messages with optional packing, vision-language)."""

from ..config.transforms import TransformConfig
from .errors import TransformError
from .protocol import Processor
from .text import IGNORE_INDEX, TextProcessor, collate, collate_numpy, tokenizer_digest
from .vl import VLProcessor, collate_vl, collate_vl_numpy, load_processor

__all__ = ["IGNORE_INDEX", "Processor", "TextProcessor", "TransformConfig", "TransformError", "VLProcessor", "collate",
           "collate_numpy", "collate_vl", "collate_vl_numpy", "load_processor", "tokenizer_digest"]
