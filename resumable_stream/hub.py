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
