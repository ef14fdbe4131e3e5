"""Where rows come from: readers of datasets cut into shards we can name.

``base.py`` (the ``Source`` interface), one module per reader (``parquet.py``, with the footer, row and
row-group check modules ``parquet_local.py``, ``parquet_rows.py``, ``parquet_checks.py``; ``webdataset.py``
with ``tar_index.py``; ``datasets_stream.py`` and ``map_style.py`` for what ``datasets`` reads),
``prefetch.py``, ``index.py`` (the dataset index a job saves), ``resolve.py`` (which files a config means)
and ``open.py`` (``open_source``). The registry of the formats we index is
:mod:`resumable_stream.config.formats`, re-exported here for readers added from outside.
"""

from ..config.formats import SourceFormat, register, unregister
from ..io.net import RetryPolicy
from .base import READ_BATCH_ROWS, IndexedReader, ShardInfo, Source
from .open import open_indexed, open_source

__all__ = ["READ_BATCH_ROWS", "IndexedReader", "RetryPolicy", "ShardInfo", "Source", "SourceFormat", "open_indexed",
           "open_source", "register", "unregister"]
