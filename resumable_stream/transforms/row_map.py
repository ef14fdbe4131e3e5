"""``data.map``: a user function applied to every raw row before the built-in transform.

``data.map: "package.module:function"`` names a deterministic function of one row that returns a row, a
list of rows, or None (the row is dropped). It runs wherever the transform runs (the DataLoader workers),
and all the rows it returns are fed to the transform at once, so examples not yet handed out are part of
the transform's saved state: a resume continues inside a row that produced several outputs.

The function's identity goes into the transform fingerprint: its name and a digest of its source
(``inspect.getsource``; of its code object where the source is not available). A changed function is
therefore a ``StreamMismatchError`` on resume, unless ``data.map_version`` is set: then the fingerprint
records that version instead of the digest, so a change the user declares harmless (same version)
resumes, and a changed version is a mismatch. Only the configuration names a module to import; nothing
read from a sidecar or the cache does.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from collections.abc import Callable
from types import CodeType
from typing import Any

from ..errors import ConfigError

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class BadMapResult(ValueError):
    """The function raised or returned something that is not a row, a list of rows or None."""


def load_function(spec: Any, key: str = "data.map") -> Callable:
    """The callable ``spec`` ("package.module:function", the function may be dotted, e.g. Class.method)
    names; ``ConfigError`` naming ``key`` when it cannot be imported or is not callable."""
    if not (isinstance(spec, str) and _SPEC.match(spec)):
        raise ConfigError(f"{key}: got {spec!r}; allowed: 'package.module:function' (a module importable from "
                          "PYTHONPATH, a colon, the function's name)")
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{key}: got {spec!r}; module {e.name or module_name!r} not found (is its directory on "
                          "PYTHONPATH?)") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so, as a config error
        raise ConfigError(f"{key}: got {spec!r}; importing {module_name!r} failed ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: got {spec!r}; {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: got {spec!r}; {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _code_digest(code: CodeType, h: Any) -> None:
    """Bytecode, names and constants (recursively for nested functions); not the file name or line numbers."""
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _code_digest(const, h)
        else:
            h.update(repr(const).encode())


def function_identity(spec: str, fn: Callable, version: str | int | None, key: str = "data.map") -> dict[str, Any]:
    """What the fingerprint records of the map function (module doc)."""
    identity: dict[str, Any] = {"function": spec}
    if version is not None:
        identity["version"] = version
        return identity
    h = hashlib.blake2b(digest_size=16)
    try:
        source = inspect.getsource(fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn))
        h.update(source.encode())
        identity["source_digest"] = h.hexdigest()
        return identity
    except (OSError, TypeError):    # no source file (e.g. defined in a REPL or a zip without sources)
        pass
    code = getattr(fn, "__code__", None)
    if code is None:
        raise ConfigError(f"{key}: {spec!r} has neither source nor a code object to identify it by; set "
                          "data.map_version to name its version")
    _code_digest(code, h)
    identity["code_digest"] = h.hexdigest()
    return identity


class RowMap:
    """The configured map function, applied to one row: ``rows(sample, key)`` -> [(row, key), ...]."""

    def __init__(self, spec: str, version: str | int | None = None, key: str = "data.map"):
        self.spec = spec
        self.fn = load_function(spec, key)
        self.identity = function_identity(spec, self.fn, version, key)

    def rows(self, sample: Any, key: str) -> list[tuple[dict, str]]:
        """The rows the function made of ``sample``; each has the sample's key, with ``#i`` appended when
        there are several. ``BadMapResult`` when the function raises or returns something else."""
        try:
            out = self.fn(sample)
        except Exception as e:  # noqa: BLE001 - the user's code: data.bad_sample decides
            raise BadMapResult(f"data.map function {self.spec!r} raised {type(e).__name__}: {e}") from e
        if out is None:
            return []
        if isinstance(out, dict):
            return [(out, key)]
        if isinstance(out, (list, tuple)) and all(isinstance(r, dict) for r in out):
            return [(out[0], key)] if len(out) == 1 else [(r, f"{key}#{i}") for i, r in enumerate(out)]
        raise BadMapResult(f"data.map function {self.spec!r} returned {type(out).__name__}; expected a row (a dict), "
                           "a list of rows or None")
