"""Peak RSS of this process, correct in a child process (benchmarks/peers.py and its profile).

``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (``_common.peak_rss_mib``) is kept by Linux across
``execve``: in a process started by ``subprocess`` it is at least the RSS its parent had when it forked
(a child of a 500 MiB parent reports ~513 MiB before it allocated anything). ``VmHWM`` of
``/proc/self/status`` belongs to the process's own address space (new at ``execve``), and writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS, so the peak after a point can be measured.
"""

from __future__ import annotations

import gc

import _common


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """The high-water RSS of this address space (since the last :func:`reset_peak`), MiB."""
    kib = _status_kib("VmHWM")
    return kib / 1024 if kib is not None else _common.peak_rss_mib()


def reset_peak() -> bool:
    """Reset the high-water RSS to the current RSS (Linux >= 4.0); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def baseline_mib() -> float:
    """The RSS now, after a collection, with the peak reset to it: the base of "peak above imports"."""
    gc.collect()
    reset_peak()
    return _common.current_rss_mib()
