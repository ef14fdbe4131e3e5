"""The job's request budget (``data.max_requests_per_s``), and what a store's rate-limit answer makes us do.

The job's rate per store is split over its consumers, each process pacing its share with a one-token bucket that
starts empty; a rate-limit answer pauses the process's requests to that store until its reset. The limits and
guarantees: docs/scale.md#rate-limits-requests-per-epoch-and-the-hubs-tiers. Nothing of it is saved.
"""

from __future__ import annotations

import email.utils
import logging
import os
import random
import re
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..observe.metrics import record_budget_wait, record_rate_limited

log = logging.getLogger(__name__)

# Resolver requests per window of each Hub plan (huggingface.co/docs/hub/rate-limits, September 2025).
HUB_WINDOW_S = 300
HUB_TIERS = {"hub-anonymous": 3_000, "hub-free": 5_000, "hub-pro": 12_000, "hub-team": 20_000,
             "hub-enterprise": 50_000, "hub-enterprise-plus": 100_000}
S3_PREFIX_RATE = 5_500          # GET / HEAD per second per partitioned prefix
# The share of a store's limit a job plans to use: the rest is for the requests no budget paces (datasets'
# resolution, a user's other tools) and the one request per consumer a bucket may send at once.
HEADROOM = 0.9

_SLOWDOWN_FIRST_S = 0.1         # an S3 SlowDown's pause: 0.1 s, doubled per SlowDown in a row ...
_SLOWDOWN_MAX_S = 20.0          # ... up to this
_MIN_FACTOR = 1 / 1024          # a process's pace after SlowDowns: at least this share of its rate ...
_RECOVERY_S = 5.0               # ... doubling back every this many seconds without one, up to the whole share
_RESET_JITTER_S = 0.5           # a pause ends up to this much later, at random: the server's clock is not ours
_READ_SHARE_WEIGHT = 0.05       # the weight of the last read in the share of reads that make a paced request
_MIN_PACED_READS = 0.01         # ... taken as at least this (reads at 100 x the requests' pace, at most)

_RATELIMIT = re.compile(r'"(?P<kind>[^"]*)"\s*;\s*r\s*=\s*(?P<r>\d+)\s*;\s*t\s*=\s*(?P<t>\d+)')
_POLICY = re.compile(r"q\s*=\s*(?P<q>\d+).*?w\s*=\s*(?P<w>\d+)")


def hub_tier_rate(tier: str) -> float:
    """Requests per second a Hub tier allows a job to plan with (HEADROOM of its quota)."""
    return HUB_TIERS[tier] * HEADROOM / HUB_WINDOW_S


def store_of(path: str) -> str | None:
    """The store a remote path is read from, as the budget counts it: ``hf`` (every Hub file: the limit is
    the token's), ``s3://bucket``, ``http://host:port``; None for a local path."""
    if "://" not in path or path.startswith("file://"):
        return None
    protocol, rest = path.split("://", 1)
    if protocol == "hf":
        return "hf"
    head = rest.split("/", 1)[0]
    if protocol in ("http", "https"):
        return f"http://{head}"
    return f"{protocol}://{head}"


def _on_huggingface_co() -> bool:
    """Whether hf:// paths are read from huggingface.co (HF_ENDPOINT unset or pointing there): the Hub's tiers
    are its limits; a mirror or a private endpoint has its own."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    host = urllib.parse.urlsplit(str(getattr(constants, "ENDPOINT", "") or "https://huggingface.co")).hostname or ""
    return host in ("huggingface.co", "hf.co") or host.endswith((".huggingface.co", ".hf.co"))


def _hub_token_present() -> bool:
    try:
        from huggingface_hub import get_token
    except ImportError:
        return False
    try:
        return bool(get_token())
    except Exception:   # noqa: BLE001 - an unreadable token file: requests go out without one
        return False


@dataclass(frozen=True)
class RequestBudget:
    """``data.max_requests_per_s`` and ``data.rate_limit_wait_s`` of one source (picklable: it travels with the
    source's retry policy to DataLoader workers, where it registers again)."""

    setting: float | str | None = None
    max_wait_s: float = 600.0

    def job_rate(self, store: str) -> float | None:
        """Requests per second the whole job may send to ``store``; None: unlimited."""
        s = self.setting
        if s == "unlimited":
            return None
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            return float(s)
        if store == "hf":
            if s in HUB_TIERS:
                return hub_tier_rate(s)
            if not _on_huggingface_co():
                return None                              # a mirror: set data.max_requests_per_s for its limit
            return hub_tier_rate("hub-free" if _hub_token_present() else "hub-anonymous")
        if store.startswith(("s3://", "s3a://")):
            return S3_PREFIX_RATE * HEADROOM
        return None

    def describe(self, store: str) -> str:
        rate = self.job_rate(store)
        what = "unlimited" if rate is None else f"{rate:.4g} requests/s for the job"
        return f"data.max_requests_per_s: {self.setting if self.setting is not None else 'null'} ({what})"


@dataclass(frozen=True)
class RateLimit:
    """A store's answer that we ask too often: when to ask again (None: it did not say), and what it said."""

    reset_s: float | None
    answer: str
    slowdown: bool = False       # S3's SlowDown: no reset named, slow down instead


class _Bucket:
    """One store's pace in this process (see the module docstring)."""

    def __init__(self, share: float | None):
        self.share = share                               # requests per second this process may send; None: any
        self.next_at = time.monotonic() + (1.0 / share if share else 0.0)   # empty at the start: no burst
        self.paused_until = 0.0
        self.factor = 1.0                                # < 1 after SlowDowns
        self.slowdowns = 0                               # in a row
        self.slowed_at = 0.0                             # when the factor was last set
        self.paced_reads = 1.0                           # the share of reads that made a paced request (a Hub
                                                         # file's reads after the first go to its CDN URL), recent

    def pace_factor(self, now: float) -> float:
        """The share of the pace a process slowed by SlowDowns keeps now (doubling back every _RECOVERY_S)."""
        if self.factor < 1.0:
            self.factor = min(1.0, self.factor * 2.0 ** ((now - self.slowed_at) / _RECOVERY_S))
            self.slowed_at = now
        return self.factor


@dataclass(eq=False)
class _Process:
    """This process's buckets, the budgets its sources registered and its share of the job."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    budgets: set[RequestBudget] = field(default_factory=set)
    consumers: int = 1
    alone: int = 0
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    def share(self, store: str) -> float | None:
        rates = [r for r in (b.job_rate(store) for b in self.budgets) if r is not None]
        if not rates:                                    # no budget, or all unlimited
            return None
        consumers = 1 if self.alone else self.consumers
        return min(rates) / consumers

    def bucket(self, store: str) -> _Bucket:
        b = self.buckets.get(store)
        if b is None:
            b = self.buckets[store] = _Bucket(self.share(store))
        return b

    def rebalance(self) -> None:
        for store, b in self.buckets.items():
            b.share = self.share(store)


_state = _Process()
_rng = random.Random()
_WAITS = threading.local()


def _after_fork() -> None:
    """A forked DataLoader worker keeps the registered budgets and the consumers, and starts its buckets empty (its
    parent's lock may have been held by another thread at the fork)."""
    global _state
    _state = _Process(budgets=set(_state.budgets), consumers=_state.consumers)


os.register_at_fork(after_in_child=_after_fork)


def register(budget: RequestBudget) -> None:
    """A source of this process reads under ``budget`` (its retry policy registers it, here and in every
    worker it is handed to). A store read under several takes the lowest rate and the longest wait."""
    p = _state
    with p.lock:
        if budget not in p.budgets:
            p.budgets.add(budget)
            p.rebalance()


def set_consumers(consumers: int) -> None:
    """The job has ``consumers`` processes reading (ranks x max(1, DataLoader workers)), each with 1 / consumers
    of the job's rate."""
    p = _state
    with p.lock:
        p.consumers = max(1, int(consumers))
        p.rebalance()


@contextmanager
def opening_alone() -> Iterator[None]:
    """While rank 0 opens the dataset for the whole job (the other ranks wait for its index), it may use the job's
    whole rate."""
    p = _state
    with p.lock:
        p.alone += 1
        p.rebalance()
    try:
        yield
    finally:
        with p.lock:
            p.alone -= 1
            p.rebalance()


def process_rate(path: str) -> float | None:
    """Reads per second this process may make of ``path``'s store now (its paced rate over the share of reads that
    make a paced request: Hub reads mostly go to a CDN URL); None: unlimited (or local)."""
    store = store_of(path)
    if store is None:
        return None
    p = _state
    with p.lock:
        b = p.bucket(store)
        if b.share is None:
            return None
        return b.share * b.pace_factor(time.monotonic()) / max(b.paced_reads, _MIN_PACED_READS)


def paced_requests() -> int:
    """Paced requests this thread waited its turn for so far (see :func:`read_done`)."""
    return getattr(_WAITS, "paced", 0)


def read_done(path: str, paced: bool) -> None:
    """A read of ``path`` was answered; whether it made a paced request (tracks the share of reads that do)."""
    store = store_of(path)
    if store is None:
        return
    p = _state
    with p.lock:
        b = p.buckets.get(store)
        if b is not None:
            b.paced_reads += _READ_SHARE_WEIGHT * (float(paced) - b.paced_reads)


def max_wait_s(path: str) -> float:
    """The longest one request to ``path``'s store waits out rate-limit answers (data.rate_limit_wait_s)."""
    p = _state
    with p.lock:
        waits = [b.max_wait_s for b in p.budgets]
    return max(waits) if waits else RequestBudget().max_wait_s


def describe(path: str) -> str:
    """The budget ``path``'s store is read under, in words (for errors)."""
    store = store_of(path) or "local"
    p = _state
    with p.lock:
        budgets = sorted(p.budgets, key=repr)
        consumers = 1 if p.alone else p.consumers
    if not budgets:
        return "no request budget"
    said = "; ".join(b.describe(store) for b in budgets)
    return f"{said}, shared by {consumers} consumer(s)"


def acquire(path: str, paced: bool = True) -> None:
    """Wait until this process may send one request to ``path``'s store: its pace (unless not ``paced``) and any
    rate-limit pause; the waits are counted and noted for :func:`waited_since`."""
    store = store_of(path)
    if store is None:
        return
    p = _state
    if paced:
        _WAITS.paced = paced_requests() + 1
    waited_pace = paused = 0.0
    while True:
        with p.lock:
            b = p.bucket(store)
            now = time.monotonic()
            if b.paused_until > now:
                pause = b.paused_until - now
            else:
                pause = 0.0
                at = now
                if b.share and paced:
                    at = max(now, b.next_at)
                    b.next_at = at + 1.0 / (b.share * b.pace_factor(now))
        if pause > 0:
            time.sleep(pause)
            paused += pause
            continue
        if at > now:
            time.sleep(at - now)
            waited_pace += at - now
        break
    if waited_pace or paused:
        record_budget_wait(waited_pace, paused)
        _note_wait(waited_pace + paused)


def answered(path: str) -> None:
    """A request to ``path``'s store was answered: the next SlowDown's backoff starts short again."""
    store = store_of(path)
    if store is None:
        return
    p = _state
    with p.lock:
        b = p.buckets.get(store)
        if b is not None and b.slowdowns:
            b.slowdowns = 0


def limited(path: str, limit: RateLimit) -> float:
    """``path``'s store answered ``limit``: pause this process's requests to it until the reset it names (a
    SlowDown: an exponential backoff, and half the pace). Returns the pause from now, in seconds."""
    store = store_of(path)
    if store is None:
        return 0.0
    p = _state
    with p.lock:
        b = p.bucket(store)
        now = time.monotonic()
        if limit.reset_s is not None:
            wait = limit.reset_s + _RESET_JITTER_S * _rng.random()
        else:
            wait = min(_SLOWDOWN_FIRST_S * 2.0 ** b.slowdowns, _SLOWDOWN_MAX_S) * (1.0 + 0.25 * _rng.random())
            b.slowdowns += 1
        if limit.slowdown:
            b.factor = max(_MIN_FACTOR, b.pace_factor(now) / 2)
            b.slowed_at = now
        fresh = b.paused_until <= now            # not paused yet: say so once per pause, not once per request
        b.paused_until = max(b.paused_until, now + wait)
        pause = b.paused_until - now
    record_rate_limited()
    if fresh:
        log.warning("%s: the store answered %s; this process pauses its requests to %s for %.2f s (a rate limit: "
                    "no retry is spent)", path, limit.answer, store, pause)
    return pause


def _note_wait(seconds: float) -> None:
    waits = getattr(_WAITS, "log", None)
    if waits is None:
        waits = _WAITS.log = deque(maxlen=256)
    waits.append((time.monotonic(), seconds))


def waited_since(started: float) -> float:
    """Seconds this thread waited in :func:`acquire` since ``started`` (monotonic): time a step spent waiting for
    its turn, which its retry budget (data.retry_budget_s) does not count."""
    total = 0.0
    for end, seconds in getattr(_WAITS, "log", ()):
        if end > started:
            total += min(seconds, end - started)
    return total


# ---------------------------------------------------------------------------------------------- answers
def ratelimit_headers(headers) -> tuple[int, int, int | None, int | None] | None:
    """``(remaining, reset_s, quota, window_s)`` from ``RateLimit`` / ``RateLimit-Policy`` headers (IETF draft 9,
    as the Hub sends them and huggingface_hub >= 1.2 reads them); None without a readable ``RateLimit``."""
    if headers is None:
        return None
    value = policy = None
    for key in headers.keys():
        low = str(key).lower()
        if low == "ratelimit":
            value = headers[key]
        elif low == "ratelimit-policy":
            policy = headers[key]
    m = _RATELIMIT.search(str(value or ""))
    if m is None:
        return None
    q = w = None
    pm = _POLICY.search(str(policy or ""))
    if pm is not None:
        q, w = int(pm.group("q")), int(pm.group("w"))
    return int(m.group("r")), int(m.group("t")), q, w


def retry_after_s(headers) -> float | None:
    """Seconds a ``Retry-After`` header (delay-seconds or an HTTP date) asks to wait; None: none / unreadable."""
    value = headers.get("Retry-After") if headers is not None and hasattr(headers, "get") else None
    if not value:
        return None
    value = str(value).strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_chain(e: BaseException) -> list[BaseException]:
    """``e`` and its causes (or contexts), at most 16, each once."""
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 16 and all(cur is not x for x in out):
        out.append(cur)
        cur = cur.__cause__ if cur.__cause__ is not None else (None if cur.__suppress_context__ else cur.__context__)
    return out


def rate_limit_of(e: BaseException) -> RateLimit | None:
    """The rate-limit answer ``e`` carries (an HTTP 429 from the Hub, aiohttp or urllib, with the reset its
    ``RateLimit`` / ``Retry-After`` headers name; an S3 503 ``SlowDown``), None when it is anything else."""
    for x in error_chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict):                      # botocore's ClientError (s3fs)
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded") or status == 429:
                return RateLimit(None, f"HTTP {status} {code}", slowdown=True)
            continue
        status = getattr(x, "status", None)
        if not isinstance(status, int):
            status = getattr(response, "status_code", None)
        if not isinstance(status, int):
            status = getattr(x, "code", None) if hasattr(x, "headers") else None   # urllib's HTTPError
        if not isinstance(status, int):
            continue
        headers = getattr(x, "headers", None)
        if headers is None or not hasattr(headers, "keys"):
            headers = getattr(response, "headers", None)
        limits = ratelimit_headers(headers)
        if status == 429 or (status == 503 and limits is not None and limits[0] == 0):
            reset: float | None = None
            if limits is not None and limits[0] == 0:
                reset = float(limits[1])
            after = retry_after_s(headers)
            if after is not None:
                reset = after if reset is None else max(reset, after)
            said = f"HTTP {status}"
            if limits is not None:
                said += f" (RateLimit: {limits[0]} left, reset in {limits[1]} s" + (
                    f"; policy {limits[2]} per {limits[3]} s)" if limits[2] is not None else ")")
            elif after is not None:
                said += f" (Retry-After: {after:g} s)"
            return RateLimit(reset, said)
        return None
    return None
