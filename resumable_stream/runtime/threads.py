"""CPU threads per process: the trainer gets its share of the cores, each DataLoader worker one thread.

torch's default (one intra-op thread per core in every process) oversubscribes the cores as soon as several
ranks, DataLoader workers or other jobs share them, and its OpenMP threads then spin waiting for each other.
A user's OMP_NUM_THREADS / MKL_NUM_THREADS is always left as it is (torchrun sets OMP_NUM_THREADS=1 for
several ranks per node unless it is set).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import WrongThreadError

USER_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def user_setting() -> str | None:
    """``NAME=value`` of the environment variable the user set, or None."""
    for name in USER_SETTINGS:
        if os.environ.get(name, "").strip():
            return f"{name}={os.environ[name]}"
    return None


def cores() -> int:
    """The cores this process may run on (a cpuset or taskset limits them below os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # not on Linux
        return os.cpu_count() or 1


def set_trainer_threads() -> str:
    """Set torch's intra-op threads of a training process (``LOCAL_WORLD_SIZE`` of them per node, from
    torchrun) unless the user chose; returns what was decided, for the startup summary."""
    import torch

    chosen = user_setting()
    if chosen is not None:
        return f"{torch.get_num_threads()} ({chosen})"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    torch.set_num_threads(max(1, cores() // max(1, local)))
    return f"{torch.get_num_threads()} ({cores()} cores / {local} local process{'es' if local > 1 else ''})"


def worker_threads(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: one intra-op thread per worker unless the user chose."""
    if user_setting() is None:
        import torch

        torch.set_num_threads(1)


def _local(item: Any) -> bool:
    """A local absolute path (or an index entry of one): its stat and reads wait on no network."""
    path = item.get("path") if isinstance(item, dict) else item
    return isinstance(path, str) and path.startswith("/")


def map_files(fn: Callable[[Any], Any], items: list, progress: Callable[[], None] | None = None,
              cpu_bound: bool = False) -> list:
    """``fn`` over ``items`` on up to 16 threads (network-bound), in order; ``progress()`` after each. Local files
    in turn on this thread (threads cost more than stats and footer reads); ``cpu_bound``: a thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    def one(x):
        r = fn(x)
        if progress is not None:
            progress()
        return r

    local = all(_local(x) for x in items)
    if len(items) <= 1 or (local and (not cpu_bound or cores() == 1)):
        return [one(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(cores() if local else 16, len(items))) as pool:
        return list(pool.map(one, items))


class OwnerThread:
    """The thread that iterates a stream or loader owns its readers' cursors ("One owner per cursor"): a call that
    moves them from another thread is refused, not left to race the reader."""

    def __init__(self) -> None:
        self.ident: int | None = None

    def claim(self) -> None:
        """The calling thread iterates from now on."""
        self.ident = threading.get_ident()

    def check(self, call: str, what: str) -> None:
        """WrongThreadError when ``call`` (on ``what``) comes from a thread other than the one iterating."""
        if self.ident is not None and self.ident != threading.get_ident():
            raise WrongThreadError(
                f"{call}: called from thread {threading.current_thread().name!r} while another thread (id "
                f"{self.ident}) iterates the {what}; one thread owns a stream's cursors: call it from the thread "
                "that iterates (between batches, e.g. in a Trainer callback), or before iterating starts")
