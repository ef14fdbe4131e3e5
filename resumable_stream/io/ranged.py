"""Ranged reads that prove they got the bytes they asked for, of the object the index recorded (the checks:
docs/internals.md#verified-bytes). Another object is :class:`ObjectChanged`, another range :class:`WrongBytes`,
a server that ignores ``Range`` :class:`RangeNotSupported`; a short read an ``OSError`` (retried).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
import sys
import threading
import time
import urllib.parse
from typing import Any

from ..errors import SourceError, StreamMismatchError
from ..observe.metrics import record_request
from . import budget as request_budget
from .hub import get_range

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)
_BUCKET_STORES = ("s3", "s3a")


class RangeNotSupported(SourceError):
    """The server answered a byte-range request with the whole object: it does not support ranges."""


class ObjectChanged(StreamMismatchError):
    """The store answered for another version of the object than the one the index recorded."""


class WrongBytes(Exception):
    """The answer is not the bytes asked for (another range, or bytes that fail the footer's checks)."""


_FILESYSTEMS: dict[tuple, Any] = {}
_CREATING = threading.Lock()


def _after_fork() -> None:
    """A forked DataLoader worker makes its own filesystems: with some fsspec versions one made before the fork
    hangs in the child (and the parent's lock may have been held by another thread at the fork)."""
    global _CREATING
    _CREATING = threading.Lock()
    _FILESYSTEMS.clear()
    if "fsspec.asyn" in sys.modules:
        sys.modules["fsspec.asyn"].reset_lock()     # its event loop thread is the parent's


os.register_at_fork(after_in_child=_after_fork)


def filesystem(protocol: str, storage_options: dict):
    """This process's fsspec filesystem for ``protocol``."""
    options = copy.deepcopy(storage_options.get(protocol, {}))   # botocore edits its config_kwargs in place
    key = (protocol, repr(sorted(options.items())))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        with _CREATING:
            fs = _FILESYSTEMS.get(key) or _new_filesystem(protocol, options, key)
    return fs


def _new_filesystem(protocol: str, options: dict, key: tuple):
    import fsspec

    if protocol in _BUCKET_STORES and "session" not in options:
        session = _session_of_this_process(protocol, options)
        if session is not None:
            options["session"] = session
    fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    if protocol in _BUCKET_STORES:
        fs.retries = 1       # s3fs would retry a timed-out call 5 times inside one of our tries
        # The client now, before a request waits its turn under the budget: made lazily, it takes seconds in a
        # fresh DataLoader worker on busy cores, and the requests whose turns came meanwhile would reach the store
        # together once it is ready (a burst past its rate: the SlowDowns the budget is there to avoid).
        try:
            fs.connect()
        except Exception:      # noqa: BLE001 - the first request makes it again, under its retries and errors
            pass
    _FILESYSTEMS[key] = fs
    return fs


def _session_of_this_process(protocol: str, options: dict):
    """The aiobotocore session of fsspec's cached s3fs instance with the same options (the one ``datasets`` listed
    with): our client made from it skips loading botocore's models again (~0.1-0.3 s). None: none yet."""
    import fsspec

    try:
        shared = fsspec.filesystem(protocol, **copy.deepcopy(options))
    except Exception:                           # noqa: BLE001 - no sharing, a session of our own
        return None
    return getattr(shared, "session", None)


def listed_identities(paths: list[str], storage_options: dict) -> dict[str, dict]:
    """The identities of S3 objects (size and ETag, as a HeadObject gives them) from one fresh listing per
    directory holding two or more of ``paths``, instead of one HeadObject per object; {} for the others
    and whenever the listing fails (each is then asked on its own)."""
    by_dir: dict[str, list[str]] = {}
    for path in paths:
        protocol = path.split("://", 1)[0] if "://" in path else ""
        if protocol in _BUCKET_STORES and "?" not in path:
            by_dir.setdefault(path.rsplit("/", 1)[0], []).append(path)
    out: dict[str, dict] = {}
    for directory, members in by_dir.items():
        if len(members) < 2:
            continue
        protocol = directory.split("://", 1)[0]
        try:
            fs = filesystem(protocol, storage_options)
            listing = fs.ls(directory, detail=True, refresh=True)      # the store's answer now, not a cache
        except Exception:                       # noqa: BLE001 - HEAD each object instead (with its retries)
            continue
        found = {f"{protocol}://{entry['name']}": entry for entry in listing if entry.get("type") == "file"}
        for path in members:
            entry = found.get(path)
            if entry is not None and isinstance(entry.get("size"), int) and entry.get("ETag"):
                out[path] = {"path": path, "size": entry["size"], "etag": entry["ETag"]}
    return out


_CLOCK = threading.local()


def request_seconds() -> float:
    """Seconds this thread has spent in :func:`read_range` so far (requests: latency and transfer, no
    decoding): the prefetcher's measure of a fetch's network time."""
    return getattr(_CLOCK, "seconds", 0.0)


def read_range(path: str, start: int, end: int, storage_options: dict, identity: dict | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``path``, checked against ``identity`` (its index entry; None: the length only);
    a remote request in its turn under the request budget, asked again after a rate-limit pause (io/budget.py)."""
    if end <= start:
        return b""
    if "://" not in path or path.startswith("file://"):
        return _timed(lambda: _read_range(path, start, end, storage_options, identity), len, remote=False)
    protocol = path.split("://", 1)[0]
    if protocol in _BUCKET_STORES:
        filesystem(protocol, storage_options)    # made (and connected) before the request's turn: see _new_filesystem
    return _under_budget(path, f"bytes {start}-{end - 1}",
                         lambda: _timed(lambda: _read_range(path, start, end, storage_options, identity), len))


def _under_budget(path: str, what: str, request):
    """``request()`` (one request to ``path``'s store) in its turn under the job's request budget, made again
    after a rate-limit answer's pause (read_range)."""
    waited = 0.0
    # a Hub file's reads go to its signed CDN URL once resolved: only its resolver requests are paced (io/hub.py)
    paced = not path.startswith("hf://")
    while True:
        request_budget.acquire(path, paced=paced)
        before = request_budget.paced_requests()
        try:
            data = request()
        except Exception as e:
            limit = request_budget.rate_limit_of(e)
            if limit is None:
                raise
            pause = request_budget.limited(path, limit)
            most = request_budget.max_wait_s(path)
            if waited + pause > most:
                raise SourceError(
                    f"data file {path!r}: {what}: the store answered that it is asked too often "
                    f"({limit.answer}) and asks to wait {pause:.0f} s more after {waited:.0f} s of such waits, past "
                    f"data.rate_limit_wait_s ({most:g}); the job reads under {request_budget.describe(path)}: lower "
                    "data.max_requests_per_s (another job may be using the same token or bucket), or raise "
                    "data.rate_limit_wait_s") from e
            waited += pause
            continue
        request_budget.answered(path)
        request_budget.read_done(path, paced or request_budget.paced_requests() > before)
        return data


def _timed(request, size_of, remote: bool = True):
    """``request()``, its time added to :func:`request_seconds`; remote, counted as a request of
    ``size_of(answer)`` bytes (what a slow or failing link looks like: requests, bytes, response times)."""
    t0 = time.monotonic()
    ok, nbytes = False, 0
    try:
        out = request()
        ok, nbytes = True, size_of(out)
        return out
    finally:
        took = time.monotonic() - t0
        _CLOCK.seconds = request_seconds() + took
        if remote:
            record_request(took, nbytes, ok)


def read_tail(path: str, nbytes: int, timeout_s: float) -> tuple[dict, bytes] | None:
    """The last ``nbytes`` of an http(s) file and its identity (what a HEAD gives) from one suffix-range GET, sent
    with http.client (no aiohttp import) under the request budget. None where one such request cannot tell both
    (a redirect, a server ignoring the range, an empty file, credentials in the URL): the caller asks as before."""
    split = urllib.parse.urlsplit(path)
    if split.scheme not in ("http", "https") or split.username or split.password or nbytes <= 0:
        return None
    keep_last_modified = _fsspec_reports_last_modified()
    if keep_last_modified is None:
        return None

    return _under_budget(path, f"its last {nbytes} bytes",
                         lambda: _timed(lambda: _tail_http(path, split, nbytes, timeout_s, keep_last_modified),
                                        lambda out: len(out[1]) if out else 0))


@functools.cache
def _fsspec_reports_last_modified() -> bool | None:
    """Whether fsspec's HTTP ``info()`` reports Last-Modified (filesystem_spec#1909), so that read_tail's identity
    holds the keys a HEAD gives; read from its source (importing it imports aiohttp). None: cannot be told."""
    try:
        spec = importlib.util.find_spec("fsspec")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return None
        with open(os.path.join(list(where)[0], "implementations", "http.py"), encoding="utf-8") as f:
            return '"Last-Modified"' in f.read()
    except (OSError, ImportError, ValueError, UnicodeDecodeError):
        return None


def _tail_http(path: str, split, nbytes: int, timeout_s: float,
               keep_last_modified: bool) -> tuple[dict, bytes] | None:
    import http.client
    import urllib.error

    kind = http.client.HTTPSConnection if split.scheme == "https" else http.client.HTTPConnection
    conn = kind(split.hostname, split.port, timeout=timeout_s)
    try:
        target = (split.path or "/") + (f"?{split.query}" if split.query else "")
        conn.request("GET", target, headers={"Range": f"bytes=-{nbytes}", "Accept-Encoding": "identity"})
        r = conn.getresponse()
        if r.status == 404:
            raise FileNotFoundError(path)
        if r.status != 206:
            if r.status < 400 or r.status == 416:     # a redirect, the whole file, an empty file: asked as before
                return None
            raise urllib.error.HTTPError(path, r.status, r.reason, r.headers, None)
        if r.getheader("Content-Encoding", "identity").strip().lower() not in ("identity", ""):
            return None                 # encoded bytes, not the file's: fsspec's HEAD would not trust the size
        m = _CONTENT_RANGE.match(r.getheader("Content-Range") or "")
        if m is None or m.group(3) == "*":
            raise WrongBytes(f"the answer to a request for the last {nbytes} bytes has no valid Content-Range "
                             f"({r.getheader('Content-Range')!r})")
        first, last, size = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if last != size - 1 or last - first + 1 != min(nbytes, size):
            raise WrongBytes(f"asked for the last {nbytes} bytes, the answer holds bytes {first}-{last} of {size}")
        data = r.read()
        if len(data) != last - first + 1:
            raise OSError(f"short read of {path!r}: {len(data)} of {last - first + 1} bytes at {first}")
        identity: dict[str, Any] = {"path": path, "size": size}
        for header, key in (("ETag", "etag"), ("Last-Modified", "last-modified")):
            if r.getheader(header) and (key == "etag" or keep_last_modified):
                identity[key] = r.getheader(header)
        return identity, data
    finally:
        conn.close()


def read_range_parallel(path: str, start: int, end: int, storage_options: dict, identity: dict | None = None,
                        part_bytes: int = 8 << 20, threads: int = 16) -> bytes:
    """:func:`read_range` in concurrent reads of about ``part_bytes`` each (a large row group); local files: one."""
    parts = max(1, min(threads, -(-(end - start) // part_bytes)))
    if parts == 1 or "://" not in path or path.startswith("file://"):
        return read_range(path, start, end, storage_options, identity)
    from concurrent.futures import ThreadPoolExecutor

    step = -(-(end - start) // parts)
    cuts = [(a, min(end, a + step)) for a in range(start, end, step)]
    with ThreadPoolExecutor(len(cuts), thread_name_prefix="rs-ranges") as pool:
        return b"".join(pool.map(lambda c: read_range(path, c[0], c[1], storage_options, identity), cuts))


def _read_range(path: str, start: int, end: int, storage_options: dict, identity: dict | None) -> bytes:
    if "://" not in path or path.startswith("file://"):
        data = _read_local(path[len("file://"):] if path.startswith("file://") else path, start, end, identity)
    else:
        protocol = path.split("://", 1)[0]
        if protocol == "hf" and path.startswith("hf://datasets/"):
            data = _read_hub(path, start, end, identity)
        elif protocol in ("http", "https"):
            data = _read_http(filesystem(protocol, storage_options), path, start, end, identity)
        elif protocol in _BUCKET_STORES:
            data = _read_s3(filesystem(protocol, storage_options), path, start, end, identity)
        else:
            data = filesystem(protocol, storage_options).cat_file(path, start=start, end=end)
    if len(data) != end - start:
        raise OSError(f"short read of {path!r}: {len(data)} of {end - start} bytes at {start}")
    return data


def _read_local(path: str, start: int, end: int, identity: dict | None) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
        st = os.fstat(f.fileno())
    if identity is not None:
        now = {"size": st.st_size, "mtime": round(st.st_mtime, 6)}
        changed = [(k, identity[k], now[k]) for k in ("size", "mtime") if identity.get(k) is not None
                   and identity[k] != now[k]]
        if changed:
            raise object_changed(path, changed)
    return data


def object_changed(path: str, changed: list[tuple[str, Any, Any]]) -> ObjectChanged:
    shown = ", ".join(f"{k}: index {a!r}, now {b!r}" for k, a, b in changed)
    return ObjectChanged(f"data file {path!r} was modified since the dataset index was made ({shown}); the rows it "
                         "holds now are not the ones this run was reading",
                         [(f"file modified: {path} ({k})", a, b) for k, a, b in changed])


def check_answer(path: str, start: int, end: int, identity: dict | None, content_range: str | None,
                 etag: str | None, last_modified: str | None) -> None:
    """A 206 answer's headers against the range asked for and the recorded identity."""
    m = _CONTENT_RANGE.match(content_range or "")
    if m is None:
        raise WrongBytes(f"the answer to a request for bytes {start}-{end - 1} has no valid Content-Range "
                         f"({content_range!r})")
    first, last, total = int(m.group(1)), int(m.group(2)), m.group(3)
    if (first, last) != (start, end - 1):
        raise WrongBytes(f"asked for bytes {start}-{end - 1}, the answer holds bytes {first}-{last}")
    identity = identity or {}
    changed = []
    if total != "*" and identity.get("size") is not None and int(total) != identity["size"]:
        changed.append(("size", identity["size"], int(total)))
    if etag is not None and identity.get("etag") is not None and _etag(etag) != _etag(identity["etag"]):
        changed.append(("etag", identity["etag"], etag))
    elif (etag is None and last_modified is not None and identity.get("last-modified") is not None
          and last_modified != identity["last-modified"]):
        changed.append(("last-modified", identity["last-modified"], last_modified))
    if changed:
        raise object_changed(path, changed)


def _etag(value: str) -> str:
    """An ETag compared weakly (RFC 9110: W/"x" and "x" name the same content for a range read's purpose)."""
    value = str(value).strip()
    return value[2:] if value.startswith("W/") else value


def _if_match(identity: dict | None) -> dict[str, str]:
    """``If-Match`` for a strong ETag (a weak one never matches If-Match: every request would be refused)."""
    etag = (identity or {}).get("etag")
    return {"If-Match": etag} if isinstance(etag, str) and etag.startswith('"') else {}


def _read_http(fs, url: str, start: int, end: int, identity: dict | None) -> bytes:
    from fsspec.asyn import sync

    async def get() -> bytes:
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        headers = {**kw.pop("headers", {}), "Range": f"bytes={start}-{end - 1}", **_if_match(identity)}
        async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
            if r.status == 200:
                raise RangeNotSupported(
                    f"data file {url!r}: the server answered a request for bytes {start}-{end - 1} with the whole "
                    "file (HTTP 200, not 206 Partial Content): it ignores byte ranges. resumable-stream reads "
                    "parquet files row group by row group, so the server must support HTTP Range requests")
            if r.status in (412, 416):
                raise object_changed(url, [(f"HTTP {r.status} to If-Match / Range", (identity or {}).get("etag"),
                                            r.headers.get("ETag"))])
            if r.status == 404:
                raise FileNotFoundError(url)
            r.raise_for_status()
            data = await r.read()
            check_answer(url, start, end, identity, r.headers.get("Content-Range"), r.headers.get("ETag"),
                         r.headers.get("Last-Modified"))
            return data

    return sync(fs.loop, get)


def _read_hub(path: str, start: int, end: int, identity: dict | None) -> bytes:
    """A file at a pinned commit cannot change: the range and the size are checked, no ETag is asked for."""
    response = get_range(path, start, end)
    if response.status_code == 200:
        raise RangeNotSupported(f"data file {path!r}: the Hub answered a request for bytes {start}-{end - 1} with "
                                "the whole file (HTTP 200, not 206): HF_ENDPOINT must support HTTP Range requests")
    check_answer(path, start, end, {"size": (identity or {}).get("size")}, response.headers.get("Content-Range"),
                 None, None)
    return response.content


def _read_s3(fs, path: str, start: int, end: int, identity: dict | None) -> bytes:
    from fsspec.asyn import sync

    bucket, key, version = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if version:
        kwargs["VersionId"] = version
    etag = (identity or {}).get("etag")
    if isinstance(etag, str) and etag:
        kwargs["IfMatch"] = etag

    try:
        resp = fs.call_s3("get_object", **kwargs)       # s3fs's public (sync) call: s3fs's error handling
    except Exception as e:
        if _precondition_failed(e):
            raise object_changed(path, [("etag (S3 If-Match refused: HTTP 412)", etag, None)]) from None
        raise
    body = resp["Body"]
    try:
        data = sync(fs.loop, body.read)                 # the body streams on s3fs's event loop
    finally:
        body.close()
    check_answer(path, start, end, identity, resp.get("ContentRange"), resp.get("ETag"), None)
    return data


def _precondition_failed(e: BaseException) -> bool:
    """An S3 'PreconditionFailed' (412) anywhere in ``e``'s chain (s3fs wraps botocore's ClientError)."""
    for x in request_budget.error_chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict) and ((response.get("Error") or {}).get("Code") == "PreconditionFailed"
                                           or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 412):
            return True
    return False
