"""The exceptions a user can meet. Each message names what is wrong and what is allowed."""

import difflib
import re

# The column a source marks a row it could not read whole with: why (naming the file, the sample and the
# part of it), None for a good row. The row stays (a shard's row count never changes); the transforms apply
# data.bad_sample to a marked row before anything else (sources/webdataset.py: a bad tar member).
BAD_SAMPLE_COLUMN = "__bad_sample__"
# The Arrow field metadata of a ``__bad_sample__`` column whose null values are left out of the rows (a good row
# of JSON lines is exactly the row ``datasets`` gives; sources/jsonl.py). Webdataset's column has none: its rows
# keep the key, None.
BAD_SAMPLE_OMIT_NULL = {b"resumable_stream": b"omit-null"}


class ResumableStreamError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(ResumableStreamError, ValueError):
    """A configuration key has a wrong type or value, or is unknown."""

    def in_source(self, at: str, keys) -> "ConfigError":
        """This error about keys a mixture's source entry set (``keys``), renamed ``data.key`` ->
        ``{at}.key`` (e.g. ``data.sources[1].split``); other keys keep their name."""
        def rename(m: re.Match) -> str:
            return f"{at}.{m.group(1)}" if m.group(1) in keys else m.group(0)

        return ConfigError(re.sub(r"\bdata\.(\w+)", rename, str(self)))


class UnknownKeyError(ConfigError):
    """A key no section takes: ``section`` (e.g. ``train``, ``data.sources[1]``; ``config`` for the top level)
    and ``key`` as the yaml wrote them, and the closest known key (``suggestion``, or None), so that a
    command-line override can be named as the user typed it. ``tail``: text after the hint."""

    def __init__(self, section: str, key: str, known, tail: str = ""):
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
        self.section, self.key, self.suggestion = section, key, (close[0] if close else None)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        super().__init__(f"{section}.{key}: unknown key{hint}{tail}")


class SourceError(ResumableStreamError):
    """The dataset could not be opened or read (missing files, unreadable data)."""


class IncompleteFileError(SourceError):
    """A data file that is not complete (yet): a tar without its end-of-archive blocks or cut inside a member
    or header, a parquet file without its footer. A growing dataset (``data.growth``) leaves such a file out
    and lists it again at its next refresh or resume; elsewhere it is the SourceError it is."""


class SidecarError(ResumableStreamError):
    """A stream-state sidecar is missing, corrupt, truncated or incomplete."""


class RunLogError(ResumableStreamError):
    """A run directory or its ``train_log.jsonl`` is missing, not a regular file or outside the run
    (``resumable-stream report``)."""


class OutputDirLockedError(ResumableStreamError):
    """Another training job (or another thread of this process) holds the output directory's lock."""


class StreamMismatchError(ResumableStreamError):
    """The saved stream state does not belong to the stream it is loaded into.

    ``differences`` lists ``(what, saved, now)`` triples so callers can act on them.
    """

    def __init__(self, message: str, differences: list[tuple[str, object, object]] | None = None):
        super().__init__(message)
        self.differences = differences or []
