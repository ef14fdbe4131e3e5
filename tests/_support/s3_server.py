"""A real S3 endpoint for tests: moto's S3 server on 127.0.0.1, with IAM auth on and faults on demand.

``S3Server()`` starts moto (in a thread, ephemeral port), creates a user ``reader`` allowed to use
the buckets named in ``readable`` (and nothing else), then turns moto's authentication on: requests
signed with any other key are refused (403 InvalidAccessKeyId), a bucket outside the policy answers
403 AccessDenied, a bucket that does not exist 404 NoSuchBucket, as AWS does. ``admin()`` is a boto3
client of a user ``admin`` allowed everything, for setting data up and rewriting it.

Faults: ``srv.faults`` is a list of callables ``fault(method, path) -> "reset" | "500" | "503" |
None``, consulted before moto sees a request (first answer wins): ``"reset"`` drops the connection
with a TCP reset, ``"503"`` answers S3's ``SlowDown``, ``"500"`` ``InternalError``. Every request is
counted in ``srv.requests`` as ``(method, path)``.

A request rate, as S3's per prefix: ``srv.limit_rate(per_s=40, window_s=1)`` answers a GET / HEAD 503
``SlowDown`` ("Please reduce your request rate.") when ``per_s x window_s`` of them were let through in the last
``window_s`` seconds (the refused ones do not count); ``srv.allowed_at`` holds the times of those let through,
``srv.slowdowns`` counts the refusals.

Nothing here reaches the internet: the environment the tests use (``s3_env``) points credentials at
fake values and turns off the EC2 metadata lookup boto would otherwise try.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Callable

# Set by S3Server for its clients; the metadata / config lookups boto makes otherwise are disabled.
OFFLINE_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_SESSION_TOKEN": "",
}
ROOT_KEY = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
              '</Error>')
_FAULT_ANSWERS = {"500": ("500 Internal Server Error", "InternalError", "We encountered an internal error."),
                  "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate.")}


class _FaultMiddleware:
    """WSGI middleware in front of moto: counts requests and injects the faults the server's list asks for."""

    def __init__(self, app, owner: S3Server):
        self.app, self.owner = app, owner

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self.owner.lock:
            self.owner.requests.append((method, path))
        fault = next((f for f in (rule(method, path) for rule in list(self.owner.faults)) if f), None)
        if fault == "reset":
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            return []
        if fault in _FAULT_ANSWERS:
            status, code, message = _FAULT_ANSWERS[fault]
            body = _ERROR_XML.format(code=code, message=message).encode()
            start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        return self.app(environ, start_response)


class S3Server:
    """moto's S3 (and IAM) on 127.0.0.1 with authentication on; a context manager."""

    def __init__(self, readable: tuple[str, ...] = ("data",)):
        self.readable = readable
        self.faults: list[Callable[[str, str], str | None]] = []
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self.reader_key: dict[str, str] = {}
        self.allowed_at: list[float] = []      # with limit_rate: when each GET / HEAD let through came in
        self.slowdowns = 0
        self.refused: list[tuple[float, str, str]] = []   # with limit_rate: (when, method, path) of each SlowDown

    def limit_rate(self, per_s: float, window_s: float = 1.0, methods: tuple[str, ...] = ("GET", "HEAD")) -> None:
        """Answer ``methods`` 503 SlowDown past ``per_s x window_s`` requests let through in the last ``window_s``
        seconds (a sliding window, as a partitioned prefix takes ~5,500 a second)."""
        recent: collections.deque = collections.deque()
        self.allowed_at, self.slowdowns, self.refused = [], 0, []

        def rule(method: str, path: str) -> str | None:
            if method not in methods:
                return None
            with self.lock:
                now = time.monotonic()
                while recent and recent[0] <= now - window_s:
                    recent.popleft()
                if len(recent) >= per_s * window_s:
                    self.slowdowns += 1
                    self.refused.append((now, method, path))
                    return "503"
                recent.append(now)
                self.allowed_at.append(now)
            return None

        self.faults.append(rule)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> S3Server:
        import moto.settings
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)     # no line per request on stderr
        app = _FaultMiddleware(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="moto-s3")
        self._thread.start()
        self._saved_auth = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
        self._make_reader()
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0      # from now on every request is authenticated
        return self

    def _make_reader(self) -> None:
        iam = self._client("iam", ROOT_KEY)
        arns = [a for b in self.readable for a in (f"arn:aws:s3:::{b}", f"arn:aws:s3:::{b}/*")]
        self.reader_key = self._user(iam, "reader", arns)
        self.admin_key = self._user(iam, "admin", ["*"])

    @staticmethod
    def _user(iam, name: str, resources: list[str]) -> dict[str, str]:
        """A new IAM user allowed s3:* on ``resources``: its access key as environment variables."""
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": resources}]}
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def _client(self, service: str, key: dict[str, str]):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=key["AWS_SECRET_ACCESS_KEY"])

    def admin(self):
        """A boto3 S3 client of the user ``admin`` (allowed everything)."""
        return self._client("s3", self.admin_key)

    def env(self) -> dict[str, str]:
        """The environment of a client that reads as ``reader`` (for monkeypatch / subprocesses)."""
        return {**OFFLINE_ENV, **self.reader_key}

    def count(self, method: str | None = None, prefix: str = "") -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if (method is None or m == method) and p.startswith(prefix))

    def stop(self) -> None:
        import moto.settings

        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = self._saved_auth
        if self._server is not None:
            # moto's accounts, users and buckets are process-wide: the next server starts empty
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"),
                                   timeout=30).close()
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
