"""A real loopback HTTP/1.1 file server for tests (standard library only).

``FileServer(directory)`` serves the files below ``directory`` on 127.0.0.1 at an ephemeral
port, the way a static file host / CDN does: GET and HEAD, keep-alive with an exact
``Content-Length``, single byte ranges (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) answered
with 206 + ``Content-Range`` (416 when unsatisfiable), ``Accept-Ranges``, an ``ETag`` derived
from (size, mtime_ns) and ``Last-Modified``. No directory listings: clients are given
explicit file URLs.

    with FileServer(tmp_dir) as srv:
        url = srv.url("part-00000.parquet")
        ...
        assert srv.stats()["status"][206] > 0

Every request is counted (thread-safe) and recorded in ``srv.requests`` as a
:class:`RequestRecord`.

Extension points for later fault / network-condition tests:

* ``srv.faults``: a list of callables ``fault(record) -> int | None`` consulted, in order, for
  every request before it is served. The first one returning a status code makes the server
  answer with that status and an empty body (e.g. 503 to simulate an overloaded host). A
  later change can widen the return type (latency, truncated bodies, resets, ...).
* ``FileServer._send_body`` writes the body in ``chunk_size`` pieces: the place for a
  bandwidth limit or a mid-body fault.
"""

from __future__ import annotations

import email.utils
import os
import re
import sys
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


@dataclass
class RequestRecord:
    method: str
    path: str                  # the URL path as requested (percent-encoded)
    range: str | None          # the Range header, if any
    status: int = 0
    bytes_sent: int = 0        # body bytes written


def parse_range(header: str, size: int) -> tuple[int, int] | None | str:
    """One byte range of a file of ``size`` bytes, as inclusive ``(first, last)``.

    Returns ``None`` when the header is to be ignored (not a single well-formed byte range:
    RFC 9110 lets a server answer 200 with the whole file then) and ``"unsatisfiable"``
    when the range lies outside the file (416).
    """
    m = _RANGE_RE.match(header)
    if m is None:
        return None
    a, b = m.group(1), m.group(2)
    if a == "" and b == "":
        return None
    if a == "":                        # bytes=-n: the last n bytes
        n = int(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    first = int(a)
    if b != "" and int(b) < first:
        return None                    # syntactically invalid: ignore the header
    if first >= size:
        return "unsatisfiable"
    last = size - 1 if b == "" else min(int(b), size - 1)
    return first, last


def file_etag(st: os.stat_result) -> str:
    """A strong validator that changes whenever the file's size or mtime does."""
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rs-test-fileserver/1"
    timeout = 60                       # idle keep-alive connections are closed after this
    server: _Server

    # -- plumbing --------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep the base signature
        pass                           # quiet: tests look at srv.requests instead

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _reply_empty(self, rec: RequestRecord, status: int, headers: dict[str, str] | None = None) -> None:
        body = f"{status} {HTTPStatus(status).phrase}\n".encode()
        rec.status = status
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))   # HEAD: the length a GET would get
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
            rec.bytes_sent = len(body)

    # -- the request -----------------------------------------------------------------------
    def _serve(self, head: bool) -> None:
        srv = self.server.owner
        rec = RequestRecord(self.command, self.path, self.headers.get("Range"))
        try:
            for fault in list(srv.faults):
                status = fault(rec)
                if status is not None:
                    self._reply_empty(rec, int(status))
                    return
            path = srv.local_path(self.path)
            if path is None:
                self._reply_empty(rec, 404)
                return
            try:
                f = open(path, "rb")
            except OSError:
                self._reply_empty(rec, 404)
                return
            with f:
                st = os.fstat(f.fileno())
                size = st.st_size
                headers = {
                    "Accept-Ranges": "bytes",
                    "ETag": file_etag(st),
                    "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                }
                rng = parse_range(rec.range, size) if rec.range else None
                if rng == "unsatisfiable":
                    self._reply_empty(rec, 416, {**headers, "Content-Range": f"bytes */{size}"})
                    return
                if rng is None:
                    status, first, length = 200, 0, size
                else:
                    first, last = rng
                    status, length = 206, last - first + 1
                    headers["Content-Range"] = f"bytes {first}-{last}/{size}"
                rec.status = status
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if not head:
                    f.seek(first)
                    srv._send_body(self.wfile, f, length, rec)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True   # the client went away mid-response
        finally:
            srv._record(rec)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: FileServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients (aiohttp pools, forked DataLoader workers) drop keep-alive connections at will.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class FileServer:
    """Serve ``root`` on ``http://127.0.0.1:<ephemeral port>/``; a context manager."""

    chunk_size = 64 * 1024

    def __init__(self, root: str | os.PathLike, host: str = "127.0.0.1"):
        self.root = os.path.realpath(os.fspath(root))
        self.host = host
        self.faults: list[Callable[[RequestRecord], int | None]] = []
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> FileServer:
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, 0), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"FileServer:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("FileServer is not running")
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, name: str | os.PathLike) -> str:
        """The URL of ``name`` (relative to the root, or an absolute path below it)."""
        name = os.fspath(name)
        if os.path.isabs(name):
            name = os.path.relpath(os.path.realpath(name), self.root)
        rel = name.replace(os.sep, "/").lstrip("/")
        return f"{self.base_url}/{urllib.parse.quote(rel)}"

    def local_path(self, url_path: str) -> str | None:
        """The file a request path maps to, or None (outside the root, not a regular file)."""
        path = urllib.parse.unquote(urllib.parse.urlsplit(url_path).path)
        full = os.path.realpath(os.path.join(self.root, path.lstrip("/")))
        if os.path.commonpath([full, self.root]) != self.root or not os.path.isfile(full):
            return None
        return full

    # -- accounting ------------------------------------------------------------------------
    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)

    def _send_body(self, out: BinaryIO, f: BinaryIO, length: int, rec: RequestRecord) -> None:
        left = length
        while left > 0:
            chunk = f.read(min(self.chunk_size, left))
            if not chunk:              # the file shrank under us: the connection cannot be reused
                raise ConnectionResetError("file truncated while serving")
            out.write(chunk)
            left -= len(chunk)
            rec.bytes_sent += len(chunk)

    def stats(self) -> dict[str, Any]:
        """Counts so far: requests, per method, per status, Range requests, body bytes sent."""
        with self._lock:
            recs = list(self.requests)
        return {
            "requests": len(recs),
            "methods": Counter(r.method for r in recs),
            "status": Counter(r.status for r in recs),
            "range_requests": sum(1 for r in recs if r.range),
            "bytes_sent": sum(r.bytes_sent for r in recs),
        }

    def reset_stats(self) -> None:
        with self._lock:
            self.requests.clear()
