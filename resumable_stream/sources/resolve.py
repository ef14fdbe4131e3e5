"""Which files a config means and what they are: resolution (``datasets``' builder, or none for explicit URLs and
local files of a registered format), file identities, and the dataset index built from a format's entries; all
under the one network policy (``io/net.py``).
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import formats as registry
from ..config.specs import DataSpec, SourceSpec
from ..errors import ConfigError, IncompleteFileError, SourceError
from ..io.hub import (
    commit_sha,
    file_identities,
    hub_answer,
    hub_repo_of,
    pin_commits,
    probe_answer,
)
from ..io.hub import listed_identities as hub_listed_identities
from ..io.net import (
    BUCKET_PROTOCOLS,
    GLOB_CHARS,
    RetryPolicy,
    error_chain,
    flat_files,
    is_remote,
    protocol_options,
    remote_answer,
)
from ..io.ranged import ObjectChanged, listed_identities
from ..runtime.threads import map_files
from .footer_cache import FooterCache
from .index import make_index
from .parquet_local import resolve_local_parquet

log = logging.getLogger(__name__)

# Raw file metadata read to build an index (parquet footers) is kept, and broadcast to the other ranks, up to
# this many bytes in all; beyond, each process reads the footers of the files it reads, as they come.
KEPT_FOOTERS_MAX_BYTES = 64 << 20
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")

def builder_args(data: DataSpec) -> tuple[str, object]:
    """Map ``dataset_name_or_path`` (+ ``data_files``) to load_dataset's (path, data_files)."""
    path, data_files = data.dataset_name_or_path, data.data_files
    if path.startswith("hf://") and registry.builder_for_path(path) is None:
        # LLaMA-Factory style "hf://org/name" or fsspec "hf://datasets/org/name": a hub id.
        path = path[len("hf://"):]
        path = path[len("datasets/"):] if path.startswith("datasets/") else path
    elif data_files is None and (os.path.isfile(path) or "://" in path):
        builder = registry.builder_for_path(path)
        if builder is None:
            raise ConfigError(
                f"data.dataset_name_or_path: {path!r} is a file whose type is not known; "
                f"allowed extensions: {', '.join(sorted(registry.extensions()))}"
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
        fs, fs_path = fsspec.core.url_to_fs(path, **protocol_options(retry.storage_options if retry else {}, path))
        if path.split("://", 1)[0] in BUCKET_PROTOCOLS:
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


def known_identities(files: list[str], retry: RetryPolicy | None) -> dict[str, dict]:
    """The identities of ``files`` the stores give in batches: Hub files (the listings this process holds, then a
    few paths-info requests, not one per file) and S3 objects (a listing per directory, no HEAD per object)."""
    options = retry.storage_options if retry is not None else {}
    known = hub_listed_identities(files, options) if any(f.startswith("hf://datasets/") for f in files) else {}
    hub_files = [f for f in files if f.startswith("hf://datasets/") and f not in known]
    if hub_files:
        label = f"data files {hub_files[0]!r} and {len(hub_files) - 1} more: reading their metadata"
        if retry is not None and retry.applies(hub_files[0]):
            known.update(retry.call(lambda: file_identities(hub_files), label, hub_files))
        else:
            known.update(file_identities(hub_files))
    known.update(listed_identities(files, options))
    return known


def where_to_look(spec: SourceSpec) -> tuple[str, Any, list[str], RetryPolicy]:
    """``builder_args``, the remote paths opening the data touches ([] when everything is local) and the retry
    policy over them: the first step of opening a source and of checking a saved index again, the same for both."""
    path, data_files = builder_args(spec.data)
    targets = [p for p in [path, *flat_files(data_files)] if is_remote(p)]
    if not targets and path not in registry.indexed_builders():     # parquet, ...: a format's name, never a hub id
        import datasets.config
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        if (_HUB_ID.match(path) is not None and path not in _PACKAGED_DATASETS_MODULES
                and not os.path.exists(path) and not datasets.config.HF_HUB_OFFLINE):
            targets = [path]
    return path, data_files, targets, RetryPolicy(spec.net, remote=bool(targets), data=spec.data)


def explicit_urls(data: DataSpec, path: str, data_files) -> list[str] | None:
    """The split's files when the config lists files of a registered format by plain http(s) URL (nothing to
    resolve; ``datasets`` would cost 3 requests per file); None otherwise."""
    if registry.format_for_builder(path) is None or data.name is not None or data.data_dir is not None or data_files is None:
        return None
    splits = data_files if isinstance(data_files, dict) else {"train": data_files}
    splits = {str(k): [v] if isinstance(v, str) else v for k, v in splits.items()}
    if not all(isinstance(v, list) and v and all(isinstance(f, str) and f.split("://", 1)[0] in ("http", "https")
                                                 and not GLOB_CHARS.search(f) for f in v)
               for v in splits.values()):
        return None
    if data.split not in splits:
        raise ConfigError(f"data.split: got {data.split!r}; this dataset has the splits: {', '.join(splits)}")
    return list(splits[data.split])


def where_of(data: DataSpec, targets: list[str]) -> str:
    """The config key naming the data, with the remote paths it means, for messages."""
    where = f"data.dataset_name_or_path {data.dataset_name_or_path!r}"
    if targets and targets != [data.dataset_name_or_path]:
        where += f" ({', '.join(targets[:3])}{f' and {len(targets) - 3} more' if len(targets) > 3 else ''})"
    return where


def _hub_not_found(e: BaseException) -> bool:
    """``datasets``' error for a missing (or private) repo or revision, raised without the Hub's answer:
    "Dataset 'x' doesn't exist on the Hub ...", and with datasets 4.0.0 (LLaMA-Factory 0.9.5's pin) also
    "Revision 'r' doesn't exist for dataset 'x' on the Hub." (later releases keep that one's cause)."""
    text = str(e)
    return "doesn't exist on the Hub" in text or ("doesn't exist for dataset" in text and "on the Hub" in text)


def resolve_files(data: DataSpec, path: str, data_files, targets: list[str],
                  retry: RetryPolicy) -> tuple[Any, list[str]]:
    """``datasets``' builder for the config and the resolved files of its split."""
    import datasets

    where = where_of(data, targets)
    # a copy: datasets adds to the dict it is given
    options = {"storage_options": copy.deepcopy(retry.storage_options)} if retry.remote else {}
    if data.revision is not None:
        options["revision"] = data.revision
    if data.data_dir is not None:
        options["data_dir"] = data.data_dir
    try:
        builder = retry.call(lambda: datasets.load_dataset_builder(path, data.name, data_files=data_files, **options),
                             f"{where}: resolving the dataset", targets)
    except (ConfigError, SourceError):
        raise
    except Exception as e:
        answer = hub_answer(error_chain(e), where, data.revision)      # the repo / revision / token, named
        repo = hub_repo_of(path) if targets else None
        if answer is None and repo is not None and _hub_not_found(e):
            answer = probe_answer(repo, data.revision, where)
        if answer is not None:
            raise SourceError(answer) from None
        answer = remote_answer(e)
        if answer is not None:      # the key naming the data: data_files when set
            key = (f"data.data_files {data.data_files!r}" if data.data_files is not None
                   else f"data.dataset_name_or_path {data.dataset_name_or_path!r}")
            raise SourceError(f"{key}: the object store refused ({answer})") from None
        if isinstance(e, FileNotFoundError):
            raise SourceError(f"data.dataset_name_or_path {data.dataset_name_or_path!r} / data.data_files "
                              f"{data.data_files!r}: {e}") from None
        raise SourceError(f"data.dataset_name_or_path {data.dataset_name_or_path!r}: cannot be loaded by datasets "
                          f"({type(e).__name__}: {e})") from None

    resolved = builder.config.data_files
    splits = [str(s) for s in (resolved if resolved else (builder.info.splits or {}))]
    if splits and data.split not in splits:
        raise ConfigError(f"data.split: got {data.split!r}; this dataset has the splits: {', '.join(splits)}")
    files = [str(f) for f in resolved[data.split]] if resolved else []
    if resolved and not files:
        why = _why_nothing_listed(flat_files(data_files), retry.storage_options)
        raise SourceError(f"data.data_files {data.data_files or data.dataset_name_or_path!r}: matches no file for "
                          f"split {data.split!r}" + (f" ({why})" if why else ""))
    # hf:// files on a branch: read the commit it points to now, the same for every rank and restart
    files = pin_commits(files, lambda repo, rev: retry.call(
        lambda: commit_sha(repo, rev), f"{where}: reading the commit of {repo}@{rev or 'main'}", targets))
    return builder, files


def _why_nothing_listed(patterns: list[str], storage_options: dict) -> str | None:
    """Why an object-store pattern lists nothing, when the store says so: globbing hides a missing bucket
    (s3fs lists it as empty), asking for the bucket itself does not. One request per bucket."""
    import fsspec

    buckets = {p.split("://", 1)[0] + "://" + p.split("://", 1)[1].split("/", 1)[0]
               for p in patterns if is_remote(p) and p.split("://", 1)[0] in BUCKET_PROTOCOLS}
    for bucket in sorted(buckets):
        try:
            fs, path = fsspec.core.url_to_fs(bucket, **protocol_options(storage_options, bucket))
            fs.ls(path, detail=False)
        except Exception as e:
            return f"{bucket}: {remote_answer(e) or f'{type(e).__name__}: {e}'}"
    return None


@dataclass
class Resolved:
    """A config's split, resolved: the files; the registered format that reads them (None: ``datasets``
    does); ``datasets``' builder when it resolved them (None: explicit URLs or local parquet); the format's
    reader, loaded once here for ``open_source``."""

    files: list[str]
    format: registry.SourceFormat | None
    builder: Any = None
    reader: Any = None

    @property
    def features(self) -> Any:
        return self.builder.info.features if self.builder is not None else None


def resolve_split(spec: SourceSpec, path: str, data_files, targets: list[str], retry: RetryPolicy) -> Resolved:
    """The files of ``spec``'s split (``path``, ``data_files``, ``targets``: :func:`where_to_look`'s): explicit
    http(s) URLs and local files of a registered format need no ``datasets``; it resolves the rest."""
    data = spec.data
    files = explicit_urls(data, path, data_files) if data.streaming else None
    if files is None and not targets:
        files = resolve_local_parquet(data, path, data_files, registry.indexed_builders(),
                                      spec.net.storage_options)
    if files is not None:
        fmt = registry.format_for_builder(path)
        reader = fmt.load() if fmt is not None else None
        if reader is not None and reader.reads_files(files):
            return Resolved(files, fmt, reader=reader)
    builder, files = resolve_files(data, path, data_files, targets, retry)
    fmt = registry.format_for_builder(builder.name) if data.streaming and files else None
    reader = fmt.load() if fmt is not None else None
    if reader is None or not (reader.indexable(builder) and reader.reads_files(files)):
        return Resolved(files, None, builder)
    return Resolved(files, fmt, builder, reader)


def index_entry(reader, path: str, retry: RetryPolicy | None, identity: dict, footers: dict[str, bytes],
                growing: bool) -> dict | None:
    """``reader``'s index entry of ``path``; ``growing``: None, logged, for a file not complete yet (listed again at
    the next refresh or resume)."""
    if not growing:
        return reader.index_file(path, retry, identity, footers)
    try:
        return reader.index_complete(path, retry, identity, footers)
    except (IncompleteFileError, ObjectChanged) as e:
        log.warning("data.growth: %s; the file is left out until it is complete (tried again at the next "
                    "refresh or resume)", e)
        return None


def build_index(fmt: registry.SourceFormat, spec: SourceSpec, files: list[str], features, retry: RetryPolicy | None,
                progress: Callable[[int], None] | None = None, footers: dict | None = None) -> dict:
    """The dataset index of resolved ``files`` read by ``fmt``; ``features``: the builder's (None: the reader's).
    ``footers``: filled with what the reader read that it may reuse; ``progress(len(files))`` after each file."""
    reader = fmt.load()
    known = known_identities(files, retry)
    read: dict[str, bytes] = {}
    growing = spec.growth.growing
    kept = FooterCache(spec.read.footer_dir) if spec.read.footer_dir else None

    def entry(f: str) -> dict | None:
        identity = known.get(f)
        if identity is None and not growing and kept is None:
            both = reader.index_unknown(f, retry, read)      # identity and entry in one request, where it can
            if both is not None:
                return both
        identity = identity or file_identity(f, retry)
        # a remote file's footer kept by the block cache under the identity it has now (a rewritten file has
        # another): not read again (the block cache keeps what was read, cache/cached_source.py)
        cached = kept.get(identity) if kept is not None else None
        if cached is not None:
            read[f] = cached
        return index_entry(reader, f, retry, identity, read, growing)

    early = None
    if features is None and files and not growing:
        early = reader.features_ahead(spec, files[0], retry)     # (JSON lines: datasets' inference, beside the pass)
    entries = map_files(entry, files, progress and (lambda: progress(len(files))),
                        cpu_bound=reader.index_reads_files)
    if early is not None:
        features = early.result()
    if growing:
        if files and not any(entries):
            raise SourceError(f"data.growth: none of the {len(files)} data file(s) is complete yet (the first: "
                              f"{files[0]!r}); start the job once one is")
        files = [f for f, e in zip(files, entries) if e is not None]
        entries = [e for e in entries if e is not None]
    if features is None:
        features = reader.infer_features(spec, entries[0], read.get(files[0]), retry)
    if footers is not None and sum(len(b) for b in read.values()) <= KEPT_FOOTERS_MAX_BYTES:
        footers.update((f, read[f]) for f in files if f in read)
    index = make_index(spec.data, fmt.builders[0] if fmt.builders else fmt.name, fmt.name, features, entries)
    return index
