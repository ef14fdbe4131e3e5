"""The one network policy of the library: retries, timeouts and what counts as a fault.

Every remote step (a file's metadata, a parquet footer, load_dataset_builder, a row group, a Hub call, an
image a VL sample links to) runs under :class:`RetryPolicy`, built from ``data.retries`` /
``data.retry_backoff_s`` / ``data.timeout_s`` / ``data.retry_budget_s``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import http.client
import inspect
import logging
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..config.specs import DataSpec, NetPolicy
from ..errors import ResumableStreamError, SourceError
from ..observe.metrics import record_retry, retry_cause
from ..runtime.threads import map_files
from . import budget as request_budget
from .budget import error_chain, retry_after_s

log = logging.getLogger(__name__)

# Every remote step is retried on its own, local files never; the waiting is bounded and datasets' own retries
# are off around our calls (docs/internals.md#bounded-waiting).

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
GLOB_CHARS = re.compile(r"[*?\[]")
# Object stores whose URLs start with a bucket (listing one costs a request, not a crawl).
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


@contextlib.contextmanager
def datasets_retries_off() -> Iterator[None]:
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


def flat_files(data_files: object) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, (list, tuple)):
        return [f for f in data_files if isinstance(f, str)]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in flat_files(v)]
    return []


class _HttpRetry:
    """aiohttp client middleware retrying each idempotent request up to ``retries`` times: the requests datasets
    makes deep inside (resolving, schema inference). A ranged GET's body is read here, so a cut body is retried
    too. Picklable, with a stable repr (fsspec keys its filesystem cache on it)."""

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
                if ranged and resp.status == 429:
                    return resp                      # read_range waits for the reset, pausing the whole process
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


def backoff_wait(backoff_s: float, attempt: int, retry_after: float | None = None) -> float:
    """The wait before try ``attempt + 2``: exponential backoff, at least the server's Retry-After (capped at
    _MAX_RETRY_AFTER_S), stretched by a random jitter of up to _JITTER."""
    wait = min(backoff_s * 2.0 ** min(attempt, 60), max(_MAX_BACKOFF_S, backoff_s))
    if retry_after is not None:
        wait = max(wait, min(retry_after, _MAX_RETRY_AFTER_S))
    return wait * (1.0 + _JITTER * _jitter_rng.random())


def _storage_options(timeout_s: float, retries: int, backoff_s: float) -> dict:
    """fsspec options handed to datasets: ``timeout_s`` per connect or read, single requests retried."""
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


_HTTP_STACK: list[threading.Thread] = []


def import_http_stack_ahead() -> None:
    """Import fsspec's HTTP filesystem and aiohttp on a daemon thread, once per process: what reading http(s)
    data with fsspec needs (0.2-1 s), while the first requests go out (their answers are waited for meanwhile)."""
    if _HTTP_STACK:
        return

    def load() -> None:
        try:
            import aiohttp  # noqa: F401
            import fsspec.implementations.http  # noqa: F401
        except Exception:       # noqa: BLE001 - imported again (and its error raised) where it is needed
            pass

    thread = threading.Thread(target=load, name="rs-import-http", daemon=True)
    _HTTP_STACK.append(thread)
    thread.start()


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


def protocol_options(storage_options: dict, path: str) -> dict:
    """The flat fsspec kwargs for ``path``'s protocol out of datasets-style ``{protocol: kwargs}``."""
    protocol = path.split("://", 1)[0] if "://" in path else "file"
    return copy.deepcopy(storage_options.get(protocol, {}))   # botocore edits its config_kwargs in place


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
    # ConnectionError, requests' errors, ...; http.client's cut bodies (IncompleteRead: io/ranged.read_tail)
    types: list[type[BaseException]] = [OSError, TimeoutError, http.client.HTTPException]
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
    chain = error_chain(e)
    if any(isinstance(x, ResumableStreamError) for x in chain):
        return "permanent"          # ours: an answer about the data or the config, never a fault
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
    for x in error_chain(e):
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
    root = error_chain(e)[-1]
    if root is not e and str(root) not in text:
        text += f" (caused by {type(root).__name__}: {root})"
    return text


def _probe_missing(urls: list[str], timeout_s: float) -> tuple[str, int] | None:
    """The first http(s) URL the server says is not there (404 / 410), or None (all there, or unknown)."""
    probe = [u for u in dict.fromkeys(urls) if u.split("://", 1)[0] in ("http", "https")
             and not GLOB_CHARS.search(u)]

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

    @classmethod
    def of(cls, retries: int = 5, retry_backoff_s: float = 1.0, timeout_s: float = 60.0,
           retry_budget_s: float = 180.0) -> RetryPolicy:
        """A remote policy from the four ``data.*`` values alone (the defaults: StreamConfig's)."""
        return cls(NetPolicy(retries, retry_backoff_s, timeout_s, retry_budget_s), remote=True)

    def __init__(self, net: NetPolicy, remote: bool, data: DataSpec | None = None):
        """``net``: the data section's network settings; ``remote``: whether the source reads over the network;
        ``data``: the dataset, whose paths' protocols receive flat ``data.storage_options``."""
        self.retries = net.retries
        self.backoff_s = float(net.retry_backoff_s)
        self.timeout_s = float(net.timeout_s)
        self.budget_s = float(net.retry_budget_s)
        self.remote = remote
        # the job's request budget (io/budget.py), registered in this process and in every one the policy reaches
        self.requests = request_budget.RequestBudget(net.max_requests_per_s, float(net.rate_limit_wait_s))
        if remote:
            request_budget.register(self.requests)
        # the http(s) options are ours alone (no user headers, auth, ...): a read may go without aiohttp
        self.own_http_options = not net.storage_options
        self._user_options = net.storage_options
        # the protocols of the data's remote paths (s3, gs, hf, http, ...), in order of appearance
        paths = [data.dataset_name_or_path, *flat_files(data.data_files)] if remote and data is not None else []
        self._protocols = list(dict.fromkeys(p.split("://", 1)[0] for p in paths if is_remote(p)))
        if any(p in ("http", "https") for p in self._protocols):
            # their aiohttp objects need aiohttp (0.2-1 s to import), imported meanwhile on a thread (a first
            # sample's requests need not wait for it: io/ranged.read_tail)
            import_http_stack_ahead()

    @functools.cached_property
    def storage_options(self) -> dict:
        """fsspec storage options ({protocol: kwargs}), made when first read; {} for a local source."""
        if not self.remote:
            return {}
        ours = _storage_options(self.timeout_s, min(self.retries, HTTP_REQUEST_RETRIES), self.backoff_s)
        return with_user_options(ours, self._user_options, self._protocols) if self._user_options else ours

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.remote:     # a DataLoader worker (spawned) or any other process the source is handed to
            request_budget.register(self.requests)

    def applies(self, path: str) -> bool:
        """Whether reading ``path`` (a shard's file; "" when unknown) goes over the network."""
        return self.remote and (path == "" or is_remote(path))

    def delay(self, attempt: int, e: BaseException | None = None) -> float:
        """Seconds to wait before try ``attempt + 2`` (attempt 0 failed: backoff, then 2x, 4x, ...; at least
        the Retry-After of the answer that ``e`` carries), with jitter."""
        retry_after = None
        for x in error_chain(e) if e is not None else []:
            response = getattr(x, "response", None)
            retry_after = retry_after_s(getattr(x, "headers", None) or getattr(response, "headers", None))
            if retry_after is not None:
                break
        limit = request_budget.rate_limit_of(e) if e is not None else None
        if limit is not None and limit.reset_s is not None:     # the Hub's RateLimit reset, when it says one
            retry_after = max(retry_after or 0.0, limit.reset_s)
        return backoff_wait(self.backoff_s, attempt, retry_after)

    def failed(self, e: BaseException, attempt: int, label: str, probe: list[str], started: float) -> bool:
        """After ``e`` ended try ``attempt + 1`` of a step begun at ``started``: sleep and True when another try
        is due, False when ``e`` is no fault; SourceError when the file is gone or the retries / time are spent."""
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
        # the step's own time: waits for its turn under the request budget (and a store's resets) do not count
        elapsed = max(0.0, time.monotonic() - started - request_budget.waited_since(started))
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
                with datasets_retries_off():
                    return fn()
            except Exception as e:
                if not self.failed(e, attempt, label, probe, started):
                    raise
            attempt += 1


class HttpAnswer(ResumableStreamError):
    """A server's answer about the resource itself (404, 403, ...): not a fault, no retry."""

    def __init__(self, url: str, status: int):
        super().__init__(f"{url}: HTTP {status}")
        self.url, self.status = url, status


def fetch_url(url: str, read: Callable[[Any], T], retry: RetryPolicy, label: str) -> T:
    """``read(response)`` of a plain GET of an http(s) ``url``, faults retried as every step's are; a status about
    the resource raises :class:`HttpAnswer`, spent retries a SourceError naming ``label``."""
    attempt, started = 0, time.monotonic()
    while True:
        request_budget.acquire(url)
        try:
            with urllib.request.urlopen(url, timeout=retry.timeout_s) as response:
                return read(response)
        except urllib.error.HTTPError as e:
            if not (e.code >= 500 or e.code in _RETRY_STATUSES):
                raise HttpAnswer(url, e.code) from None
            last: BaseException = e
            retry_after = retry_after_s(e.headers)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:   # refused, reset, timeout,
            last, retry_after = e, None                                            # a cut body
        wait = backoff_wait(retry.backoff_s, attempt, retry_after)
        elapsed = time.monotonic() - started
        if attempt >= retry.retries or elapsed + wait >= retry.budget_s:
            raise SourceError(f"{label}: no answer after {attempt + 1} attempts (data.retries: {retry.retries}, "
                              f"data.timeout_s: {retry.timeout_s:g}, data.retry_budget_s: {retry.budget_s:g}); "
                              f"last error: {_error_text(last)}") from None
        log.warning("%s failed (%s); retry %d of %d in %.2f s", label, _error_text(last), attempt + 1,
                    retry.retries, wait)
        record_retry(retry_cause(last))
        time.sleep(wait)
        attempt += 1
