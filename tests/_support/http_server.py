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
:class:`RequestRecord` (with the fault injected into it, if any) as soon as it is read; its
status and byte count fill in while it is served.

Network conditions, all switchable at runtime (plain attributes, read per request):

* ``srv.latency_s``: seconds to wait before answering each request (after reading it).
* ``srv.bandwidth_bps``: body throughput limit in **bytes** per second, per response
  (``None``: unlimited).

Validators: a GET with ``If-Match`` other than the file's ETag is answered 412, as nginx and object
stores do (``srv.honour_if_match = False``: ignored, as ``python -m http.server`` does).

A lying cache or proxy: ``srv.ranges_from = {"a.parquet": "b.parquet"}`` answers every ranged GET of
``a.parquet`` with ``b.parquet``'s bytes at that range, under ``a.parquet``'s own headers (size, ETag).

Faults. A fault is one of :data:`FAULT_KINDS`:

* ``"reset"``: the connection is reset (RST) without any response;
* ``"reset_body"``: headers and part of the body, then a reset (HEAD: like ``"reset"``);
* ``"500"`` / ``"503"``: that status with a short body (503 with ``Retry-After: 0``);
* ``"429"`` (not among the default kinds): a rate limit, with ``Retry-After: srv.retry_after_s``;
* ``"truncate"``: headers with the full ``Content-Length``, about half the body, then a
  clean close (HEAD / empty body: like ``"reset"``);
* ``"stall"``: headers, then no body for ``stall_s`` seconds, then a reset (HEAD: nothing
  at all for ``stall_s``, then a reset). Pick ``stall_s`` above the client's read timeout.

Two ways to inject them, consulted in this order before a request is served:

* ``srv.faults``: a list of callables ``fault(record) -> int | str | None``. The first one that
  returns something decides: a status code (``503``) answers with that status and an empty
  body; a kind (``"reset"``) injects that fault.
* ``srv.set_faults(rate=0.2, kinds=("reset", "500", "503", "truncate"), seed=1)``: every
  eligible request is faulted with probability ``rate``, the kind drawn uniformly from
  ``kinds``, both from a ``random.Random(seed)`` consulted under a lock in arrival order
  (sequential clients see the same faults on every run). Eligible requests can be
  narrowed: ``methods=("GET",)``, ``paths=("*.parquet",)`` (``fnmatch`` patterns on the
  decoded URL path), ``first=N`` (only the first N eligible requests after the call).
  ``srv.clear_faults()`` removes the policy (and empties ``srv.faults``).

Other servers reuse all of this (records, latency, faults, ranged bodies): ``tests/_support/hub_server.py``
subclasses ``FileServer`` (``_handler_class``) and its handler (``_answer``, answering through
``_send_content``).

``srv.stats()`` counts requests, statuses, bytes and faults (``faults`` per kind,
``faults_injected`` in all). ``stop()`` is bounded: it wakes stalled / throttled / delayed
handlers, shuts every open connection down and joins the handler threads.
"""

from __future__ import annotations

import email.utils
import fnmatch
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)

FAULT_KINDS = ("reset", "reset_body", "500", "503", "truncate", "stall")
# Also allowed in ``set_faults(kinds=...)``, though not a default kind: a rate limit answer.
RATE_LIMIT_KIND = "429"


@dataclass
class RequestRecord:
    method: str
    path: str                  # the URL path as requested (percent-encoded)
    range: str | None          # the Range header, if any
    status: int = 0            # 0: no status line was sent (reset / stall before headers)
    bytes_sent: int = 0        # body bytes written
    fault: str | None = None   # the fault injected into this request, as applied
    error_code: str | None = None  # the X-Error-Code of an error answer (the loopback Hub's)
    at: float = field(default_factory=time.monotonic)   # when it was read (time.monotonic of the server)
    client: str | None = None  # who the loopback Hub counted it for (its token, else its IP address)


@dataclass
class FaultPolicy:
    """Seeded, per-request fault choice (see the module docstring). Use ``FileServer.set_faults``."""

    rate: float
    kinds: tuple[str, ...]
    seed: int = 0
    methods: frozenset[str] | None = None
    paths: tuple[str, ...] | None = None
    first: int | None = None
    stall_s: float = 5.0
    eligible: int = 0                                  # eligible requests seen so far
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate: got {self.rate!r}; allowed: 0.0 .. 1.0")
        unknown = [k for k in self.kinds if k not in (*FAULT_KINDS, RATE_LIMIT_KIND)]
        if not self.kinds or unknown:
            raise ValueError(f"kinds: got {self.kinds!r}; allowed: a non-empty subset of "
                             f"{(*FAULT_KINDS, RATE_LIMIT_KIND)}")
        if self.first is not None and self.first < 0:
            raise ValueError(f"first: got {self.first!r}; allowed: None or >= 0")
        if self.stall_s < 0:
            raise ValueError(f"stall_s: got {self.stall_s!r}; allowed: >= 0")
        self._rng = random.Random(self.seed)

    def choose(self, rec: RequestRecord) -> str | None:
        """The fault for this request, or None. Call under the server's lock."""
        if self.methods is not None and rec.method not in self.methods:
            return None
        if self.paths is not None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(rec.path).path)
            if not any(fnmatch.fnmatchcase(path, p) for p in self.paths):
                return None
        self.eligible += 1
        if self.first is not None and self.eligible > self.first:
            return None
        if self._rng.random() >= self.rate:
            return None
        return self.kinds[self._rng.randrange(len(self.kinds))]


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


class _Abort(Exception):
    """Raised inside a handler to drop the connection (after a reset / stall / truncation)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rs-test-fileserver/1"
    timeout = 60                       # idle keep-alive connections are closed after this
    # TCP_NODELAY, as real object stores and CDNs answer: with Nagle's algorithm on, the body's first segment
    # after the headers' could wait for the client's delayed ACK (40 ms on Linux), a latency no one injected
    disable_nagle_algorithm = True
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

    def _reset(self) -> None:
        """Drop the connection with a TCP reset (SO_LINGER 0), as a crashed peer or proxy does."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        raise _Abort

    # -- the request -----------------------------------------------------------------------
    def _serve(self, head: bool) -> None:
        """Record the request, apply latency and the fault chosen for it, then :meth:`_answer` it."""
        srv = self.server.owner
        rec = RequestRecord(self.command, self.path, self.headers.get("Range"))
        srv._record(rec)                   # counted at once: a stalled request shows before it ends
        srv._enter()
        try:
            if srv.latency_s:
                srv._sleep(srv.latency_s)
            kind, stall_s = srv._choose_fault(rec)
            if kind is not None and kind.isdigit():
                rec.fault = kind
                self._reply_empty(rec, int(kind), srv._status_fault_headers(int(kind)))
                return
            if kind in ("reset", "reset_body", "truncate") and head:
                kind = "reset"             # nothing to cut short in a HEAD answer
            if kind == "reset":
                rec.fault = kind
                self._reset()
            if kind == "stall" and head:
                rec.fault = kind
                srv._sleep(stall_s)
                self._reset()
            self._answer(rec, head, kind, stall_s)
        except _Abort:
            self.close_connection = True
        except OSError:                    # the client went away mid-response, or stop()
            self.close_connection = True
        finally:
            srv._leave()

    def _answer(self, rec: RequestRecord, head: bool, kind: str | None, stall_s: float) -> None:
        """Serve the file the URL path names (a subclass routes other ways)."""
        path = self.server.owner.local_path(self.path)
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
            etag = file_etag(st)
            headers = {"ETag": etag, "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True)}
            wanted = self.headers.get("If-Match")
            if wanted is not None and self.server.owner.honour_if_match and wanted.strip() not in ("*", etag):
                self._reply_empty(rec, 412, headers)
                return
            other = self.server.owner.ranges_from.get(os.path.basename(path)) if rec.range else None
            if other is not None:          # a broken cache / proxy: another file's bytes under this one's headers
                with open(os.path.join(os.path.dirname(path), other), "rb") as g:
                    self._send_content(rec, g, st.st_size, head, kind, stall_s, headers)
                return
            self._send_content(rec, f, st.st_size, head, kind, stall_s, headers)

    def _send_content(self, rec: RequestRecord, f: BinaryIO, size: int, head: bool, kind: str | None,
                      stall_s: float, headers: dict[str, str], status: int = 200,
                      content_type: str = "application/octet-stream") -> None:
        """Answer with ``size`` bytes of ``f`` (a Range honoured when ``status`` is 200), applying a body
        fault ``kind`` (reset_body, truncate, stall)."""
        srv = self.server.owner
        headers = {"Accept-Ranges": "bytes", **headers} if status == 200 else dict(headers)
        rng = parse_range(rec.range, size) if rec.range and status == 200 else None
        if rng == "unsatisfiable":
            self._reply_empty(rec, 416, {**headers, "Content-Range": f"bytes */{size}"})
            return
        if rng is None:
            first, length = 0, size
        else:
            first, last = rng
            status, length = 206, last - first + 1
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        if kind in ("reset_body", "truncate") and length == 0:
            kind = "reset"         # an empty body cannot be cut short
            rec.fault = kind
            self._reset()
        rec.status = status
        rec.fault = kind
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if head:
            return
        if kind == "stall":
            self.wfile.flush()
            srv._sleep(stall_s)
            self._reset()
        f.seek(first)
        if kind in ("reset_body", "truncate"):
            srv._send_body(self.wfile, f, length // 2, rec)
            if kind == "reset_body":
                self._reset()
            self.close_connection = True   # truncate: a clean close short of Content-Length
            return
        srv._send_body(self.wfile, f, length, rec)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # listen() backlog: socketserver's 5 drops the SYNs of a burst of new connections (a client opening a
    # few dozen concurrent ranged reads), and each dropped one waits out the kernel's 1 s retransmission
    request_queue_size = 128
    owner: FileServer

    def __init__(self, *args: Any, **kw: Any):
        self.live: dict[threading.Thread, socket.socket] = {}
        self.live_lock = threading.Lock()
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Like ThreadingMixIn, but the handler threads are tracked so that stop() can join them.
        t = threading.Thread(target=self._run_request, args=(request, client_address), daemon=True,
                             name=f"FileServer:{self.server_address[1]}:conn")
        with self.live_lock:
            self.live[t] = request
        t.start()

    def _run_request(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self.live_lock:
                self.live.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients (aiohttp pools, forked DataLoader workers) drop keep-alive connections at will.
        exc = sys.exc_info()[1]
        if isinstance(exc, (OSError, _Abort)):
            return
        super().handle_error(request, client_address)


class FileServer:
    """Serve ``root`` on ``http://127.0.0.1:<ephemeral port>/``; a context manager."""

    chunk_size = 64 * 1024

    def __init__(self, root: str | os.PathLike, host: str = "127.0.0.1"):
        self.root = os.path.realpath(os.fspath(root))
        self.host = host
        self.faults: list[Callable[[RequestRecord], int | str | None]] = []
        self.fault_policy: FaultPolicy | None = None
        self.stall_s = 5.0                 # stall length for kinds returned by ``faults`` callables
        self.latency_s = 0.0
        self.bandwidth_bps: float | None = None
        self.retry_after_s = 1             # the Retry-After of a 429 answer (seconds, or an HTTP date)
        self.honour_if_match = True        # a GET whose If-Match is not the file's ETag gets a 412 (False: ignored)
        # file name -> another file (same directory) whose bytes answer ranged GETs of it, under its own headers
        self.ranges_from: dict[str, str] = {}
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._in_flight = self._max_in_flight = 0
        self._stopping = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def _handler_class(self) -> type[_Handler]:
        """The request handler (a subclass of ``_Handler`` that overrides ``_answer`` serves other routes)."""
        return _Handler

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> FileServer:
        if self._httpd is not None:
            return self
        self._stopping = threading.Event()
        httpd = _Server((self.host, 0), self._handler_class())
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"FileServer:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; wakes sleeping handlers, closes open connections, joins the threads."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()               # stalls, latency and throttling return at once
        httpd.shutdown()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            self._thread = None
        with httpd.live_lock:
            live = list(httpd.live.items())
        for _, sock in live:               # idle keep-alive handlers wake from their read
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t, _ in live:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        httpd.server_close()

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

    # -- faults ----------------------------------------------------------------------------
    def set_faults(self, rate: float = 0.2, kinds: Iterable[str] = FAULT_KINDS, seed: int = 0, *,
                   methods: Iterable[str] | None = None, paths: Iterable[str] | None = None,
                   first: int | None = None, stall_s: float = 5.0) -> FaultPolicy:
        """Fault a share ``rate`` of the eligible requests from now on (replaces any policy)."""
        policy = FaultPolicy(
            rate=float(rate), kinds=tuple(kinds), seed=seed,
            methods=None if methods is None else frozenset(m.upper() for m in methods),
            paths=None if paths is None else tuple(paths), first=first, stall_s=float(stall_s),
        )
        with self._lock:
            self.fault_policy = policy
        return policy

    def clear_faults(self) -> None:
        """No more faults: drops the seeded policy and the ``faults`` callables."""
        with self._lock:
            self.fault_policy = None
        self.faults.clear()

    def _choose_fault(self, rec: RequestRecord) -> tuple[str | None, float]:
        for fault in list(self.faults):
            out = fault(rec)
            if out is not None:
                kind = str(out)
                if not kind.isdigit() and kind not in FAULT_KINDS:
                    raise ValueError(f"fault callable returned {out!r}; allowed: a status code or {FAULT_KINDS}")
                return kind, self.stall_s
        with self._lock:
            policy = self.fault_policy
            if policy is None:
                return None, 0.0
            return policy.choose(rec), policy.stall_s

    def _status_fault_headers(self, status: int) -> dict[str, str]:
        if status == 429:
            return {"Retry-After": str(self.retry_after_s)}
        return {"Retry-After": "0"} if status == 503 else {}

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake up at once when the server stops."""
        if seconds > 0 and self._stopping.wait(seconds):
            raise _Abort

    # -- accounting ------------------------------------------------------------------------
    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)

    def _enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _send_body(self, out: BinaryIO, f: BinaryIO, length: int, rec: RequestRecord) -> None:
        left = length
        bps = self.bandwidth_bps
        chunk_size = self.chunk_size if not bps else max(1024, min(self.chunk_size, int(bps) // 20))
        start = time.monotonic()
        sent = 0
        while left > 0:
            if self._stopping.is_set():
                raise _Abort
            chunk = f.read(min(chunk_size, left))
            if not chunk:              # the file shrank under us: the connection cannot be reused
                raise ConnectionResetError("file truncated while serving")
            out.write(chunk)
            left -= len(chunk)
            sent += len(chunk)
            rec.bytes_sent += len(chunk)
            bps = self.bandwidth_bps   # may change while a response is being sent
            if bps:
                ahead = sent / bps - (time.monotonic() - start)
                if ahead > 0:
                    self._sleep(ahead)

    def stats(self) -> dict[str, Any]:
        """Counts so far: requests, per method, per status, Range requests, body bytes sent, faults."""
        with self._lock:
            recs = list(self.requests)
        faults = Counter(r.fault for r in recs if r.fault)
        return {
            "requests": len(recs),
            "methods": Counter(r.method for r in recs),
            "status": Counter(r.status for r in recs),
            "range_requests": sum(1 for r in recs if r.range),
            "bytes_sent": sum(r.bytes_sent for r in recs),
            "faults": faults,
            "faults_injected": sum(faults.values()),
            "max_in_flight": self._max_in_flight,     # most requests being served at the same moment
            "in_flight": self._in_flight,             # requests being served now (e.g. still stalling)
        }

    def reset_stats(self) -> None:
        with self._lock:
            self.requests.clear()
            self._max_in_flight = self._in_flight
