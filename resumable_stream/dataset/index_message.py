"""The one message rank 0 broadcasts when a job opens its sources: each source's index (packed for parquet), the
footers rank 0 read building it and the order settings every rank must share, or rank 0's error. No pickle: an
8-byte magic, a length-prefixed JSON header, then the framed indexes and footers, every length checked.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError, SidecarError, SourceError, StreamMismatchError
from ..io.safe_files import JSONRefused, parse_json
from ..runtime.collectives import broadcast_bytes
from ..sources.index import decode_index
from ..sources.index import encode_message as encode_index_message
from ..sources.index_table import Frames, IndexTableError, framed

MAGIC = b"RSOPEN01"
_ERRORS = {cls.__name__: cls for cls in (ConfigError, SourceError, StreamMismatchError, SidecarError)}


def encode_message(sources: list[dict | None], agree: dict[str, Any], error: dict | None = None) -> bytes:
    """``sources``: per spec ``{"index": ..., "footers": {path: bytes}}``, or None for one not read through an
    index; ``error``: ``{"type", "message"}`` instead (rank 0 failed)."""
    head = {"agree": agree, "error": error,
            "sources": [None if s is None else {"footers": list(s["footers"])} for s in sources]}
    out = [MAGIC, *framed(json.dumps(head, separators=(",", ":")).encode())]
    for s in sources:
        if s is not None:
            out += framed(encode_index_message(s["index"]))
            for path in s["footers"]:
                out += framed(s["footers"][path])
    return b"".join(out)


def decode_message(data: bytes) -> dict[str, Any]:
    """``{"agree", "error", "sources": [{"index", "footers"} or None]}`` from :func:`encode_message`'s bytes;
    a malformed message is a SourceError."""
    if data[:len(MAGIC)] != MAGIC:
        raise SourceError("the message from rank 0 is not a source message (no magic)")
    frames = Frames(memoryview(data), len(MAGIC))
    try:
        head = parse_json(bytes(frames.take("its header")))
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
            index = decode_index(bytes(frames.take(f"the index of source {i}")), f"from rank 0 (source {i})")
            sources.append({"index": index, "footers": {p: bytes(frames.take(f"a footer of source {i}"))
                                                        for p in s["footers"]}})
    except (JSONRefused, IndexTableError) as e:
        raise SourceError(f"the message from rank 0: {e}") from None
    if frames.pos != len(data):
        raise SourceError(f"the message from rank 0 has {len(data) - frames.pos} bytes after its end")
    return {"agree": head.get("agree") or {}, "error": head.get("error"), "sources": sources}


def received(what: str) -> dict[str, Any]:
    """The message rank 0 broadcast (the other ranks' side of the collective); rank 0's error raised here, as the
    class of ours it was (another: a SourceError), saying what rank 0 could not do."""
    message = decode_message(broadcast_bytes(None))
    if message["error"] is not None:
        error = message["error"] if isinstance(message["error"], dict) else {}
        raise _ERRORS.get(error.get("type"), SourceError)(
            f"rank 0 could not {what}: {error.get('type')}: {error.get('message')}")
    return message


@contextlib.contextmanager
def errors_sent(shared: bool) -> Iterator[None]:
    """Rank 0's side: an error raised in the block is broadcast to the ranks waiting for its message, then raised."""
    try:
        yield
    except Exception as e:
        if shared:
            broadcast_bytes(encode_message([], {}, {"type": type(e).__name__, "message": str(e)}))
        raise
