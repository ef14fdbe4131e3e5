"""Hugging Face Hub revisions and reads: :func:`pin_commits` pins ``hf://`` paths on a branch to the commit it
points to now, so that every rank, worker and restart reads one commit; :func:`hub_commits` names it for the
fingerprint (docs/hub.md#revisions-what-a-resume-reads). Ranged reads of Hub files: :func:`get_range`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable

from . import budget as request_budget
from .net import protocol_options

_HF_DATASET = re.compile(r"^hf://datasets/(?P<repo>[^@/]+(?:/[^@/]+)?)(?:@(?P<rev>[^/]+))?(?P<rest>/.*)?$")
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


def _parts(path: str) -> tuple[str, str | None, str] | None:
    m = _HF_DATASET.match(path)
    if m is None:
        return None
    rev = urllib.parse.unquote(m.group("rev")) if m.group("rev") else None
    return m.group("repo"), rev, m.group("rest") or ""


def unpinned(path: str) -> str:
    """``path`` without the revision it names (``hf://datasets/{repo}@{rev}/x`` -> ``hf://datasets/{repo}/x``):
    the same file at any commit; other paths unchanged."""
    parts = _parts(path)
    return path if parts is None else f"hf://datasets/{parts[0]}{parts[2]}"


def hub_commits(files: list[str]) -> dict[str, str]:
    """``{repo: commit sha}`` of the ``hf://datasets/`` files that name a commit (no request)."""
    out: dict[str, str] = {}
    for f in files:
        parts = _parts(f)
        if parts is not None and parts[1] is not None and _COMMIT_SHA.match(parts[1]):
            out.setdefault(parts[0], parts[1])
    return out


def pin_commits(files: list[str], commit_of: Callable[[str, str | None], str]) -> list[str]:
    """``files`` with every ``hf://datasets/{repo}[@branch]/...`` path rewritten to ``@{commit sha}``;
    ``commit_of(repo, revision)`` asks the Hub (called once per repo and revision)."""
    seen: dict[tuple[str, str | None], str] = {}
    out = []
    for f in files:
        parts = _parts(f)
        if parts is None or (parts[1] is not None and _COMMIT_SHA.match(parts[1])):
            out.append(f)
            continue
        repo, rev, rest = parts
        if (repo, rev) not in seen:
            seen[(repo, rev)] = commit_of(repo, rev)
        out.append(f"hf://datasets/{repo}@{seen[(repo, rev)]}{rest}")
    return out


def commit_sha(repo: str, revision: str | None) -> str:
    """The commit ``revision`` (None: main) of dataset repo ``repo`` points to now (one Hub request)."""
    from huggingface_hub import HfApi

    return HfApi().dataset_info(repo, revision=revision).sha


def hub_answer(chain: list[BaseException], where: str, revision: str | None) -> str | None:
    """One line for a Hub HTTP error in an exception ``chain`` (None: no Hub answer in it): the key at
    fault (``where`` names the dataset key and value; ``data.revision`` when the revision is missing) and
    what the Hub answered."""
    try:
        from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
    except ImportError:
        return None
    for e in chain:
        response = getattr(e, "response", None)
        if not isinstance(e, HfHubHTTPError) or response is None:
            continue
        status = response.status_code
        code = response.headers.get("X-Error-Code") or ""
        message = response.headers.get("X-Error-Message") or ""
        answer = f"the Hub answered HTTP {status}" + (f" {code}" if code else "") + (f" ({message})" if message else "")
        if isinstance(e, RevisionNotFoundError) or code == "RevisionNotFound":
            key = f"data.revision {revision!r}" if revision is not None else where
            return f"{key}: no such revision in the repo; {answer}; allowed: a branch, tag or commit sha of the repo"
        if status == 401 and "credentials" in message.lower():
            return f"{where}: the Hub refused the token; {answer}; check HF_TOKEN (or `hf auth login`)"
        if status in (401, 403, 404) or code in ("RepoNotFound", "GatedRepo"):
            return (f"{where}: no such dataset repo, or it is private / gated and no token with access was sent; "
                    f"{answer}; set HF_TOKEN (or `hf auth login`) for a private repo")
        return f"{where}: {answer}"
    return None


def probe_answer(repo: str, revision: str | None, where: str) -> str | None:
    """:func:`hub_answer` for one repo-info request of ``repo`` (``datasets`` drops the Hub's answer from the
    error it raises for a missing or private repo); None when the repo answers or the Hub is unreachable."""
    try:
        commit_sha(repo, revision)
    except Exception as e:
        return hub_answer([e], where, revision)
    return None


def hub_repo_of(path: str) -> str | None:
    """The dataset repo an ``hf://datasets/...`` path or a hub id names (None for anything else)."""
    parts = _parts(path)
    if parts is not None:
        return parts[0]
    return path if re.match(r"^[\w.-]+/[\w.-]+$", path) else None


def get_range(path: str, start: int, end: int):
    """The answer (a ``requests``-like response) to a ranged GET of bytes ``[start, end)`` of an
    ``hf://datasets/{repo}@{rev}/{file}``: its ``resolve`` URL asked once per process (the requests the Hub's rate
    limit counts, paced), its signed CDN URL kept until shortly before it expires (no token goes there). One try:
    the caller's retry policy is the only retry layer; ``io.ranged.read_range`` checks the answer."""
    parts = _parts(path)
    if parts is None or not parts[2]:
        raise ValueError(f"not an hf://datasets/ file path: {path!r}")
    repo, rev, rest = parts
    ranged = {"Range": f"bytes={start}-{end - 1}"}
    response = _from_cdn(path, ranged)
    if response is not None:
        return response
    with _cdn.resolving(path):                 # one resolve of a file at a time: the others then take its URL
        response = _from_cdn(path, ranged)
        return response if response is not None else _resolved(path, repo, rev, rest, ranged)


def _from_cdn(path: str, ranged: dict[str, str]):
    """The answer of ``path``'s signed CDN URL, if the process holds one the CDN still takes; else None."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    target = _cdn.get(path)
    if target is None:
        return None
    response = get_session().request("GET", target, headers=ranged, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     follow_redirects=False)
    if response.status_code in _CDN_REFUSED or 300 <= response.status_code < 400:
        _cdn.forget(path)                      # expired, or no longer there: ask resolve again
        return None
    hf_raise_for_status(response)
    return response


def _resolved(path: str, repo: str, rev: str | None, rest: str, ranged: dict[str, str]):
    """The answer of ``path``'s resolve URL (following a redirect to the CDN, whose URL is kept)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    session, timeout = get_session(), constants.HF_HUB_DOWNLOAD_TIMEOUT
    url = hf_hub_url(repo, rest.lstrip("/"), repo_type="dataset", revision=rev)
    request_budget.acquire(path)               # a resolver request: the one the Hub's rate limit counts
    response = session.request("GET", url, headers={**build_hf_headers(), **ranged}, timeout=timeout,
                               follow_redirects=False)
    location = response.headers.get("Location") if 300 <= response.status_code < 400 else None
    if location is not None:
        target = urllib.parse.urljoin(url, location)
        split = urllib.parse.urlsplit(target)
        if "/resolve/" in split.path and _host(target) == _host(url):
            # the Hub itself (a renamed repo): followed as huggingface_hub follows it
            response = session.request("GET", target, headers={**build_hf_headers(), **ranged}, timeout=timeout,
                                       follow_redirects=True)
        elif split.scheme in ("http", "https"):
            # the CDN: a signed URL, its own authorization (no token goes there), kept for the next reads
            _cdn.remember(path, target)
            response = session.request("GET", target, headers=ranged, timeout=timeout, follow_redirects=False)
    hf_raise_for_status(response)
    return response


# the CDN's answers to a signed URL that expired or is not valid any more: resolve again
_CDN_REFUSED = frozenset({401, 403, 404, 410})
_CDN_DEFAULT_TTL_S = 600.0      # a signed URL whose expiry we cannot read is used this long
_CDN_MARGIN_S = 60.0            # a signed URL is not used in its last minute (or last quarter, when shorter)
_CDN_MAX_FILES = 65_536         # signed URLs kept per process, at most (the oldest go first)


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc.lower()


def signed_url_ttl(url: str) -> float:
    """Seconds a signed URL stays valid from now: CloudFront's ``Expires`` (unix time) or S3's ``X-Amz-Date`` +
    ``X-Amz-Expires``; _CDN_DEFAULT_TTL_S when it says neither."""
    import datetime

    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    now = time.time()
    try:
        if "Expires" in query:
            return float(query["Expires"][0]) - now
        if "X-Amz-Date" in query and "X-Amz-Expires" in query:
            signed = datetime.datetime.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(
                tzinfo=datetime.timezone.utc)
            return signed.timestamp() + float(query["X-Amz-Expires"][0]) - now
    except (ValueError, OverflowError):
        pass
    return _CDN_DEFAULT_TTL_S


class _SignedUrls:
    """This process's signed CDN URLs of Hub files, each until shortly before it expires (a forked DataLoader
    worker starts without its parent's: they would be valid, but its lock may be held)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._urls: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._resolving = [threading.Lock() for _ in range(64)]    # striped by path

    def resolving(self, path: str) -> threading.Lock:
        """The lock a thread resolving ``path`` holds (one of 64, by the path's hash)."""
        return self._resolving[hash(path) % len(self._resolving)]

    def get(self, path: str) -> str | None:
        with self._lock:
            entry = self._urls.get(path)
            if entry is None:
                return None
            if time.monotonic() >= entry[1]:
                del self._urls[path]
                return None
            return entry[0]

    def remember(self, path: str, url: str) -> None:
        ttl = signed_url_ttl(url)
        usable = ttl - min(_CDN_MARGIN_S, ttl / 4)
        if usable <= 0:
            return
        with self._lock:
            self._urls[path] = (url, time.monotonic() + usable)
            self._urls.move_to_end(path)
            while len(self._urls) > _CDN_MAX_FILES:
                self._urls.popitem(last=False)

    def forget(self, path: str) -> None:
        with self._lock:
            self._urls.pop(path, None)


_cdn = _SignedUrls()


def _after_fork() -> None:
    global _cdn
    _cdn = _SignedUrls()


os.register_at_fork(after_in_child=_after_fork)


def listed_identities(files: list[str], storage_options: dict) -> dict[str, dict]:
    """Identities of the ``hf://datasets/`` files among ``files`` that name a commit sha, from the folder
    listings HfFileSystem already holds (``datasets`` made them; a commit's tree never changes); {}: not listed."""
    pinned = {}         # file -> its name in HfFileSystem's listings
    for f in files:
        parts = _parts(f)
        if parts is not None and parts[1] is not None and _COMMIT_SHA.match(parts[1]) and "/" in parts[2].lstrip("/"):
            pinned[f] = f"datasets/{parts[0]}@{parts[1]}{parts[2]}"
    if not pinned:
        return {}
    import fsspec  # here: local data never imports it

    first = next(iter(pinned))
    try:
        fs, _ = fsspec.core.url_to_fs(first, **protocol_options(storage_options, first))
    except Exception:   # noqa: BLE001 - no filesystem: the paths-info request then says why
        return {}
    folders: dict[str, dict[str, dict]] = {}    # folder -> {name: entry}, each listing indexed once
    out: dict[str, dict] = {}
    for f, name in pinned.items():
        folder = name.rsplit("/", 1)[0]
        if folder not in folders:
            folders[folder] = {e.get("name"): e for e in fs.dircache.get(folder, ())}
        entry = folders[folder].get(name)
        if entry is None or entry.get("type") != "file" or not isinstance(entry.get("size"), int) \
                or not entry.get("blob_id"):
            continue
        out[f] = _identity(f, entry["size"], entry["blob_id"], entry.get("lfs"))
    return out


def file_identities(files: list[str]) -> dict[str, dict]:
    """Identities (size, git blob id, LFS sha256) of the ``hf://datasets/`` files among ``files``, as
    HfFileSystem.info gives them, asked in batches (one paths-info request per 100 files of a repo commit)
    rather than file by file."""
    from huggingface_hub import HfApi

    groups: dict[tuple[str, str | None], dict[str, str]] = {}
    for f in files:
        parts = _parts(f)
        if parts is not None and parts[2]:
            groups.setdefault((parts[0], parts[1]), {})[parts[2].lstrip("/")] = f
    out: dict[str, dict] = {}
    api = HfApi()
    for (repo, rev), by_path in groups.items():
        paths = list(by_path)
        for lo in range(0, len(paths), 100):
            for info in api.get_paths_info(repo, paths[lo:lo + 100], repo_type="dataset", revision=rev):
                if info.path not in by_path or not hasattr(info, "size"):
                    continue       # a folder
                out[by_path[info.path]] = _identity(by_path[info.path], info.size, info.blob_id, info.lfs)
    return out


def _identity(path: str, size: int, blob_id: str, lfs) -> dict:
    """A Hub file's identity: its size, git blob id and (an LFS file) content sha256."""
    ident = {"path": path, "size": size, "blob_id": blob_id}
    if lfs is not None and lfs.get("sha256"):
        ident["sha256"] = lfs["sha256"]
    return ident
