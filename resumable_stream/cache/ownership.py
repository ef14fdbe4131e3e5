"""Which directory is a block cache of ours: the only kind the cache deletes files in. A directory is marked
with :data:`MARKER` when the cache makes it (or finds it empty); any other non-empty one is a ConfigError."""

from __future__ import annotations

import json
import os

from ..errors import ConfigError
from ..io.safe_files import FileRefused, read_regular_file

MARKER = "resumable-stream-cache.json"
_MARK = {"format": "resumable-stream block cache", "version": 1}


def claim(directory: str) -> None:
    """Make sure ``directory`` is a block cache of ours (creating and marking it when missing or empty).
    ConfigError when it is a file, or a non-empty directory the cache did not make. A directory that cannot
    be created or marked (read-only) is left as it is: the cache then only reads what it holds."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"data.cache_dir: {directory!r} is a file, not a directory; allowed: a directory "
                          "(made if missing) that only the block cache uses")
    if os.path.isdir(directory) and _is_marked(directory):
        return
    try:
        os.makedirs(directory, exist_ok=True)
        names = os.listdir(directory)
    except OSError:
        return
    if names:
        shown = ", ".join(sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(
            f"data.cache_dir: {directory!r} is not empty ({shown}) and is not a resumable-stream block cache (it has "
            f"no {MARKER}); the cache evicts and deletes files in its directory, so it only uses a new or empty "
            "directory, or one it made: point data.cache_dir at one")
    try:
        with open(os.path.join(directory, MARKER), "x", encoding="utf-8") as f:
            json.dump(_MARK, f)
    except FileExistsError:
        pass                     # another rank or worker marked it first
    except OSError:
        pass                     # read-only: nothing will be written (nor deleted) here anyway


def _is_marked(directory: str) -> bool:
    try:
        mark = json.loads(read_regular_file(os.path.join(directory, MARKER), 4096))
    except (OSError, FileRefused, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("format") == _MARK["format"]
