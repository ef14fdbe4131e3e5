"""Footers of remote data files kept on local disk (``data.cache_dir``/footers), keyed by a digest of the file's
identity *now* (path, size, ETag / mtime / ...): a rewritten file looks up another key, so a stale footer is
never served; a file without a version marker is never served from here. Each entry is written atomically
and checked on read (magic, digest of key and footer); one that fails is ignored (docs/cache-and-warmup.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from ..io.safe_files import FileRefused, atomic_write, read_regular_file

log = logging.getLogger(__name__)

SUBDIR = "footers"
MAGIC = b"RSFOOT1\n"
DIGEST_BYTES = 32
MAX_FOOTER_BYTES = 64 << 20        # a footer larger than this is read from the source, never kept
VERSION_KEYS = ("etag", "mtime", "last-modified", "blob_id", "sha256")


def _key(identity: dict) -> str | None:
    """The entry name of a remote file's identity; None when it carries no version marker (or is local: its
    footer read costs no request)."""
    if "://" not in str(identity.get("path")) or not any(identity.get(k) is not None for k in VERSION_KEYS):
        return None
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def _digest(key: str, footer: bytes) -> bytes:
    return hashlib.blake2b(key.encode() + b"\0" + footer, digest_size=DIGEST_BYTES).digest()


class FooterCache:
    """Footers kept under ``directory``/footers (the block cache's directory), by file identity."""

    def __init__(self, directory: str):
        self.directory = os.path.join(os.path.expanduser(directory), SUBDIR)

    def get(self, identity: dict) -> bytes | None:
        """The footer kept for a remote file of exactly this identity, or None."""
        key = _key(identity)
        size = identity.get("size")
        if key is None or not isinstance(size, int):
            return None
        limit = len(MAGIC) + DIGEST_BYTES + min(size, MAX_FOOTER_BYTES)
        try:
            data = read_regular_file(os.path.join(self.directory, key), limit)
        except FileNotFoundError:
            return None
        except (OSError, FileRefused) as e:
            log.warning("footer cache: entry %s of %r not used (%s); reading the footer from the source",
                        key, identity.get("path"), e)
            return None
        head, footer = data[:len(MAGIC) + DIGEST_BYTES], data[len(MAGIC) + DIGEST_BYTES:]
        if head[:len(MAGIC)] != MAGIC or head[len(MAGIC):] != _digest(key, footer) or not footer:
            log.warning("footer cache: entry %s of %r fails its check; reading the footer from the source",
                        key, identity.get("path"))
            return None
        return footer

    def put(self, identity: dict, footer: bytes) -> None:
        """Keep ``footer`` for a remote file of this identity, unless kept already (nothing when it has no
        version marker; a failed write only costs the next process a read). Only the block cache writes here,
        once it has claimed the directory (``cache/ownership.py``)."""
        key = _key(identity)
        if key is None or not footer or len(footer) > MAX_FOOTER_BYTES:
            return
        path = os.path.join(self.directory, key)
        if os.path.exists(path):
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            atomic_write(path, MAGIC + _digest(key, footer) + footer)
        except OSError as e:
            log.debug("footer cache: could not keep the footer of %r (%s)", identity.get("path"), e)
