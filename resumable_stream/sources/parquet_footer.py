"""A parquet file's footer: found in the file's tail, parsed (bounded), digested, and turned into the index
entry of the file (identity, footer digest, row-group layout) and its features.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SourceError
from .parquet_local import simple_features

# Bytes read from a file's end to get its footer in one request (a bigger footer takes a second one).
FOOTER_TAIL_BYTES = 64 * 1024


MAGIC = b"PAR1"


def footer_digest(footer: bytes) -> str:
    return hashlib.blake2b(footer, digest_size=16).hexdigest()


def split_footer(tail: bytes, size: int, path: str) -> int:
    """The length of the footer (metadata + length + magic) that ``tail``, the end of a file of ``size``
    bytes, ends with. Raises SourceError when the bytes are no parquet footer."""
    if len(tail) < 8 or tail[-4:] != MAGIC:
        raise SourceError(f"data file {path!r}: not a parquet file (no PAR1 magic at its end)")
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length + 4 > size:
        raise SourceError(f"data file {path!r}: corrupt parquet footer (footer of {length} bytes in a file of {size})")
    return length


def row_group_layout(metadata: pq.FileMetaData) -> list[list[int]]:
    """``[rows, first byte, end byte]`` per row group: the span of its column chunks."""
    out = []
    for i in range(metadata.num_row_groups):
        rg = metadata.row_group(i)
        lo, hi = None, 0
        for j in range(rg.num_columns):
            col = rg.column(j)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + col.total_compressed_size)
        out.append([rg.num_rows, lo or 0, hi])
    return out


def parse_footer(footer: bytes, path: str) -> pq.FileMetaData:
    try:
        return pq.read_metadata(pa.BufferReader(footer))
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None


def file_entry(identity: dict, footer: bytes) -> dict[str, Any]:
    """An index entry: the file's identity plus its footer digest and row-group layout."""
    md = parse_footer(footer, identity["path"])
    return {**identity, "footer": footer_digest(footer), "footer_bytes": len(footer),
            "row_groups": row_group_layout(md)}


def features_of(footer: bytes, path: str) -> dict[str, Any]:
    """The features ``datasets``' parquet builder infers from a file, those of its arrow schema, as a dict
    (``Features.to_dict()``). Plain columns need no ``datasets`` (``local_parquet.simple_features``)."""
    try:
        schema = pq.read_schema(pa.BufferReader(footer))
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None
    simple = simple_features(schema)
    if simple is not None:
        return simple
    import datasets

    return datasets.Features.from_arrow_schema(schema).to_dict()


# The keys of a parquet entry that describe its layout, not the file's identity.
PARQUET_LAYOUT_KEYS = ("row_groups", "footer_bytes")
