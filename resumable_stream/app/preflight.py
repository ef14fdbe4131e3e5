"""The checks of a training command that need no model and no network, run before anything heavy is imported: a
bad data config is refused in well under a second. Local data folders, ``data_files`` patterns and splits (as
``datasets`` looks for them; remote paths are left to the resolution), ``data.resume_state_path`` and
``train.resume_from_checkpoint``. What needs the stream is checked when it opens, before the model is built."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

from ..config.stream_config import MixtureConfig, StreamConfig, file_builders
from ..errors import ConfigError, SidecarError, SourceError, shown
from ..io.net import flat_files, is_remote


def _matches(pattern: str) -> bool:
    return os.path.exists(pattern) or bool(glob.glob(pattern, recursive=True))


def _looks_local(path: str) -> bool:
    """A path that cannot be a Hub dataset id (org/name): it starts with / . ~ or has more than one /."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or path.endswith("/")


def check_local_data(cfg: StreamConfig, key: str = "data") -> None:
    """ConfigError / SourceError (named ``{key}.<data key>``) for local data that is not there (module doc)."""
    path = cfg.dataset_name_or_path
    if cfg.backend == "local":
        if not os.path.isdir(os.path.expanduser(path)):
            raise SourceError(f"{key}.dataset_name_or_path: got {shown(path)}; no such directory (backend 'local' "
                              "reads a directory written by save_to_disk)")
        return
    if is_remote(path):
        return
    if path in file_builders():
        base = ""                            # datasets looks for the patterns from the working directory
    elif os.path.isdir(os.path.expanduser(path)):
        base = os.path.expanduser(path)      # ... or inside the dataset folder
        if cfg.data_dir is not None and not os.path.isdir(os.path.join(base, cfg.data_dir)):
            raise SourceError(f"{key}.data_dir: got {shown(cfg.data_dir)}; no such folder in {shown(path)}")
    elif _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise SourceError(f"{key}.dataset_name_or_path: got {shown(path)}; no such file or directory (a local "
                          "dataset folder, relative to the yaml's folder or the working directory; a Hub dataset id "
                          "is org/name)")
    else:
        return                               # a Hub id: resolved over the network
    if cfg.data_files is None:
        return                               # datasets infers the splits from the folder's files
    splits = cfg.data_files if isinstance(cfg.data_files, dict) else {"train": cfg.data_files}
    if cfg.split not in splits:              # the words of sources/resolve.py, which finds the same
        raise ConfigError(f"{key}.split: got {shown(cfg.split)}; this dataset has the splits: "
                          f"{', '.join(map(str, splits))}")
    for pattern in flat_files(splits[cfg.split]):
        if is_remote(pattern):
            continue
        local = pattern[len("file://"):] if pattern.startswith("file://") else pattern
        full = os.path.join(base, local) if base else local
        if not (_matches(full) or _matches(os.path.expanduser(full))):
            raise SourceError(f"{key}.data_files {shown(cfg.data_files)}: {shown(pattern)} matches no file for "
                              f"split {shown(cfg.split)}" + (f" (looked for in {shown(base)})" if base else ""))


def check_resume_state(path: str | None, key: str = "data.resume_state_path") -> None:
    """The saved stream state a run continues from: there, and readable up to its manifest (the rank files and
    the fingerprint are checked against the stream when it loads them)."""
    if not path:
        return
    from ..state import checkpoint

    try:
        if os.path.isfile(path):
            checkpoint.read_state_file(path)
        else:
            checkpoint.read_manifest(checkpoint.find_state_dir(path))
    except SidecarError as e:
        raise SidecarError(f"{key}: {e}") from None
    except OSError as e:
        raise SidecarError(f"{key}: {shown(path)} cannot be read ({e.strerror or e})") from None


def check_stream(stream: StreamConfig | MixtureConfig | None, key: str = "data") -> None:
    if stream is None:
        return
    if isinstance(stream, MixtureConfig):
        for i, source in enumerate(stream.sources):
            check_local_data(source, f"{key}.sources[{i}]")
    else:
        check_local_data(stream, key)
    check_resume_state(stream.resume_state_path, f"{key}.resume_state_path")


def check_checkpoint(train: dict[str, Any]) -> None:
    explicit = train.get("resume_from_checkpoint")
    if isinstance(explicit, str) and explicit:
        from ..state.output_dir import check_complete

        check_complete(explicit)


def check_training_data(config_path: str, overrides: Sequence[str] = ()) -> None:
    """``resumable-stream train``'s checks that need no model and no network (module doc), from the yaml's data
    section and ``train.resume_from_checkpoint``; every data key is validated as the full validation does."""
    from ..config.trainer import data_sections_from_yaml

    stream, eval_stream, train = data_sections_from_yaml(config_path, overrides)
    check_stream(stream)
    check_stream(eval_stream, "data.eval")
    check_checkpoint(train)
