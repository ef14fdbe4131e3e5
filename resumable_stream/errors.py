"""The exceptions a user can meet. Each message names what is wrong and what is allowed."""

import difflib
import itertools
import re
import reprlib

# The column a source marks a row it could not read whole with: why (naming the file, the sample and the
# part of it), None for a good row. The row stays (a shard's row count never changes); the transforms apply
# data.bad_sample to a marked row before anything else (sources/webdataset.py: a bad tar member).
BAD_SAMPLE_COLUMN = "__bad_sample__"
# The Arrow field metadata of a ``__bad_sample__`` column whose null values are left out of the rows (a good row
# of JSON lines is exactly the row ``datasets`` gives; sources/jsonl.py). Webdataset's column has none: its rows
# keep the key, None.
BAD_SAMPLE_OMIT_NULL = {b"resumable_stream": b"omit-null"}


# How much of a value an error message shows: a short value as repr() writes it, a long one cut short.
SHOWN_CHARS = 200


class _ShortRepr(reprlib.Repr):
    """reprlib's repr (a few items per level, a few levels) that never turns a huge integer into its digits."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 120, 120, 40
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = self.maxdeque = 6

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:    # repr() of a 5000-digit int is a ValueError; of 4000 digits, unreadable
            digits = len(str(abs(x))) if x.bit_length() < 13_000 else f"about {int(x.bit_length() * 0.30103)}"
            return f"<{'a negative' if x < 0 else 'an'} integer of {digits} digits>"
        return super().repr_int(x, level)


def _fits(value: object, budget: int) -> bool:
    """Whether repr(value) is at most about ``budget`` characters, found by visiting at most ``budget``
    items: a value shared many times over (yaml aliases) or containing itself is never walked whole."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            budget -= len(v) + 3
        elif v is None or isinstance(v, (bool, float)):
            budget -= 24
        elif isinstance(v, int):
            budget -= v.bit_length() // 3 + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            budget -= 2
            stack.extend(itertools.islice(v, max(0, budget // 2 + 1)))
        elif isinstance(v, dict):
            budget -= 2
            for k, x in itertools.islice(v.items(), max(0, budget // 4 + 1)):
                stack += (k, x)
        else:
            return False
        if budget < 0:
            return False
    return True


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message: as it is when short, else cut short (a few items of each level,
    at most ``limit`` characters) without expanding the rest of it, so that a value built to be huge (a yaml
    "billion laughs", a 10 MB string, a self-containing list) costs the message nothing."""
    if _fits(value, limit):
        return repr(value)
    text = _ShortRepr().repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6) if len(key) <= 200 else []
        self.section, self.key, self.suggestion = section, key, (close[0] if close else None)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        shown_key = key if len(key) <= 200 else shown(key)     # a key of megabytes is cut too
        super().__init__(f"{section}.{shown_key}: unknown key{hint}{tail}")


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


class WrongThreadError(ResumableStreamError, RuntimeError):
    """A call that moves a stream's reader state (``set_weights``) from a thread other than the one iterating the
    stream or loader: only the consuming thread owns the cursors (docs/architecture.md, "One owner per cursor")."""


class OutputDirLockedError(ResumableStreamError):
    """Another training job (or another thread of this process) holds the output directory's lock."""


class StreamMismatchError(ResumableStreamError):
    """The saved stream state does not belong to the stream it is loaded into.

    ``differences`` lists ``(what, saved, now)`` triples so callers can act on them.
    """

    def __init__(self, message: str, differences: list[tuple[str, object, object]] | None = None):
        super().__init__(message)
        self.differences = differences or []
