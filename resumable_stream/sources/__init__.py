"""Where rows come from: readers of datasets cut into shards we can name (docs/architecture.md). The registry of
the formats we index, :mod:`resumable_stream.config.formats`, is re-exported here for readers added from outside.
"""

from ..config.formats import SourceFormat, register, unregister
from ..io.net import RetryPolicy
from .base import READ_BATCH_ROWS, IndexedReader, ShardInfo, Source
from .open import open_indexed, open_source

__all__ = ["READ_BATCH_ROWS", "IndexedReader", "RetryPolicy", "ShardInfo", "Source", "SourceFormat", "open_indexed",
           "open_source", "register", "unregister"]
