"""Checks of the fields of a sidecar being decoded: each failure is a SidecarError naming the file, the field,
the value and what is allowed. Shared by the sidecar envelope (:mod:`resumable_stream.state.sidecar`) and the
partition states that decode their own arrays (:class:`~resumable_stream.state.partition_state.PartitionState`,
:class:`~resumable_stream.state.mixture_state.MixturePartitionState`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SidecarError
from ..io.safe_files import JSONRefused, parse_json


def is_hex(v: Any, length: int) -> bool:
    return isinstance(v, str) and len(v) == length and all(c in "0123456789abcdef" for c in v)


def require(ok: bool, path: str, field: str, value: Any, allowed: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise SidecarError(f"sidecar {path!r}: corrupt field {field}: got {shown}; allowed: {allowed}")


def json_field(meta: dict[str, str], key: str, path: str, default: str | None = None) -> Any:
    text = meta.get(key, default)
    if text is None:
        raise SidecarError(f"sidecar {path!r}: corrupt or incomplete: metadata field {key} missing")
    try:
        return parse_json(text)
    except JSONRefused as e:
        raise SidecarError(f"sidecar {path!r}: corrupt field {key}: {e}") from None


def tensor(tensors: dict[str, np.ndarray], name: str, dtype: str, ndim: int, path: str) -> np.ndarray:
    t = tensors.get(name)
    if t is None:
        raise SidecarError(f"sidecar {path!r}: corrupt or incomplete: tensor {name} missing")
    require(t.dtype == np.dtype(dtype) and t.ndim == ndim, path, f"tensor {name}", f"{t.dtype} {t.shape}",
             f"{dtype} with {ndim} dimension(s)")
    return t
