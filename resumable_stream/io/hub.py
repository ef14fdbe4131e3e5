"""Hugging Face Hub revisions: which commit of a dataset repo a job reads.

``datasets`` resolves a hub id to ``hf://datasets/{repo}@{commit sha}/...`` files; ``hf://`` paths a user
writes may name a branch (``@main``) or no revision at all. :func:`pin_commits` rewrites such paths to the
commit the branch points to now (one repo-info request per repo and job, made by whoever resolves the
dataset), so that every rank, worker and restart of the job reads the same commit even when the repo gets a
new one meanwhile, and :func:`hub_commits` names those commits for the stream fingerprint: a resume on
another commit is then a StreamMismatchError naming the repo and both commits, unless ``data.revision``
pins the one the run started with.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable

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
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(repo, revision=revision)
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
    ``hf://datasets/{repo}@{rev}/{file}``: one request to its ``resolve`` URL (HfFileSystem would first ask for
    the repo info and list the directory, in every process, and read up to 5 MB ahead). One try: every read
    of a Hub file runs under the data's retry policy (``sources/net.py``: ``data.retries``, backoff, the
    Retry-After of a 429, ``data.retry_budget_s``), which a second layer (huggingface_hub's ``http_backoff``:
    5 more tries of its own per try of ours) would multiply; :func:`resumable_stream.io.ranged.read_range` checks
    the answer."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    parts = _parts(path)
    if parts is None or not parts[2]:
        raise ValueError(f"not an hf://datasets/ file path: {path!r}")
    repo, rev, rest = parts
    url = hf_hub_url(repo, rest.lstrip("/"), repo_type="dataset", revision=rev)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
    response = get_session().request("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    hf_raise_for_status(response)
    return response


def listed_identities(files: list[str], storage_options: dict) -> dict[str, dict]:
    """Identities of the ``hf://datasets/`` files among ``files`` that name a commit sha, from the folder
    listings the process's HfFileSystem already holds: ``datasets`` lists a data folder when it resolves a
    pattern, and that listing carries each file's size, blob id and LFS sha256. A commit's tree never changes,
    so this is the answer a paths-info request would give, without asking. {} for files not listed (asked then)."""
    pinned = {}         # file -> its name in HfFileSystem's listings
    for f in files:
        parts = _parts(f)
        if parts is not None and parts[1] is not None and _COMMIT_SHA.match(parts[1]) and "/" in parts[2].lstrip("/"):
            pinned[f] = f"datasets/{parts[0]}@{parts[1]}{parts[2]}"
    if not pinned:
        return {}
    import fsspec  # here: local data never imports it

    from .net import protocol_options

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
        ident = {"path": f, "size": entry["size"], "blob_id": entry["blob_id"]}
        lfs = entry.get("lfs")
        if lfs is not None and lfs.get("sha256"):
            ident["sha256"] = lfs["sha256"]
        out[f] = ident
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
                ident = {"path": by_path[info.path], "size": info.size, "blob_id": info.blob_id}
                if info.lfs is not None and info.lfs.get("sha256"):
                    ident["sha256"] = info.lfs["sha256"]
                out[by_path[info.path]] = ident
    return out
