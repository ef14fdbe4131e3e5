"""Shared helpers for the benchmarks: a private HF cache, cached synthetic parquet data, RSS.

Import this module before anything that imports ``datasets``: it points ``HF_DATASETS_CACHE``
(and ``HF_HOME``) at a temporary directory that is removed at exit, so benchmark runs never
touch ``~/.cache``.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import shutil
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(REPO_ROOT, ".bench")

_HF_TMP = tempfile.mkdtemp(prefix="rs-bench-hf-")
atexit.register(shutil.rmtree, _HF_TMP, ignore_errors=True)
os.environ["HF_HOME"] = os.path.join(_HF_TMP, "home")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_HF_TMP, "datasets")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROW_GROUP_SIZE = 16384


def dataset_dir(data_dir: str, rows: int, files: int, row_group_size: int = ROW_GROUP_SIZE) -> str:
    """A directory of synthetic parquet files, generated once and reused (keyed by its parameters)."""
    name = f"parquet-{rows}r-{files}f-{row_group_size}rg"
    path = os.path.join(data_dir, name)
    marker = os.path.join(path, "COMPLETE")
    if os.path.exists(marker):
        return path
    from resumable_stream.testing import write_parquet_dataset

    os.makedirs(data_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=data_dir)
    t0 = time.perf_counter()
    print(f"  generating {rows:,} rows in {files} files (row groups of {row_group_size}) -> {path}",
          flush=True)
    write_parquet_dataset(tmp, rows=rows, files=files, row_group_size=row_group_size)
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        json.dump({"rows": rows, "files": files, "row_group_size": row_group_size}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    print(f"  generated in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def parquet_glob(path: str) -> str:
    return os.path.join(path, "*.parquet")


def parquet_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def quiet_logs() -> None:
    import logging

    logging.getLogger("datasets").setLevel(logging.ERROR)
    try:
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.utils.logging.disable_progress_bar()
    except Exception:
        pass
