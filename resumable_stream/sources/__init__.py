"""Where rows come from: readers of datasets cut into shards we can name, and the registry of formats.

``base.py`` (the ``Source`` interface), ``net.py`` (retries, timeouts, faults), ``resolve.py`` (resolution,
identities, fingerprint, index building and checking), one module per reader (``parquet.py``,
``datasets_stream.py``, ``map_style.py``), ``registry.py`` (the formats we index), ``open.py``
(``open_source``). Names are imported lazily: ``config.py`` consults the registry, and the readers import
``config.py``.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "Source": "base", "ShardInfo": "base", "IndexedReader": "base", "READ_BATCH_ROWS": "base",
    "RetryPolicy": "net", "open_source": "open", "open_indexed": "open",
    "SourceFormat": "registry", "register": "registry", "unregister": "registry",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
