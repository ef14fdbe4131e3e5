"""The one message rank 0 broadcasts when a job opens its sources: each source's index (packed for parquet), the
footers rank 0 read building it and the order settings every rank must share, or rank 0's error. No pickle: an
8-byte magic, a length-prefixed JSON header, then the framed indexes and footers, every length checked.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import SourceError
from ..io.safe_files import JSONRefused, parse_json
from ..sources.index import decode_index
from ..sources.index import encode_message as encode_index_message

MAGIC = b"RSOPEN01"


def _framed(data: bytes) -> list[bytes]:
    return [struct.pack("<Q", len(data)), data]


def encode_message(sources: list[dict | None], agree: dict[str, Any], error: dict | None = None) -> bytes:
    """``sources``: per spec ``{"index": ..., "footers": {path: bytes}}``, or None for one not read through an
    index; ``error``: ``{"type", "message"}`` instead (rank 0 failed)."""
    import json

    head = {"agree": agree, "error": error,
            "sources": [None if s is None else {"footers": list(s["footers"])} for s in sources]}
    out = [MAGIC, *_framed(json.dumps(head, separators=(",", ":")).encode())]
    for s in sources:
        if s is not None:
            out += _framed(encode_index_message(s["index"]))
            for path in s["footers"]:
                out += _framed(s["footers"][path])
    return b"".join(out)


def decode_message(data: bytes) -> dict[str, Any]:
    """``{"agree", "error", "sources": [{"index", "footers"} or None]}`` from :func:`encode_message`'s bytes;
    a malformed message is a SourceError."""
    view, pos = memoryview(data), len(MAGIC)

    def take(what: str) -> bytes:
        nonlocal pos
        if pos + 8 > len(view):
            raise SourceError(f"the message from rank 0 is truncated before {what}")
        (n,) = struct.unpack_from("<Q", view, pos)
        if n > len(view) - pos - 8:
            raise SourceError(f"the message from rank 0: {what} of {n} bytes runs past its end ({len(view)} bytes)")
        pos += 8 + n
        return bytes(view[pos - n:pos])

    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise SourceError("the message from rank 0 is not a source message (no magic)")
    try:
        head = parse_json(take("its header"))
    except JSONRefused as e:
        raise SourceError(f"the message from rank 0: its header: {e}") from None
    if not (isinstance(head, dict) and isinstance(head.get("sources"), list)):
        raise SourceError("the message from rank 0: malformed header")
    sources = []
    for i, s in enumerate(head["sources"]):
        if s is None:
            sources.append(None)
            continue
        if not (isinstance(s, dict) and isinstance(s.get("footers"), list)
                and all(isinstance(p, str) for p in s["footers"])):
            raise SourceError(f"the message from rank 0: malformed source {i}")
        index = decode_index(take(f"the index of source {i}"), f"from rank 0 (source {i})")
        sources.append({"index": index, "footers": {p: take(f"a footer of source {i}") for p in s["footers"]}})
    if pos != len(view):
        raise SourceError(f"the message from rank 0 has {len(view) - pos} bytes after its end")
    return {"agree": head.get("agree") or {}, "error": head.get("error"), "sources": sources}
