"""The names of the files of a ``stream_state`` directory, with their generations."""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
INDEX = "index.json"               # the dataset index, by rank 0 (``index.bin`` when packed: index_table.pack_index)
FINGERPRINT = "fingerprint.json"   # the dataset fingerprint of every rank file, written once by rank 0
STATE_DIR = "stream_state"

# generations up to MAX_GENERATION (9 digits), ranks below MAX_WORLD_SIZE (5 digits)
RANK_FILE = re.compile(r"^rank-(\d{5})(?:\.g[1-9]\d{0,8})?\.safetensors$")
INDEX_FILE = re.compile(r"^index(?:\.g[1-9]\d{0,8})?\.(?:json|bin)$")
FINGERPRINT_FILE = re.compile(r"^fingerprint(?:\.g[1-9]\d{0,8})?\.json$")

# what a manifest may list beside the rank files: one file of each, confined to the state directory
SHARED_FILES = {"index": (INDEX, INDEX_FILE), "fingerprint": (FINGERPRINT, FINGERPRINT_FILE)}

# a mixture's: one dataset index per source, ``index-<label>.json`` (generation N: ``index.gN-<label>.json``, the
# generation before the label so that a label with dots never reads as one), listed under the manifest's
# ``indexes`` by label. Labels are config.py's (letters, digits, _ . -): never a path.
SOURCE_INDEX_FILE = re.compile(r"^index(?:\.g([1-9]\d{0,8}))?-([A-Za-z0-9_.-]{1,64})\.(?:json|bin)$")


def rank_file_name(rank: int, generation: int = 0) -> str:
    """``rank``'s sidecar in a stream_state directory; generations after the first save into the same
    directory get their own names (see :func:`write_manifest`)."""
    return f"rank-{rank:05d}.safetensors" if generation == 0 else f"rank-{rank:05d}.g{generation}.safetensors"


def rank_of_file_name(name: str) -> int | None:
    """The rank a sidecar's file name says (``rank-00001.safetensors``, ``rank-00001.g3.safetensors``: 1);
    None for any other name."""
    m = RANK_FILE.match(name)
    return int(m.group(1)) if m else None


def shared_file_name(what: str, generation: int = 0, extension: str = "json") -> str:
    """``index`` or ``fingerprint``: the file of a generation of the state that describes the dataset once for
    every rank (rank 0 writes it before the manifest); ``extension``: ``bin`` for a packed index."""
    base = SHARED_FILES[what][0][:-5]
    return f"{base}.{extension}" if generation == 0 else f"{base}.g{generation}.{extension}"


def source_index_file_name(label: str, generation: int = 0, extension: str = "json") -> str:
    """The dataset index of mixture source ``label`` saved with a generation of the state (rank 0)."""
    return f"index-{label}.{extension}" if generation == 0 else f"index.g{generation}-{label}.{extension}"
