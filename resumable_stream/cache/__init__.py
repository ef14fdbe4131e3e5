"""Optional local block cache (``data.cache_dir``) and its warmup.

``CachedSource`` wraps a source with a read-through block store on ``diskcache``; the stream
wraps its source automatically when ``cache_dir`` is set. ``plan_warmup`` / ``run_warmup``
fill the cache with the blocks given ranks will read next (:mod:`resumable_stream.cache.warmup`).
"""

from .cached_source import CachedSource
from .store import DEFAULT_BLOCK_ROWS, BlockStore, CorruptBlock, decode_block, encode_block

__all__ = ["CachedSource", "BlockStore", "CorruptBlock", "DEFAULT_BLOCK_ROWS", "decode_block", "encode_block",
           "plan_warmup", "run_warmup", "WarmupPlan", "WarmupResult"]


def __getattr__(name):   # the warmup pulls in the stream (torch): import it only when asked for
    if name in ("plan_warmup", "run_warmup", "WarmupPlan", "WarmupResult"):
        from . import warmup

        return getattr(warmup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
