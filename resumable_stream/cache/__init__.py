"""Optional local block cache (``data.cache_dir``).

``CachedSource`` wraps a source with a read-through block store on ``diskcache``; the stream wraps its source
automatically when ``cache_dir`` is set. Filling the cache ahead (``plan_warmup`` / ``run_warmup``) runs
the stream's own readers, so it lives above the stream: :mod:`resumable_stream.app.warmup`.
"""

from .cached_source import CachedSource
from .store import DEFAULT_BLOCK_ROWS, BlockStore, CorruptBlock, decode_block, encode_block

__all__ = ["CachedSource", "BlockStore", "CorruptBlock", "DEFAULT_BLOCK_ROWS", "decode_block", "encode_block"]
