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


def rss_parts_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB now: a reader that maps its files (litdata mmaps its chunks)
    has their page-cache pages in its RSS, which the kernel can drop; anonymous memory it cannot."""
    anon, file = _status_kib("RssAnon"), _status_kib("RssFile")
    return (anon or 0) / 1024, (file or 0) / 1024


class Sampler:
    """Peaks of anonymous and file-backed RSS, sampled every ``interval_s`` on a daemon thread."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.interval_s = interval_s
        self.base_anon, self.base_file = rss_parts_mib()
        self.peak_anon, self.peak_file = self.base_anon, self.base_file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            anon, file = rss_parts_mib()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        anon, file = rss_parts_mib()
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
        return {"peak_anon_above_imports_mib": self.peak_anon - self.base_anon,
                "peak_file_above_imports_mib": self.peak_file - self.base_file}
