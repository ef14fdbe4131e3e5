"""Optional local block cache (``data.cache_dir``): ``CachedSource`` wraps a source with a read-through block
store; filling it ahead runs the stream's readers, so it lives above the stream (:mod:`resumable_stream.app.warmup`)."""

from .cached_source import CachedSource
from .store import DEFAULT_BLOCK_ROWS, BlockStore, CorruptBlock, decode_block, encode_block

__all__ = ["CachedSource", "BlockStore", "CorruptBlock", "DEFAULT_BLOCK_ROWS", "decode_block", "encode_block"]
