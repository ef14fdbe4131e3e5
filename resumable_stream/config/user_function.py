"""``data.map``: the user function a config names (``package.module:function``), loaded and identified for the
transform fingerprint (see :mod:`resumable_stream.transforms.row_map`, which applies it)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from collections.abc import Callable
from types import CodeType
from typing import Any

from ..errors import ConfigError, shown

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def function_name(fn: Callable) -> str:
    """How a function given from Python is named in the fingerprint and errors: ``module:qualname``."""
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def load_function(spec: Any, key: str = "data.map") -> Callable:
    """The callable ``spec`` ("package.module:function", the function may be dotted, e.g. Class.method)
    names, or ``spec`` itself when it is one (given from Python); ``ConfigError`` naming ``key`` when it cannot
    be imported or is not callable."""
    if callable(spec):
        return spec
    if not (isinstance(spec, str) and _SPEC.match(spec)):
        raise ConfigError(f"{key}: got {shown(spec)}; allowed: 'package.module:function' (a module importable from "
                          "PYTHONPATH, a colon, the function's name)")
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{key}: got {shown(spec)}; module {shown(e.name or module_name)} not found (is its directory on "
                          "PYTHONPATH?)") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so, as a config error
        raise ConfigError(f"{key}: got {shown(spec)}; importing {shown(module_name)} failed ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: got {shown(spec)}; {shown(module_name)} has no attribute {shown(attr)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: got {shown(spec)}; {shown(attr)} is a {type(obj).__name__}, not callable")
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


def function_identity(spec: str | Callable, fn: Callable, version: str | int | None,
                      key: str = "data.map") -> dict[str, Any]:
    """What the fingerprint records of the map function (module doc): its name (a function given from Python:
    ``module:qualname``) and its version, else a digest of its source (or code)."""
    if callable(spec):
        spec = function_name(spec)
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
        raise ConfigError(f"{key}: {shown(spec)} has neither source nor a code object to identify it by; set "
                          "data.map_version to name its version")
    _code_digest(code, h)
    identity["code_digest"] = h.hexdigest()
    return identity
