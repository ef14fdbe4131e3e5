"""A loopback Hugging Face Hub for tests: dataset repos with commits, served over real HTTP.

``HubServer(storage_dir)`` is a :class:`http_server.FileServer` (same request records, latency,
bandwidth and fault injection, see that module) that answers the part of the Hub API that
``huggingface_hub`` (HfApi, HfFileSystem, hf_hub_download) and ``datasets`` use to resolve and
stream a dataset repo:

* ``GET /api/datasets/{repo}`` and ``/api/datasets/{repo}/revision/{rev}``: repo info (``sha`` is the
  commit the revision points to, ``siblings`` its files);
* ``GET /api/datasets/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: the tree listing;
* ``POST /api/datasets/{repo}/paths-info/{rev}`` (form: ``paths``, ``expand``);
* ``GET|HEAD /datasets/{repo}/resolve/{rev}/{path}``: the file, with Range, ``ETag`` (the git blob id,
  or the LFS sha256 for LFS files), ``X-Repo-Commit``, ``Content-Length``. Files never carry a xet
  hash, so ``huggingface_hub`` always downloads over plain HTTP.

Rate limits, as the Hub's (huggingface.co/docs/hub/rate-limits): ``hub.set_rate_limit(resolvers=60, api=None,
window_s=10)`` counts the requests of each class (``resolvers``: every ``/resolve/`` URL; ``api``: ``/api/``) per
client (its token when it sends one, else its IP address) over fixed windows of ``window_s`` seconds; every
answer of a limited class says ``RateLimit: "resolvers";r=<left>;t=<seconds to the reset>`` and
``RateLimit-Policy: "fixed window";"resolvers";q=<quota>;w=<window>`` (IETF draft 9: what huggingface_hub >= 1.2
parses), and a request past the quota is answered 429 with them and ``Retry-After: t`` (it is not counted).
``hub.allowed(kind)`` gives the times of the requests a class let through; ``hub.rate_limited`` counts the 429s;
``hub.spend(kind, client)`` spends what a client's window has left, as another job on the same token would.

The CDN, as the Hub's: with ``hub.redirect_lfs = True`` a ``resolve`` of an LFS file answers 302 with the
``Location`` of a signed URL on the CDN (``/cdn/<sha256>?Expires=<unix time>&Signature=<hmac>``, valid for
``hub.cdn_ttl_s`` seconds, ``X-Linked-Size`` / ``X-Linked-Etag`` as the Hub sends them), as huggingface.co redirects
to cdn-lfs.hf.co or cas-bridge.xethub.hf.co. The CDN serves the blob with Range while the signature holds and
answers 403 once it expired (or was tampered with); its requests are not ``resolve`` requests: no rate limit
counts them.

Errors are the Hub's: 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` /
``EntryNotFound``; a private repo without a valid token is 401 ``RepoNotFound``; an
``Authorization`` header with an unknown token is 401 "Invalid credentials in Authorization header".
Revisions are branch names or full commit shas; anything else (``refs/convert/parquet`` included:
no repo here has a parquet conversion) is ``RevisionNotFound``.

    hub = HubServer(tmp_path / "hub").start()
    hub.create_repo("org/data")
    sha1 = hub.commit("org/data", directory=local_dir)        # the branch's tree = that directory
    sha2 = hub.commit("org/data", files={"extra.parquet": path}, message="more data")
    hub.requests / hub.stats() / hub.set_faults(...)           # as FileServer

:func:`hub_env` gives the environment variables a process needs to talk to it (and only to it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import math
import os
import shutil
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from http_server import FileServer, RequestRecord, _Handler

# Files stored as LFS objects on the Hub (the others are plain git blobs), as ``.gitattributes`` of a new
# dataset repo says.
_LFS_SUFFIXES = (".parquet", ".arrow", ".gz", ".zst", ".tar", ".zip", ".bin")
_REPO_ACTIONS = ("revision", "tree", "paths-info", "resolve", "refs", "commits")
_BASE_DATE = 1_767_225_600           # 2026-01-01T00:00:00Z: commit dates are deterministic


@dataclass(frozen=True)
class Blob:
    path: str             # where the content lies in the server's blob store
    size: int
    oid: str              # git blob sha1
    sha256: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


@dataclass
class Commit:
    sha: str
    title: str
    date: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)     # name -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def commit_of(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)


class HubServer(FileServer):
    """The Hub's dataset API on 127.0.0.1 (a context manager, like FileServer)."""

    def __init__(self, storage_dir: str | os.PathLike, host: str = "127.0.0.1"):
        os.makedirs(storage_dir, exist_ok=True)
        super().__init__(storage_dir, host)
        self.repos: dict[str, Repo] = {}
        self.tokens: set[str] = set()          # tokens that may read private repos
        self._repo_lock = threading.Lock()
        self._commits_made = 0
        self.redirect_lfs = False               # resolve of an LFS file: 302 to a signed CDN URL
        self.cdn_ttl_s = 3600.0                 # how long a signed CDN URL stays valid
        self._cdn_secret = os.urandom(16)
        self.rate_limits: dict[str, tuple[int, float]] = {}     # class -> (quota, window seconds)
        self.rate_limited = 0                                   # 429 answers given
        self._windows: dict[tuple[str, str, int], int] = {}     # (class, client, window number) -> requests
        self._allowed: dict[str, list[float]] = {}              # class -> times of the requests let through
        self._origin = time.time()

    # -- rate limits -----------------------------------------------------------------------
    def set_rate_limit(self, resolvers: int | None = None, api: int | None = None, window_s: float = 10.0) -> None:
        """Limit ``resolve`` (and API) requests per client to a quota per fixed window (None: unlimited); the
        windows start now. Counts start afresh."""
        with self._lock:
            self.rate_limits = {k: (q, float(window_s)) for k, q in (("resolvers", resolvers), ("api", api))
                                if q is not None}
            self._windows.clear()
            self._allowed.clear()
            self.rate_limited = 0
            self._origin = time.time()

    def window_left(self, kind: str = "resolvers") -> float:
        """Seconds to the end of the current window of ``kind``."""
        with self._lock:
            window = self.rate_limits[kind][1]
            now = time.time() - self._origin
            return (int(now // window) + 1) * window - now

    def allowed(self, kind: str = "resolvers") -> list[float]:
        """The times (``time.monotonic``) of the requests of ``kind`` let through since the limit was set."""
        with self._lock:
            return list(self._allowed.get(kind, ()))

    def spend(self, kind: str, client: str, count: int | None = None) -> None:
        """Spend ``count`` of ``client``'s quota of ``kind`` in the current window (None: all it has left), as
        another job on the same token (or IP) would; not counted in :meth:`allowed`."""
        self.take(kind, client, count, record=False)

    def take(self, kind: str, client: str, count: int | None = 1,
             record: bool = True) -> tuple[bool, dict[str, str]]:
        """Count ``count`` requests of ``kind`` by ``client`` (None: all its window has left): whether they were
        let through, and the headers of the answer."""
        with self._lock:
            limit = self.rate_limits.get(kind)
            if limit is None:
                return True, {}
            quota, window = limit
            now = time.time() - self._origin
            number = int(now // window)
            reset = max(1, math.ceil((number + 1) * window - now))
            used = self._windows.get((kind, client, number), 0)
            if count is None:
                count = quota - used
            ok = used + count <= quota
            if ok:
                used = self._windows[(kind, client, number)] = used + count
                if record:
                    self._allowed.setdefault(kind, []).extend([time.monotonic()] * count)
            else:
                self.rate_limited += 1
            headers = {"RateLimit": f'"{kind}";r={max(0, quota - used)};t={reset}',
                       "RateLimit-Policy": f'"fixed window";"{kind}";q={quota};w={int(window)}'}
            if not ok:
                headers["Retry-After"] = str(reset)
            return ok, headers

    def _handler_class(self) -> type:
        return _HubHandler

    # -- repos -----------------------------------------------------------------------------
    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        with self._repo_lock:
            repo = self.repos.setdefault(repo_id, Repo(repo_id))
            repo.private = private
            return repo

    def commit(self, repo_id: str, directory: str | os.PathLike | None = None,
               files: dict[str, str | os.PathLike | bytes] | None = None, delete: tuple[str, ...] = (),
               message: str = "update", branch: str = "main") -> str:
        """A new commit on ``branch`` (a new branch starts from main): its tree is the parent's, or all of ``directory``'s files when given,
        then ``files`` (repo path -> local path or bytes) added and ``delete`` removed. Returns its sha."""
        repo = self.repos.get(repo_id) or self.create_repo(repo_id)
        with self._repo_lock:
            parent = repo.commit_of(branch) or repo.commit_of("main")    # a new branch starts from main
            tree = dict(parent.files) if parent is not None and directory is None else {}
            if directory is not None:
                root = os.fspath(directory)
                for base, _, names in os.walk(root):
                    for name in names:
                        full = os.path.join(base, name)
                        tree[os.path.relpath(full, root).replace(os.sep, "/")] = self._store(full)
            for path, content in (files or {}).items():
                tree[path] = self._store(content)
            for path in delete:
                tree.pop(path, None)
            self._commits_made += 1
            ident = json.dumps([parent.sha if parent else None, message, self._commits_made,
                                sorted((p, b.oid) for p, b in tree.items())])
            sha = hashlib.sha1(ident.encode()).hexdigest()
            date = _iso(_BASE_DATE + 60 * self._commits_made)
            repo.commits[sha] = Commit(sha, message, date, tree)
            repo.branches[branch] = sha
            return sha

    def _store(self, content: str | os.PathLike | bytes) -> Blob:
        data = content if isinstance(content, bytes) else open(content, "rb").read()
        sha256 = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.root, "blobs", sha256)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = isinstance(content, (str, os.PathLike)) and os.fspath(content).endswith(_LFS_SUFFIXES)
        return Blob(path, len(data), oid, sha256, lfs)

    def cdn_url(self, blob: Blob) -> str:
        """A signed CDN URL of ``blob``, valid for ``cdn_ttl_s`` seconds from now."""
        expires = int(time.time() + self.cdn_ttl_s)
        return f"{self.base_url}/cdn/{blob.sha256}?Expires={expires}&Signature={self._signature(blob.sha256, expires)}"

    def _signature(self, sha256: str, expires: int) -> str:
        return hmac.new(self._cdn_secret, f"{sha256}:{expires}".encode(), hashlib.sha256).hexdigest()

    def cdn_requests(self) -> list[RequestRecord]:
        return [r for r in list(self.requests) if r.path.startswith("/cdn/")]

    def head(self, repo_id: str, branch: str = "main") -> str:
        return self.repos[repo_id].branches[branch]

    def data_requests(self) -> list[RequestRecord]:
        """The requests for file contents (``resolve``), as opposed to API calls."""
        return [r for r in list(self.requests) if "/resolve/" in r.path]

    def remove_blob_store(self) -> None:
        shutil.rmtree(os.path.join(self.root, "blobs"), ignore_errors=True)


def _iso(seconds: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def hub_env(hub: HubServer, home: str | os.PathLike, token: str | None = None) -> dict[str, str]:
    """Environment for a process that streams from ``hub``: its endpoint, online, caches under ``home``,
    no xet, no token but ``token`` (none from the user's environment or a saved login)."""
    home = os.fspath(home)
    env = {
        "HF_ENDPOINT": hub.base_url, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
        "HF_HOME": home, "HF_DATASETS_CACHE": os.path.join(home, "datasets"),
        "HF_HUB_CACHE": os.path.join(home, "hub"), "HF_XET_CACHE": os.path.join(home, "xet"),
        "HF_TOKEN_PATH": os.path.join(home, "token"), "HF_STORED_TOKENS_PATH": os.path.join(home, "stored_tokens"),
        "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1" if token is None else "0",
        "HF_TOKEN": token or "",
    }
    return env


@contextlib.contextmanager
def use_hub(hub: HubServer, home: str | os.PathLike, token: str | None = None) -> Iterator[dict[str, str]]:
    """Point this process and its children at ``hub`` for the duration: the :func:`hub_env` variables in
    ``os.environ`` (subprocesses: CLI, torchrun) and in the constants ``huggingface_hub`` and ``datasets``
    read from it at import time; cached Hub filesystems (bound to an endpoint) are dropped before and
    after. Yields the environment."""
    import datasets.config as dc
    import huggingface_hub.constants as hc
    from huggingface_hub import HfFileSystem

    from resumable_stream.io import ranged

    env = hub_env(hub, home, token)
    patches = [
        (hc, "ENDPOINT", hub.base_url),
        (hc, "HUGGINGFACE_CO_URL_TEMPLATE", hub.base_url + "/{repo_id}/resolve/{revision}/{filename}"),
        (hc, "HF_HUB_OFFLINE", False), (hc, "HF_HUB_DISABLE_XET", True),
        (hc, "HF_HUB_DISABLE_IMPLICIT_TOKEN", token is None),
        (hc, "HF_HUB_CACHE", env["HF_HUB_CACHE"]), (hc, "HF_TOKEN_PATH", env["HF_TOKEN_PATH"]),
        (hc, "HF_STORED_TOKENS_PATH", env["HF_STORED_TOKENS_PATH"]),
        (dc, "HF_ENDPOINT", hub.base_url),
        (dc, "HUB_DATASETS_URL", hub.base_url + "/datasets/{repo_id}/resolve/{revision}/{path}"),
        (dc, "HF_HUB_OFFLINE", False), (dc, "HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"]),
    ]

    def forget_filesystems() -> None:
        HfFileSystem.clear_instance_cache()
        ranged._FILESYSTEMS.clear()

    with pytest.MonkeyPatch.context() as mp:
        for key in ("HF_OIDC_RESOURCE", "HUGGING_FACE_HUB_TOKEN"):
            mp.delenv(key, raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        for module, name, value in patches:
            if hasattr(module, name):
                mp.setattr(module, name, value)
        forget_filesystems()
        try:
            yield env
        finally:
            forget_filesystems()


class _HubHandler(_Handler):
    server_version = "rs-test-hub/1"
    _limit_headers: dict[str, str] = {}

    def _serve(self, head: bool) -> None:
        self._limit_headers = {}
        super()._serve(head)

    def end_headers(self) -> None:
        for key, value in self._limit_headers.items():     # every answer of a rate-limited class says where it is
            self.send_header(key, value)
        super().end_headers()

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self._body = self.rfile.read(n) if n > 0 else b""
        self._serve(head=False)

    # -- routing ---------------------------------------------------------------------------
    def _answer(self, rec: RequestRecord, head: bool, kind: str | None, stall_s: float) -> None:
        hub: HubServer = self.server.owner
        split = urllib.parse.urlsplit(self.path)
        segments = [urllib.parse.unquote(s) for s in split.path.split("/")[1:]]
        query = urllib.parse.parse_qs(split.query)
        if segments[:1] == ["cdn"] and len(segments) == 2:
            return self._cdn(rec, segments[1], query, head, kind, stall_s)
        if segments[:2] == ["api", "datasets"] and len(segments) > 2:
            api, rest = True, segments[2:]
        elif segments[:1] == ["datasets"] and len(segments) > 1:
            api, rest = False, segments[1:]
        else:
            return self._error(rec, 404, None, "Not Found")
        repo_id, rest = self._split_repo(hub, rest)
        token = self._token()
        rec.client = token or self.client_address[0]
        ok, self._limit_headers = hub.take("api" if api else "resolvers", rec.client)
        if not ok:
            rec.fault = "rate_limit"
            return self._error(rec, 429, None, "You have been rate-limited; you can retry this action later")
        if token is not None and token not in hub.tokens:
            return self._error(rec, 401, None, "Invalid credentials in Authorization header")
        repo = hub.repos.get(repo_id)
        if repo is None or (repo.private and token is None):
            status = 401 if repo is not None else 404
            return self._error(rec, status, "RepoNotFound", "Repository not found")
        action = rest[0] if rest else ""
        if api and action == "":
            return self._repo_info(rec, repo, "main")
        if len(rest) < 2 or action not in ("revision", "tree", "paths-info", "resolve") or \
                (action == "resolve") == api:
            return self._error(rec, 404, None, "Not Found")
        commit = repo.commit_of(rest[1])
        if commit is None:
            return self._error(rec, 404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
        path = "/".join(rest[2:]).strip("/")
        if action == "revision":
            return self._repo_info(rec, repo, rest[1])
        if action == "tree":
            return self._tree(rec, commit, path, _flag(query, "recursive"), _flag(query, "expand"))
        if action == "paths-info":
            form = urllib.parse.parse_qs(getattr(self, "_body", b"").decode(), keep_blank_values=True)
            return self._paths_info(rec, commit, form.get("paths", []), _flag(form, "expand"))
        return self._resolve(rec, commit, path, head, kind, stall_s)

    @staticmethod
    def _split_repo(hub: HubServer, rest: list[str]) -> tuple[str, list[str]]:
        """``org/name`` (or a bare ``name``) off the front of the path segments."""
        if len(rest) >= 2 and (f"{rest[0]}/{rest[1]}" in hub.repos or rest[1] not in _REPO_ACTIONS):
            return f"{rest[0]}/{rest[1]}", rest[2:]
        return rest[0], rest[1:]

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization")
        if not auth:
            return None
        return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else auth

    # -- answers ---------------------------------------------------------------------------
    def _error(self, rec: RequestRecord, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
            rec.error_code = code
        self._json(rec, {"error": message}, status, headers)

    def _json(self, rec: RequestRecord, obj: Any, status: int = 200, headers: dict[str, str] | None = None,
              kind: str | None = None, stall_s: float = 0.0) -> None:
        body = json.dumps(obj).encode()
        head = self.command == "HEAD"
        self._send_content(rec, io.BytesIO(body), len(body), head, kind, stall_s, headers or {}, status=status,
                           content_type="application/json")

    def _repo_info(self, rec: RequestRecord, repo: Repo, revision: str) -> None:
        commit = repo.commit_of(revision)
        if commit is None:
            return self._error(rec, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        self._json(rec, {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id, "author": author,
            "sha": commit.sha, "lastModified": commit.date, "createdAt": _iso(_BASE_DATE), "private": repo.private,
            "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
        })

    @staticmethod
    def _entry(commit: Commit, path: str, expand: bool) -> dict[str, Any]:
        blob = commit.files.get(path)
        if blob is not None:
            out: dict[str, Any] = {"type": "file", "oid": blob.oid, "size": blob.size, "path": path}
            if blob.lfs:
                out["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": 134}
        else:
            below = sorted(p for p in commit.files if p.startswith(path + "/"))
            tree_oid = hashlib.sha1("\n".join(commit.files[p].oid for p in below).encode()).hexdigest()
            out = {"type": "directory", "oid": tree_oid, "size": 0, "path": path}
        if expand:
            out["lastCommit"] = {"id": commit.sha, "title": commit.title, "date": commit.date}
        return out

    @staticmethod
    def _dirs(commit: Commit) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in commit.files for i in range(1, p.count("/") + 1)}

    def _tree(self, rec: RequestRecord, commit: Commit, path: str, recursive: bool, expand: bool) -> None:
        dirs = self._dirs(commit)
        if path and path not in dirs:
            return self._error(rec, 404, "EntryNotFound", f"{path} does not exist on this revision")
        prefix = path + "/" if path else ""
        names = sorted(p for p in (*commit.files, *dirs) if p.startswith(prefix))
        if not recursive:
            names = [p for p in names if "/" not in p[len(prefix):]]
        self._json(rec, [self._entry(commit, p, expand) for p in names])

    def _paths_info(self, rec: RequestRecord, commit: Commit, paths: list[str], expand: bool) -> None:
        dirs = self._dirs(commit)
        wanted = [p.strip("/") for p in paths]
        self._json(rec, [self._entry(commit, p, expand) for p in wanted if p in commit.files or p in dirs])

    def _resolve(self, rec: RequestRecord, commit: Commit, path: str, head: bool, kind: str | None,
                 stall_s: float) -> None:
        blob = commit.files.get(path)
        if blob is None:
            return self._error(rec, 404, "EntryNotFound", f"{path} does not exist on this revision")
        headers = {"ETag": f'"{blob.etag}"', "X-Repo-Commit": commit.sha}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)})
            hub: HubServer = self.server.owner
            if hub.redirect_lfs:
                headers["Location"] = hub.cdn_url(blob)
                return self._reply_empty(rec, 302, headers)
        with open(blob.path, "rb") as f:
            self._send_content(rec, f, blob.size, head, kind, stall_s, headers)


    def _cdn(self, rec: RequestRecord, sha256: str, query: dict[str, list[str]], head: bool, kind: str | None,
             stall_s: float) -> None:
        """The CDN: a blob by its sha256, while the URL's signature holds (else 403, as an expired signed URL)."""
        hub: HubServer = self.server.owner
        rec.client = self._token() or self.client_address[0]      # a token sent to the CDN would show here
        try:
            expires = int(query.get("Expires", ["0"])[0])
        except ValueError:
            expires = 0
        signed = hmac.compare_digest(query.get("Signature", [""])[0], hub._signature(sha256, expires))
        if not signed or time.time() > expires:
            return self._reply_empty(rec, 403)
        path = os.path.join(hub.root, "blobs", sha256)
        if not os.path.isfile(path):
            return self._reply_empty(rec, 404)
        with open(path, "rb") as f:
            self._send_content(rec, f, os.path.getsize(path), head, kind, stall_s, {"ETag": f'"{sha256}"'})


def _flag(query: dict[str, list[str]], key: str) -> bool:
    return any(v.lower() in ("1", "true") for v in query.get(key, []))
