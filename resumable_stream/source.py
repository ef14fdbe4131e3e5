"""Where rows come from: a dataset opened through HF ``datasets``, cut into shards we can name.

A ``Source`` knows its shard list (with identities and, where cheap, row counts), a
fingerprint of everything that determines its content, and can open shard *s* at row *r*
and yield Arrow tables from there. Everything above it (plan, stream, cache) only uses
``shards``, ``fingerprint`` and ``read``.
"""

from __future__ import annotations

import contextlib
import copy
import email.utils
import hashlib
import inspect
import json
import logging
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from .config import StreamConfig
from .errors import ConfigError, ResumableStreamError, SourceError, StreamMismatchError
from .hub import (
    commit_sha,
    file_identities,
    hub_answer,
    hub_commits,
    hub_repo_of,
    pin_commits,
    probe_answer,
)
from .index import (
    FOOTER_TAIL_BYTES,
    features_of,
    file_entry,
    identity_of,
    make_index,
    map_files,
    split_footer,
)
from .local_parquet import resolve_local_parquet
from .metrics import record_retry, record_row_group, retry_cause
from .parquet_files import ParquetFiles, read_checked
from .prefetch import Prefetcher
from .ranged import listed_identities, read_range

log = logging.getLogger(__name__)

# Rows per shard when a dataset is loaded normally (streaming: false or backend: local).
MAP_STYLE_SHARD_ROWS = 8192
# Footers read to build an index are kept (and broadcast to the other ranks) up to this many bytes in all;
# beyond, each process reads the footers of the files it reads, as they come.
KEPT_FOOTERS_MAX_BYTES = 64 << 20
# Rows per Arrow table handed to the stream while reading a shard.
READ_BATCH_ROWS = 8192

# Formats a module of sources/ indexes and reads itself (builder name -> that module: build_index, open_indexed),
# filled when the module is imported (the package's __init__ imports them), so this module never imports them.
INDEXED_FORMATS: dict[str, Any] = {}

_EXTENSION_BUILDERS = {
    ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
    ".csv": "csv", ".tsv": "csv", ".txt": "text", ".arrow": "arrow",
}


@dataclass(frozen=True)
class ShardInfo:
    index: int
    file: str            # path or URL of the file the shard lives in ("" when unknown)
    part: int | None     # parquet row group or map-style slice; None for a whole file
    num_rows: int | None

    @property
    def name(self) -> str:
        base = os.path.basename(self.file.rstrip("/")) or f"shard{self.index}"
        return base if self.part is None else f"{base}#{self.part}"


def builder_for_path(path: str) -> str | None:
    """The packaged builder for a single file path / URL, by extension (None if not a known file type)."""
    low = path.lower().split("?", 1)[0]
    for ext in sorted(_EXTENSION_BUILDERS, key=len, reverse=True):
        if low.endswith(ext):
            return _EXTENSION_BUILDERS[ext]
    return None


def builder_args(cfg: StreamConfig) -> tuple[str, object]:
    """Map ``dataset_name_or_path`` (+ ``data_files``) to load_dataset's (path, data_files)."""
    path, data_files = cfg.dataset_name_or_path, cfg.data_files
    if path.startswith("hf://") and builder_for_path(path) is None:
        # LLaMA-Factory style "hf://org/name" or fsspec "hf://datasets/org/name": a hub id.
        path = path[len("hf://"):]
        path = path[len("datasets/"):] if path.startswith("datasets/") else path
    elif data_files is None and (os.path.isfile(path) or "://" in path):
        builder = builder_for_path(path)
        if builder is None:
            raise ConfigError(
                f"data.dataset_name_or_path: {path!r} is a file whose type is not known; "
                f"allowed extensions: {', '.join(sorted(_EXTENSION_BUILDERS))}"
            )
        path, data_files = builder, path
    return path, data_files


def file_identity(path: str, retry: RetryPolicy | None = None) -> dict:
    """Size plus whatever version marker the filesystem gives (mtime, ETag, Last-Modified, blob id)."""
    if path.startswith("/"):
        # a local absolute path: fsspec's LocalFileSystem.info is a stat (of the target of a link) and gives
        # these two; importing fsspec would cost more than all of a local dataset's stats
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise SourceError(f"data file {path!r}: not found") from None
        except OSError as e:
            raise SourceError(f"data file {path!r}: cannot read its metadata ({type(e).__name__}: {e})") from None
        return {"path": path, "size": st.st_size, "mtime": round(st.st_mtime, 6)}
    import fsspec

    def fetch() -> dict:
        fs, fs_path = fsspec.core.url_to_fs(path, **_protocol_options(retry.storage_options if retry else {}, path))
        if path.split("://", 1)[0] in _BUCKET_PROTOCOLS:
            # the store's answer now (one HEAD), not a listing an earlier open in this process cached
            fs.invalidate_cache(fs_path)
        return fs.info(fs_path)

    try:
        if retry is not None and retry.applies(path):
            info = retry.call(fetch, f"data file {path!r}: reading its metadata", [path])
        else:
            info = fetch()
    except SourceError:
        raise
    except FileNotFoundError:
        raise SourceError(f"data file {path!r}: not found") from None
    except Exception as e:  # network and permission errors
        answer = remote_answer(e) or f"{type(e).__name__}: {e}"
        raise SourceError(f"data file {path!r}: cannot read its metadata ({answer})") from None
    ident = {"path": path, "size": info.get("size")}
    for key in ("mtime", "ETag", "Last-Modified", "blob_id"):
        if info.get(key) is not None:
            ident[key.lower()] = info[key] if not isinstance(info[key], float) else round(info[key], 6)
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        ident["sha256"] = lfs["sha256"]
    return ident


def parquet_footer(path: str, size: int, retry: RetryPolicy | None = None, identity: dict | None = None) -> bytes:
    """The footer of a parquet file of ``size`` bytes (and ``identity``, checked on every answer): one ranged
    read of its tail (two when the footer is bigger than FOOTER_TAIL_BYTES)."""
    options = retry.storage_options if retry else {}

    def fetch() -> bytes:
        tail = read_range(path, max(0, size - FOOTER_TAIL_BYTES), size, options, identity)
        length = split_footer(tail, size, path)
        if length > len(tail):
            tail = read_range(path, size - length, size - len(tail), options, identity) + tail
        return tail[len(tail) - length:]

    def checked() -> bytes:
        return read_checked(f"data file {path!r} (its footer)", fetch)

    try:
        if retry is not None and retry.applies(path):
            return retry.call(checked, f"data file {path!r}: reading its parquet footer", [path])
        return checked()
    except (SourceError, StreamMismatchError):
        raise
    except Exception as e:
        raise SourceError(f"data file {path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _index_file(path: str, retry: RetryPolicy | None, ident: dict | None = None) -> tuple[dict, bytes]:
    """One file's index entry (its identity: ``ident`` or one metadata request; its layout: one footer read)
    and footer."""
    ident = ident or file_identity(path, retry)
    if not isinstance(ident.get("size"), int):
        raise SourceError(f"data file {path!r}: its size is unknown; a parquet file needs one to be indexed")
    footer = parquet_footer(path, ident["size"], retry, ident)
    return file_entry(ident, footer), footer


def build_parquet_index(cfg: StreamConfig, files: list[str], features, retry: RetryPolicy | None,
                        progress: Callable[[], None] | None = None, footers: dict | None = None) -> dict:
    """The dataset index of resolved parquet ``files``; ``features``: the builder's (None: inferred from the
    first file's schema, as ``datasets`` does). ``footers``: filled with each file's footer bytes."""
    known = hub_identities(files, retry)
    known.update(listed_identities(files, retry.storage_options if retry else {}))   # S3: a listing, no HEADs
    done = map_files(lambda f: _index_file(f, retry, known.get(f)), files, progress)
    if footers is not None and sum(len(footer) for _, footer in done) <= KEPT_FOOTERS_MAX_BYTES:
        footers.update((f, footer) for f, (_, footer) in zip(files, done))
    if features is None:
        features = features_of(done[0][1], files[0])
    return make_index(cfg, "parquet", features, [entry for entry, _ in done])


def hub_identities(files: list[str], retry: RetryPolicy | None) -> dict[str, dict]:
    """The identities of the Hub files among ``files``, asked in batches (a few requests, not one per file)."""
    hub_files = [f for f in files if f.startswith("hf://datasets/")]
    if not hub_files:
        return {}
    label = f"data files {hub_files[0]!r} and {len(hub_files) - 1} more: reading their metadata"
    if retry is not None and retry.applies(hub_files[0]):
        return retry.call(lambda: file_identities(hub_files), label, hub_files)
    return file_identities(hub_files)


def _digest(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


# ------------------------------------------------------------------------------ network faults
#
# Remote data (http(s)://, hf://, s3://, ... files and Hub ids) is opened and read under one retry
# policy, ``data.retries`` / ``data.retry_backoff_s`` with exponential backoff: every step of resolving
# the dataset is retried on its own (a file's metadata, a parquet footer, load_dataset_builder, ...),
# and a shard read that fails midway is reopened at the next row not yet yielded, so the rows come out
# exactly as without the fault. Local files are never retried: a missing local file fails at once.
#
# Waiting is bounded. ``data.timeout_s`` is the deadline of one request: aiohttp (fsspec's HTTP filesystem)
# gets it as ClientTimeout(total=...) in the ``client_kwargs`` of the storage options handed to
# ``load_dataset_builder`` and to our ranged reads, covering connect, headers, body and the request retries
# of :class:`_HttpRetry`; s3fs gets it as botocore's connect / read timeouts, with one attempt per call
# (our tries are the retries; s3fs's own retries of a timed-out call are off in our reads, not in the
# listing datasets does while resolving). ``data.retry_budget_s`` bounds one step (a read, a file's metadata, ...):
# no try starts once its first try is that long ago, and no wait runs past it. A step of one request
# (a row group, a footer) therefore fails within retry_budget_s + timeout_s, one of at most two (a file's
# metadata: HEAD, then GET when the HEAD says too little) within retry_budget_s + 2 x timeout_s: 300 s
# with the defaults. While our retries govern, datasets' own read/open retries (up to 20 tries, 5-60 s
# sleeps each, see datasets.config.STREAMING_*) are off.

T = TypeVar("T")

# datasets.config knobs set while our retry layer is in charge (restored when no call needs them).
_DATASETS_RETRY_KNOBS = {
    "STREAMING_READ_MAX_RETRIES": 1,
    "STREAMING_READ_RETRY_INTERVAL": 0,
    "STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL": 0,
    "STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL": 0,
    "STREAMING_OPEN_MAX_RETRIES": 1,
    "STREAMING_OPEN_RETRY_INTERVAL": 0,
}
_knobs_lock = threading.Lock()
_knobs_depth = 0
_knobs_saved: dict[str, Any] = {}

# HTTP statuses worth another try; any other 4xx is an answer, not a fault.
_RETRY_STATUSES = frozenset({408, 425, 429})
_MISSING_STATUSES = frozenset({404, 410})
# Retries of one HTTP request (at most data.retries), inside each try of a step (resolving a file,
# reading a shard), which has data.retries of its own.
HTTP_REQUEST_RETRIES = 2
# The longest wait between two tries (unless retry_backoff_s itself is longer).
_MAX_BACKOFF_S = 60.0
# A server's Retry-After (429 / 503) is waited, up to this long (then retried, and it answers again).
_MAX_RETRY_AFTER_S = 300.0
# Each wait is stretched by up to this share, at random, so that ranks and workers hit by the same fault
# (a rate limit, a restarting server) do not all retry in the same instant. Only waits are random: which
# rows come out never depends on them.
_JITTER = 0.25
_jitter_rng = random.Random()
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
# Object stores whose URLs start with a bucket (listing one costs a request, not a crawl).
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


@contextlib.contextmanager
def _datasets_retries_off() -> Iterator[None]:
    """datasets' internal retries off for the duration (re-entrant, thread-safe, restored after)."""
    global _knobs_depth
    import datasets.config as dc

    with _knobs_lock:
        if _knobs_depth == 0:
            _knobs_saved.clear()
            for key, value in _DATASETS_RETRY_KNOBS.items():
                if hasattr(dc, key):
                    _knobs_saved[key] = getattr(dc, key)
                    setattr(dc, key, value)
        _knobs_depth += 1
    try:
        yield
    finally:
        with _knobs_lock:
            _knobs_depth -= 1
            if _knobs_depth == 0:
                for key, value in _knobs_saved.items():
                    setattr(dc, key, value)


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _flat_files(data_files: object) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, (list, tuple)):
        return [f for f in data_files if isinstance(f, str)]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _flat_files(v)]
    return []


def remote_targets(path: str, data_files: object) -> list[str]:
    """The remote paths opening this dataset touches; [] when everything is local."""
    targets = [p for p in [path, *_flat_files(data_files)] if is_remote(p)]
    if targets or path == "parquet":     # datasets' packaged parquet builder, never a hub id
        return targets
    import datasets.config
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    hub_id = (_HUB_ID.match(path) is not None and path not in _PACKAGED_DATASETS_MODULES
              and not os.path.exists(path) and not datasets.config.HF_HUB_OFFLINE)
    return [path] if hub_id else []


class _HttpRetry:
    """aiohttp client middleware: each idempotent HTTP request is retried up to ``retries`` times.

    Covers what no code of ours wraps (requests made deep inside datasets while it resolves files,
    infers a schema or reshards) so that a step made of many requests does not fail whenever one of them
    does. Retried: connection errors and resets, timeouts, 5xx / 408 / 425 / 429; for ranged GETs (the
    only body reads fsspec buffers whole anyway) the body is read here, so a cut-off or stalled body is
    retried too. Anything else comes back as aiohttp gave it. Picklable, with a stable repr (fsspec keys
    its filesystem cache on it)."""

    def __init__(self, retries: int, backoff_s: float):
        self.retries, self.backoff_s = retries, backoff_s

    def __repr__(self) -> str:
        return f"_HttpRetry(retries={self.retries}, backoff_s={self.backoff_s})"

    async def __call__(self, req, handler):
        import asyncio

        import aiohttp

        if req.method not in ("GET", "HEAD") or self.retries <= 0:
            return await handler(req)
        ranged = req.method == "GET" and "Range" in req.headers
        attempt = 0
        while True:
            try:
                resp = await handler(req)
                if not (resp.status >= 500 or resp.status in _RETRY_STATUSES):
                    if ranged and resp.status == 206:
                        try:
                            await resp.read()        # cached on the response: fsspec's read() returns it
                        except BaseException:
                            resp.close()
                            raise
                    return resp
                if attempt >= self.retries:
                    return resp                      # the caller raises for the status, naming it
                retry_after = retry_after_s(resp.headers)
                resp.release()
                error = f"HTTP {resp.status}"
                cause = "http_429" if resp.status == 429 else "http_5xx" if resp.status >= 500 else "http_other"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # A refused connection / unknown host: the host is down, a step's backoff suits it better.
                if attempt >= self.retries or _is_invalid_url(e) or isinstance(e, aiohttp.ClientConnectorError):
                    raise
                error = f"{type(e).__name__}: {e}"
                retry_after = None
                cause = retry_cause(e)
            wait = backoff_wait(self.backoff_s, attempt, retry_after)
            attempt += 1
            log.warning("%s %s: %s; request retry %d of %d in %.2f s",
                        req.method, req.url, error, attempt, self.retries, wait)
            record_retry(cause)
            await asyncio.sleep(wait)


def retry_after_s(headers) -> float | None:
    """Seconds a ``Retry-After`` header (delay-seconds or an HTTP date) asks to wait; None: none / unreadable."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    value = str(value).strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff_wait(backoff_s: float, attempt: int, retry_after: float | None = None) -> float:
    """The wait before try ``attempt + 2``: exponential backoff, at least the server's Retry-After (capped at
    _MAX_RETRY_AFTER_S), stretched by a random jitter of up to _JITTER."""
    wait = min(backoff_s * 2.0 ** min(attempt, 60), max(_MAX_BACKOFF_S, backoff_s))
    if retry_after is not None:
        wait = max(wait, min(retry_after, _MAX_RETRY_AFTER_S))
    return wait * (1.0 + _JITTER * _jitter_rng.random())


def _storage_options(timeout_s: float, retries: int, backoff_s: float) -> dict:
    """fsspec HTTP options handed to datasets: aiohttp times out a connect or read stalled for
    ``timeout_s``, and retries single requests (see :class:`_HttpRetry`)."""
    try:
        import aiohttp
    except ImportError:  # no fsspec HTTP filesystem without aiohttp anyway
        return {}
    client_kwargs: dict[str, Any] = {
        "timeout": aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s, sock_read=timeout_s)}
    if retries > 0 and "middlewares" in inspect.signature(aiohttp.ClientSession.__init__).parameters:
        client_kwargs["middlewares"] = (_HttpRetry(retries, backoff_s),)   # aiohttp >= 3.12
    options: dict[str, Any] = {protocol: {"client_kwargs": dict(client_kwargs)} for protocol in ("http", "https")}
    # s3fs: botocore's timeouts, one attempt per call (ours are the retries; our reads' filesystems also turn
    # s3fs's own retries of a timeout off, see ranged.filesystem)
    s3 = {"config_kwargs": {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                            "retries": {"total_max_attempts": 1, "mode": "standard"}}}
    options.update({protocol: dict(s3) for protocol in ("s3", "s3a")})
    return options


def _data_protocols(cfg: StreamConfig) -> list[str]:
    """The protocols of the config's remote paths (s3, gs, hf, http, ...), in order of appearance."""
    paths = [cfg.dataset_name_or_path, *_flat_files(cfg.data_files)]
    return list(dict.fromkeys(p.split("://", 1)[0] for p in paths if is_remote(p)))


def with_user_options(ours: dict, user: dict, protocols: list[str]) -> dict:
    """``ours`` ({protocol: kwargs}) plus ``data.storage_options``: keyed by protocol (as datasets accepts
    them) or flat, then for every protocol of the data. The user's ``client_kwargs`` (aiohttp) and
    ``config_kwargs`` (botocore) go over ours key by key."""
    import fsspec

    keyed = all(k in fsspec.available_protocols() and isinstance(v, dict) for k, v in user.items())
    per_protocol = user if keyed else {p: user for p in protocols}
    out = {k: dict(v) for k, v in ours.items()}
    for protocol, options in per_protocol.items():
        merged = {**out.get(protocol, {}), **options}
        for nested in ("client_kwargs", "config_kwargs"):
            if isinstance(options.get(nested), dict) and nested in out.get(protocol, {}):
                merged[nested] = {**out[protocol][nested], **options[nested]}
        out[protocol] = merged
    return out


def _protocol_options(storage_options: dict, path: str) -> dict:
    """The flat fsspec kwargs for ``path``'s protocol out of datasets-style ``{protocol: kwargs}``."""
    protocol = path.split("://", 1)[0] if "://" in path else "file"
    return copy.deepcopy(storage_options.get(protocol, {}))   # botocore edits its config_kwargs in place


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 16 and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ if cur.__cause__ is not None else (
            None if cur.__suppress_context__ else cur.__context__)
    return out


def _status_of(e: BaseException) -> int | None:
    """The HTTP status an exception reports (aiohttp, requests / httpx based Hub errors), if any."""
    status = getattr(e, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    response = getattr(e, "response", None)
    if isinstance(response, dict):     # botocore's ClientError (s3fs): the status is in the parsed answer
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    code = getattr(getattr(e, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def _network_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OSError, TimeoutError]   # ConnectionError, requests' errors, ...
    # huggingface_hub 2.x sends its requests with httpx2, 1.x (beside LLaMA-Factory 0.9.5) with httpx
    for module, name in (("aiohttp", "ClientError"), ("httpx", "TransportError"), ("httpx2", "TransportError")):
        try:
            types.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _is_invalid_url(e: BaseException) -> bool:
    return any(t.__name__ in ("InvalidURL", "NonHttpUrlClientError") and t.__module__.startswith("aiohttp")
               for t in type(e).__mro__)


def _classify(e: BaseException) -> str:
    """'transient' (worth another try), 'missing' (a FileNotFoundError: maybe a fault, maybe not) or
    'permanent'."""
    chain = _chain(e)
    if any(isinstance(x, (ConfigError, SourceError)) for x in chain):
        return "permanent"
    for x in chain:
        status = _status_of(x)
        if status is not None:
            if status >= 500 or status in _RETRY_STATUSES:
                return "transient"
            return "missing" if status in _MISSING_STATUSES else "permanent"
    if any(isinstance(x, FileNotFoundError) or _is_invalid_url(x) for x in chain):
        # A fault can look like this too: fsspec's HTTP info() turns any failure into FileNotFoundError,
        # and datasets' file listing then tries the URL as a directory with its scheme cut off.
        return "missing"
    if any(isinstance(x, PermissionError) for x in chain):
        return "permanent"      # an object store's 403 (s3fs): an answer, not a fault
    if any(isinstance(x, _network_error_types()) for x in chain):
        return "transient"
    return "permanent"


def remote_answer(e: BaseException) -> str | None:
    """What an object store answered, from botocore's ClientError in ``e``'s chain: "HTTP 403 AccessDenied:
    Access Denied (ListObjectsV2)"; None when ``e`` carries no such answer."""
    for x in _chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            err = response["Error"]
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            operation = getattr(x, "operation_name", None)
            return (f"HTTP {status} {err.get('Code', '?')}: {err.get('Message', '')}"
                    + (f" ({operation})" if operation else ""))
    return None


def _error_text(e: BaseException) -> str:
    """``Type: message``, plus the root cause when a library wrapped it (datasets' "Server Disconnected")."""
    text = f"{type(e).__name__}: {e}"
    root = _chain(e)[-1]
    if root is not e and str(root) not in text:
        text += f" (caused by {type(root).__name__}: {root})"
    return text


def _probe_missing(urls: list[str], timeout_s: float) -> tuple[str, int] | None:
    """The first http(s) URL the server says is not there (404 / 410), or None (all there, or unknown)."""
    probe = [u for u in dict.fromkeys(urls) if u.split("://", 1)[0] in ("http", "https")
             and not _GLOB_CHARS.search(u)]

    def one(url: str) -> tuple[str, int] | None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
                return None
        except urllib.error.HTTPError as err:
            return (url, err.code) if err.code in _MISSING_STATUSES else None
        except Exception:  # unreachable, reset, timeout: nothing definite
            return None

    return next((hit for hit in map_files(one, probe) if hit is not None), None)


class RetryPolicy:
    """The retry policy of one source: which paths are remote, backoff, timeouts (picklable)."""

    def __init__(self, cfg: StreamConfig, remote: bool):
        self.retries = cfg.retries
        self.backoff_s = float(cfg.retry_backoff_s)
        self.timeout_s = float(cfg.timeout_s)
        self.budget_s = float(cfg.retry_budget_s)
        self.remote = remote
        self.storage_options = (_storage_options(self.timeout_s, min(self.retries, HTTP_REQUEST_RETRIES),
                                                 self.backoff_s) if remote else {})
        if remote and cfg.storage_options:
            self.storage_options = with_user_options(self.storage_options, cfg.storage_options,
                                                     _data_protocols(cfg))

    def applies(self, path: str) -> bool:
        """Whether reading ``path`` (a shard's file; "" when unknown) goes over the network."""
        return self.remote and (path == "" or is_remote(path))

    def delay(self, attempt: int, e: BaseException | None = None) -> float:
        """Seconds to wait before try ``attempt + 2`` (attempt 0 failed: backoff, then 2x, 4x, ...; at least
        the Retry-After of the answer that ``e`` carries), with jitter."""
        retry_after = None
        for x in _chain(e) if e is not None else []:
            response = getattr(x, "response", None)
            retry_after = retry_after_s(getattr(x, "headers", None) or getattr(response, "headers", None))
            if retry_after is not None:
                break
        return backoff_wait(self.backoff_s, attempt, retry_after)

    def failed(self, e: BaseException, attempt: int, label: str, probe: list[str], started: float) -> bool:
        """After ``e`` ended try ``attempt + 1`` of a step whose first try began at ``started`` (monotonic):
        sleep and return True when another try is due; False when ``e`` is no network fault (the caller
        reports it). Raises SourceError when a probe shows the file is gone, or when the retries or the
        step's time (data.retry_budget_s) are spent."""
        kind = _classify(e)
        if kind == "permanent":
            return False
        if kind == "missing":
            hit = _probe_missing(probe, self.timeout_s)
            if hit is not None:
                raise SourceError(f"{label} failed: data file {hit[0]!r} is not found (HTTP {hit[1]})") from e
            if not any(u.split("://", 1)[0] in ("http", "https") for u in probe):
                return False      # hf://, s3://, ...: their filesystems only say 'not found' when it is so
        if attempt >= self.retries:
            raise SourceError(f"{label} failed after {attempt + 1} attempt(s) (data.retries: {self.retries}); "
                              f"last error: {_error_text(e)}") from e
        wait = self.delay(attempt, e)
        elapsed = time.monotonic() - started
        if elapsed + wait >= self.budget_s:
            raise SourceError(f"{label} failed: gave up after {attempt + 1} attempt(s) in {elapsed:.0f} s "
                              f"(data.retry_budget_s: {self.budget_s:g}, data.timeout_s: {self.timeout_s:g} per "
                              f"request); last error: {_error_text(e)}") from e
        log.warning("%s failed (%s); retry %d of %d in %.2f s", label, _error_text(e), attempt + 1, self.retries, wait)
        record_retry(retry_cause(e))
        time.sleep(wait)
        return True

    def call(self, fn: Callable[[], T], label: str, probe: list[str]) -> T:
        """``fn()`` with retries when remote; its own exceptions pass through when they are no fault."""
        if not self.remote:
            return fn()
        attempt, started = 0, time.monotonic()
        while True:
            try:
                with _datasets_retries_off():
                    return fn()
            except Exception as e:
                if not self.failed(e, attempt, label, probe, started):
                    raise
            attempt += 1


def _describe(targets: list[str]) -> str:
    shown = ", ".join(targets[:3])
    return shown + (f" and {len(targets) - 3} more" if len(targets) > 3 else "")


class Source:
    """A dataset split opened through ``datasets``. Use :func:`open_source` to make one."""

    shards: list[ShardInfo]
    fingerprint: dict
    column_names: list[str] | None

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        raise NotImplementedError

    @property
    def footers(self) -> dict[str, bytes]:
        """The parquet footers this source read (path -> bytes), to share with other ranks; {} if none."""
        return {}

    def close(self) -> None:
        """Stop background work (fetches ahead) and wait for it; reading again starts it afresh."""


class StreamingSource(Source):
    """``load_dataset(..., streaming=True)`` read one shard per file; or, with a dataset index (parquet),
    one shard per row group read with pyarrow (:class:`~resumable_stream.parquet_files.ParquetFiles`).

    With a remote dataset, a read that fails midway (reset, 5xx, truncated body, timeout) reopens the
    shard at the next row not yet yielded, under ``data.retries``: the rows come out as without it."""

    def __init__(self, ids, shards: list[ShardInfo], fingerprint: dict, retry: RetryPolicy | None = None,
                 parquet: ParquetFiles | None = None, index: dict | None = None, prefetch_blocks: int | None = 0,
                 prefetch_memory_mb: float | None = None):
        self._ids = ids
        self._parquet = parquet
        self.index = index          # the dataset index this source reads (None: not indexed)
        self.shards = shards
        self.fingerprint = fingerprint
        self.column_names = parquet.column_names if parquet is not None else ids.column_names
        self._retry = retry
        self._prefetch: Prefetcher | None = None
        if parquet is not None:
            self._file_of = {f["path"]: i for i, f in enumerate(index["files"])}
            if prefetch_blocks is None or prefetch_blocks > 0:    # None: adaptive depth (prefetch.py)
                budget = None if prefetch_memory_mb is None else int(prefetch_memory_mb * 2**20)
                # local files: decoding is the work, so one thread per core (more only delay the row groups
                # needed first); remote: the prefetcher's own count, for concurrent requests
                cores = os.cpu_count() or 1
                threads = None if retry is not None else max(1, min(prefetch_blocks or cores, cores))
                self._prefetch = Prefetcher(self._fetch_row_group, prefetch_blocks, budget, self._row_group_bytes,
                                            threads)

    @property
    def footers(self) -> dict[str, bytes]:
        return self._parquet.footers if self._parquet is not None else {}

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()

    @property
    def prefetch_depth(self) -> int:
        """Row groups fetched ahead per partition (0: no prefetch)."""
        return self._prefetch.depth if self._prefetch is not None else 0

    def prefetch(self, partition: int, shards: list[int]) -> None:
        """The plan says ``partition`` opens ``shards`` next, in this order: start fetching them."""
        if self._prefetch is not None:
            self._prefetch.hint(partition, shards)

    def prefetch_ahead(self, partition: int) -> int:
        """How many of ``partition``'s next shards are worth hinting now (its adaptive depth, and a margin)."""
        return min(self._prefetch.cap, self._prefetch.depth_for(partition) + 8) if self._prefetch is not None else 0

    def prefetch_stats(self) -> dict:
        """The prefetcher's depth, measurements and byte counters (prefetch.py); {} without prefetch."""
        return self._prefetch.stats() if self._prefetch is not None else {}

    def _row_group_bytes(self, shard: int) -> int:
        """The bytes one fetch of ``shard`` transfers (its row group's span in the index)."""
        info = self.shards[shard]
        _, start, end = self.index["files"][self._file_of[info.file]]["row_groups"][info.part]
        return end - start

    def _fetch_row_group(self, shard: int) -> pa.Table:
        info = self.shards[shard]
        table = self._parquet.row_group(self._file_of[info.file], info.part)
        record_row_group(table.num_rows)
        return table

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        info = self.shards[shard]
        retry = self._retry
        if retry is None or not retry.applies(info.file):
            yield from self._guarded(self._tables_from(shard, start_row), shard)
            return
        row, attempt, started = start_row, 0, time.monotonic()
        while True:
            tables = self._tables_from(shard, row)
            try:
                while True:
                    try:
                        with _datasets_retries_off():
                            table = next(tables)
                    except StopIteration:
                        return
                    except Exception as e:
                        label = f"data file {info.file!r} (shard {shard}, {info.name}): read at row {row}"
                        if not retry.failed(e, attempt, label, [info.file] if info.file else [], started):
                            err = self._read_error(shard, e)
                            if err is e:
                                raise
                            raise err from e
                        attempt += 1
                        break        # reopen the shard at ``row``, the first row not yet yielded
                    # progress: a later fault gets the full number of retries and time again
                    attempt, started = 0, time.monotonic()
                    row += table.num_rows
                    yield table
            finally:
                tables.close()

    def _tables_from(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        if self._parquet is not None:
            yield from self._row_group_from(shard, start_row)
            return
        one = self._ids.shard(num_shards=len(self.shards), index=shard, contiguous=True).with_format("arrow")
        seen = 0
        tables = one.iter(batch_size=READ_BATCH_ROWS)
        try:
            # Reopening at a row re-reads the shard's prefix: bounded by one shard (a row group for parquet).
            for table in tables:
                n = table.num_rows
                if seen + n <= start_row:
                    seen += n
                    continue
                if seen < start_row:
                    table = table.slice(start_row - seen)
                seen += n
                yield table
        finally:
            tables.close()   # a shard left mid-way: end datasets' reader (and its pyarrow scan) now

    def _row_group_from(self, shard: int, start_row: int) -> Iterator[pa.Table]:
        """One row group, from ``start_row``, in tables of READ_BATCH_ROWS counted from its first row."""
        table = None
        ahead = self._prefetch.take(shard) if self._prefetch is not None else None
        if ahead is not None:
            try:
                table = ahead.result()
            except ResumableStreamError:           # its bytes failed the checks twice: a third read is not due
                raise
            except Exception:                      # a network fault ahead: read it here, under the retries
                pass
        if table is None:
            table = self._fetch_row_group(shard)
        for lo in range(0, table.num_rows, READ_BATCH_ROWS):
            hi = min(lo + READ_BATCH_ROWS, table.num_rows)
            if hi > start_row:
                yield table.slice(max(lo, start_row), hi - max(lo, start_row))

    def _read_error(self, shard: int, e: Exception) -> ResumableStreamError:
        if isinstance(e, ResumableStreamError):
            return e                 # ours already names the file (a StreamMismatchError stays one)
        info = self.shards[shard]
        return SourceError(f"data file {info.file!r} (shard {shard}, {info.name}): read failed "
                           f"({type(e).__name__}: {e})")

    def _guarded(self, tables: Iterator[pa.Table], shard: int) -> Iterator[pa.Table]:
        """Errors from deep inside datasets / fsspec become one SourceError naming the file."""
        try:
            while True:
                try:
                    table = next(tables)
                except StopIteration:
                    return
                except Exception as e:
                    err = self._read_error(shard, e)
                    if err is e:
                        raise
                    raise err from e
                yield table
        finally:
            tables.close()


class MapStyleSource(Source):
    """A dataset loaded normally (memory-mapped Arrow), cut into fixed-size row ranges."""

    def __init__(self, ds, fingerprint: dict):
        self._arrow = ds.with_format("arrow")
        n = len(ds)
        count = max(1, -(-n // MAP_STYLE_SHARD_ROWS))
        self.shards = [
            ShardInfo(i, "", i, min(MAP_STYLE_SHARD_ROWS, n - i * MAP_STYLE_SHARD_ROWS)) for i in range(count)
        ] if n else [ShardInfo(0, "", 0, 0)]
        self.fingerprint = fingerprint
        self.column_names = ds.column_names

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        lo = shard * MAP_STYLE_SHARD_ROWS
        hi = lo + (self.shards[shard].num_rows or 0)
        pos = lo + start_row
        while pos < hi:  # random access: no prefix to re-read
            end = min(hi, pos + READ_BATCH_ROWS)
            yield self._arrow[pos:end]
            pos = end


def open_source(cfg: StreamConfig, index: dict | None = None, progress: Callable[[], None] | None = None,
                footers: dict[str, bytes] | None = None) -> Source:
    """Open ``cfg``'s dataset split. Raises ConfigError / SourceError with the reason.

    Remote datasets are resolved under ``data.retries`` / ``data.retry_backoff_s`` (each step on its
    own) with ``data.timeout_s`` on every HTTP connection and read. A parquet dataset is read from its
    dataset index: ``index`` when given (checked against the config; nothing is resolved then),
    otherwise built here (``progress()`` after each file). ``footers``: the parquet footers of the index's
    files already read elsewhere (path -> bytes, checked against the index; the source's ``footers()``)."""
    if cfg.backend == "local":
        return _open_local(cfg)
    path, data_files = builder_args(cfg)
    targets = remote_targets(path, data_files)
    retry = RetryPolicy(cfg, remote=bool(targets))
    if index is not None and cfg.streaming:
        indexed = INDEXED_FORMATS.get(index.get("builder"))
        if indexed is not None:
            return indexed.open_indexed(cfg, index, retry, footers)
        return source_from_index(cfg, index, retry, footers)
    footers = {}
    files = explicit_urls(cfg, path, data_files) if cfg.streaming else None
    if files is None and not targets:
        # local parquet: resolved as datasets resolves it, without datasets (None: datasets resolves it)
        files = resolve_local_parquet(cfg, path, data_files)
    if files is not None:
        return source_from_index(cfg, build_parquet_index(cfg, files, None, retry, progress, footers), retry, footers)
    builder, files = resolve_files(cfg, path, data_files, targets, retry)
    indexed = INDEXED_FORMATS.get(builder.name) if cfg.streaming and files else None
    if indexed is not None:
        index = indexed.build_index(cfg, files, builder.info.features, retry, progress, footers)
        return indexed.open_indexed(cfg, index, retry, footers)
    if cfg.streaming and _indexable(builder, files):
        index = build_parquet_index(cfg, files, builder.info.features, retry, progress, footers)
        return source_from_index(cfg, index, retry, footers)
    return _open_with_datasets(cfg, builder, files, targets, retry)


def explicit_urls(cfg: StreamConfig, path: str, data_files) -> list[str] | None:
    """The split's files when the config lists parquet files by plain http(s) URL: then there is nothing
    to resolve (no pattern, no repository), and asking ``datasets`` would cost 3 requests per file. None
    otherwise: ``datasets`` resolves (hub ids, hf://, patterns, builder configs, local files)."""
    if path != "parquet" or cfg.name is not None or cfg.data_dir is not None or data_files is None:
        return None
    splits = data_files if isinstance(data_files, dict) else {"train": data_files}
    splits = {str(k): [v] if isinstance(v, str) else v for k, v in splits.items()}
    if not all(isinstance(v, list) and v and all(isinstance(f, str) and f.split("://", 1)[0] in ("http", "https")
                                                 and not _GLOB_CHARS.search(f) for f in v)
               for v in splits.values()):
        return None
    if cfg.split not in splits:
        raise ConfigError(f"data.split: got {cfg.split!r}; this dataset has the splits: {', '.join(splits)}")
    return list(splits[cfg.split])


def _indexable(builder, files: list[str]) -> bool:
    """Parquet files read whole (no column selection or row filter in the builder config)."""
    return (builder.name == "parquet" and bool(files) and getattr(builder.config, "columns", None) is None
            and getattr(builder.config, "filters", None) is None)


def source_from_index(cfg: StreamConfig, index: dict, retry: RetryPolicy,
                      footers: dict[str, bytes] | None = None) -> StreamingSource:
    """The stream of an indexed parquet dataset: one shard per row group, read with pyarrow."""
    files = index["files"]
    shards = [ShardInfo(0, f["path"], g, rg[0]) for f in files for g, rg in enumerate(f["row_groups"])]
    shards = [ShardInfo(i, s.file, s.part, s.num_rows) for i, s in enumerate(shards)]
    fingerprint = {
        "dataset": cfg.dataset_name_or_path, "name": cfg.name, "split": cfg.split, "backend": cfg.backend,
        "streaming": cfg.streaming, "builder": index["builder"], "files": [identity_of(f) for f in files],
        "num_shards": len(shards), "shard_rows": _digest([s.num_rows for s in shards]),
        **_hub_fingerprint([f["path"] for f in files]), **_data_dir(cfg),
    }
    return StreamingSource(None, shards, fingerprint, retry if retry.remote else None,
                           parquet=ParquetFiles(index, retry.storage_options, footers), index=index,
                           prefetch_blocks=prefetch_depth(cfg, retry.remote), prefetch_memory_mb=cfg.prefetch_memory_mb)


def prefetch_depth(cfg: StreamConfig, remote: bool) -> int | None:
    """The most row groups fetched ahead per partition: ``data.prefetch_blocks`` (None: adaptive, up to the
    prefetcher's own cap); for local files at most what keeps the decoding threads busy and the row groups a
    window opens next in flight (one per core, at least ``interleave_shards``): there is no latency to hide,
    and each one ahead is a decoded row group held."""
    if remote or cfg.prefetch_blocks == 0:
        return cfg.prefetch_blocks
    local = max(os.cpu_count() or 1, cfg.interleave_shards)
    return local if cfg.prefetch_blocks is None else min(cfg.prefetch_blocks, local)


def _hub_not_found(e: BaseException) -> bool:
    """``datasets``' error for a missing (or private) repo or revision, raised without the Hub's answer:
    "Dataset 'x' doesn't exist on the Hub ...", and with datasets 4.0.0 (LLaMA-Factory 0.9.5's pin) also
    "Revision 'r' doesn't exist for dataset 'x' on the Hub." (later releases keep that one's cause)."""
    text = str(e)
    return "doesn't exist on the Hub" in text or ("doesn't exist for dataset" in text and "on the Hub" in text)


def resolve_files(cfg: StreamConfig, path: str, data_files, targets: list[str],
                  retry: RetryPolicy) -> tuple[Any, list[str]]:
    """``datasets``' builder for the config and the resolved files of its split."""
    import datasets

    where = f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}"
    if targets and targets != [cfg.dataset_name_or_path]:
        where += f" ({_describe(targets)})"
    # a copy: datasets adds to the dict it is given
    options = {"storage_options": copy.deepcopy(retry.storage_options)} if retry.remote else {}
    if cfg.revision is not None:
        options["revision"] = cfg.revision
    if cfg.data_dir is not None:
        options["data_dir"] = cfg.data_dir
    try:
        builder = retry.call(lambda: datasets.load_dataset_builder(path, cfg.name, data_files=data_files, **options),
                             f"{where}: resolving the dataset", targets)
    except (ConfigError, SourceError):
        raise
    except Exception as e:
        answer = hub_answer(_chain(e), where, cfg.revision)      # the repo / revision / token, named
        repo = hub_repo_of(path) if targets else None
        if answer is None and repo is not None and _hub_not_found(e):
            answer = probe_answer(repo, cfg.revision, where)
        if answer is not None:
            raise SourceError(answer) from None
        answer = remote_answer(e)
        if answer is not None:
            raise SourceError(f"{_data_key(cfg)}: the object store refused ({answer})") from None
        if isinstance(e, FileNotFoundError):
            raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r} / data.data_files "
                              f"{cfg.data_files!r}: {e}") from None
        raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: cannot be loaded by datasets "
                          f"({type(e).__name__}: {e})") from None

    resolved = builder.config.data_files
    splits = [str(s) for s in (resolved if resolved else (builder.info.splits or {}))]
    if splits and cfg.split not in splits:
        raise ConfigError(f"data.split: got {cfg.split!r}; this dataset has the splits: {', '.join(splits)}")
    files = [str(f) for f in resolved[cfg.split]] if resolved else []
    if resolved and not files:
        why = _why_nothing_listed(_flat_files(data_files), retry.storage_options)
        raise SourceError(f"data.data_files {cfg.data_files or cfg.dataset_name_or_path!r}: matches no file for "
                          f"split {cfg.split!r}" + (f" ({why})" if why else ""))
    # hf:// files on a branch: read the commit it points to now, the same for every rank and restart
    files = pin_commits(files, lambda repo, rev: retry.call(
        lambda: commit_sha(repo, rev), f"{where}: reading the commit of {repo}@{rev or 'main'}", targets))
    return builder, files


def _data_dir(cfg: StreamConfig) -> dict:
    """``data_dir`` in the fingerprint when set (fingerprints saved before the key still match)."""
    return {"data_dir": cfg.data_dir} if cfg.data_dir is not None else {}


def _hub_fingerprint(files: list[str]) -> dict:
    """The Hub commits the files come from (a new commit on the repo is then a mismatch naming it)."""
    commits = hub_commits(files)
    return {"hub_commits": commits} if commits else {}


def _data_key(cfg: StreamConfig) -> str:
    """The config key (and value) that names the data: data_files when set, else dataset_name_or_path."""
    if cfg.data_files is not None:
        return f"data.data_files {cfg.data_files!r}"
    return f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}"


def _why_nothing_listed(patterns: list[str], storage_options: dict) -> str | None:
    """Why an object-store pattern lists nothing, when the store says so: globbing hides a missing bucket
    (s3fs lists it as empty), asking for the bucket itself does not. One request per bucket."""
    import fsspec

    buckets = {p.split("://", 1)[0] + "://" + p.split("://", 1)[1].split("/", 1)[0]
               for p in patterns if is_remote(p) and p.split("://", 1)[0] in _BUCKET_PROTOCOLS}
    for bucket in sorted(buckets):
        try:
            fs, path = fsspec.core.url_to_fs(bucket, **_protocol_options(storage_options, bucket))
            fs.ls(path, detail=False)
        except Exception as e:
            return f"{bucket}: {remote_answer(e) or f'{type(e).__name__}: {e}'}"
    return None


def _open_with_datasets(cfg: StreamConfig, builder, files: list[str], targets: list[str],
                        retry: RetryPolicy) -> Source:
    """Everything but indexed parquet: ``datasets`` reads it (one shard per file when streaming)."""
    where = f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}"
    if targets and targets != [cfg.dataset_name_or_path]:
        where += f" ({_describe(targets)})"
    identities = map_files(lambda f: file_identity(f, retry), files)
    fingerprint = {
        "dataset": cfg.dataset_name_or_path, "name": cfg.name, "split": cfg.split, "backend": cfg.backend,
        "streaming": cfg.streaming, "builder": builder.name, "files": identities, **_hub_fingerprint(files),
        **_data_dir(cfg),
    }

    if not cfg.streaming:
        def load():
            builder.download_and_prepare()
            return builder.as_dataset(split=cfg.split)

        try:
            ds = retry.call(load, f"{where}: downloading and preparing", files or targets)
        except SourceError:
            raise
        except Exception as e:
            raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: loading without streaming "
                              f"failed ({type(e).__name__}: {e})") from None
        return _finish_map_style(ds, fingerprint)

    try:
        ids = retry.call(lambda: builder.as_streaming_dataset(split=cfg.split), f"{where}: opening the stream",
                         files or targets)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {cfg.dataset_name_or_path!r}: streaming failed "
                          f"({type(e).__name__}: {e})") from None
    n = ids.num_shards
    names = files if len(files) == n else [""] * n
    shards = [ShardInfo(i, f, None, None) for i, f in enumerate(names)]
    fingerprint["num_shards"] = len(shards)
    fingerprint["shard_rows"] = _digest([s.num_rows for s in shards])
    return StreamingSource(ids, shards, fingerprint, retry if retry.remote else None)


def _finish_map_style(ds, fingerprint: dict) -> MapStyleSource:
    fingerprint = dict(fingerprint, num_rows=len(ds), shard_rows_each=MAP_STYLE_SHARD_ROWS)
    src = MapStyleSource(ds, fingerprint)
    src.fingerprint["num_shards"] = len(src.shards)
    return src


def _open_local(cfg: StreamConfig) -> Source:
    import datasets

    path = cfg.dataset_name_or_path
    if not os.path.isdir(path):
        raise SourceError(f"data.dataset_name_or_path {path!r}: backend 'local' needs a directory written by "
                          "Dataset.save_to_disk / DatasetDict.save_to_disk")
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise SourceError(f"data.dataset_name_or_path {path!r}: not a save_to_disk directory "
                          f"({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.split not in loaded:
            raise ConfigError(f"data.split: got {cfg.split!r}; this dataset has the splits: {', '.join(loaded)}")
        ds = loaded[cfg.split]
    else:
        ds = loaded
    files = sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names
        if f.endswith(".arrow") or f in ("state.json", "dataset_info.json")
    )
    fingerprint = {
        "dataset": path, "name": None, "split": cfg.split, "backend": "local", "streaming": False,
        "files": [file_identity(f) for f in files],
    }
    return _finish_map_style(ds, fingerprint)
