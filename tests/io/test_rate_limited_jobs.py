"""Many-rank jobs against rate-limited stores (issue 51): 8 ranks x 2 DataLoader workers (torchrun, gloo, 24
processes on loopback) read one shuffled epoch of 16 parquet files x 32 row groups from a loopback Hub that lets
each client through 60 resolver requests per fixed 2 s window (answering 429 with ``RateLimit`` headers past it),
and from a loopback S3 that answers 503 SlowDown past 60 GET / HEAD in any 2 s. The job plans
``data.max_requests_per_s: 18``, shared by its 16 consumers: at most 18 x 2 + 16 = 52 requests in any 2 s.

What must hold: no rank fails; every partition yields exactly the samples (keys and ids) that an unlimited read
of local copies of the files yields, in its order; the stores saw the job's requests at >= 0.8x the rate the
budget allows; the budget's waits (and, when another client spends the job's quota, the 429s and the waits for
their resets) are in the ranks' data-path figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hub_server import HubServer, hub_env
from repo_paths import REPO_ROOT
from training_helpers import free_port

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import shard_row_key
from resumable_stream.testing import write_parquet_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = os.path.join(REPO_ROOT, "tests", "_support", "rate_limited_job.py")
RANKS, WORKERS = 8, 2
PARTITIONS = RANKS * WORKERS
FILES, GROUPS, GROUP_ROWS = 16, 32, 40
ROWS = FILES * GROUPS * GROUP_ROWS
# requests per second for the whole job: a store lets 60 through per 2 s; the job sends at most BUDGET x 2 s + one
# request per consumer (16) in any 2 s: 52 (io/budget.py); the margin to 60 is for requests sent apart that arrive
# together (a budget of 20 left 4, and a loaded run saw 2-4 SlowDowns)
BUDGET = 18.0
ORDER = {"shuffle": True, "shuffle_seed": 11, "buffer_size": 160, "num_partitions": PARTITIONS}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl_data")
    return sorted(write_parquet_dataset(str(d / "data"), rows=ROWS, files=FILES, row_group_size=GROUP_ROWS))


@pytest.fixture(scope="module")
def reference(files) -> dict[int, tuple[list[str], list[int]]]:
    """Each partition's epoch (sample keys, ids), read from local copies of the files in this process: no
    network, no limit."""
    stream = ResumableStream(StreamConfig(dataset_name_or_path="parquet", data_files=files, **ORDER))
    stream.set_epoch(0)
    out = {}
    for p in range(PARTITIONS):
        samples = list(stream.iter_partition(p))
        out[p] = ([shard_row_key(s, w) for s, w in samples], [s["id"] for s, _ in samples])
    assert sorted(i for _, ids in out.values() for i in ids) == list(range(ROWS))
    return out


class Job:
    """One torchrun job of RANKS ranks reading ``data``, started at once; ``ranks()`` waits for it."""

    def __init__(self, tmp_path, data: dict, env: dict):
        self.out = tmp_path / "ranks"
        self.out.mkdir()
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"data": data, "workers": WORKERS, "batch": 32, "out": str(self.out)}))
        full = {**os.environ, **env, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH")] if p)}
        self.stderr_path = tmp_path / "job.err"
        with open(tmp_path / "job.out", "wb") as out, open(self.stderr_path, "wb") as err:   # files: never a full pipe
            self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                          str(RANKS), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                                          JOB, str(spec)], env=full, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def ranks(self) -> list[dict]:
        try:
            rc = self.proc.wait(timeout=540)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        stderr = self.stderr_path.read_text(errors="replace")
        assert rc == 0, stderr[-6000:]          # a failed step fails its rank, and the job
        return [json.loads((self.out / f"rank-{r}.json").read_text()) for r in range(RANKS)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


def run_job(tmp_path, data: dict, env: dict) -> list[dict]:
    job = Job(tmp_path, data, env)
    try:
        return job.ranks()
    finally:
        job.stop()


def check_rows(ranks: list[dict], reference) -> None:
    """Every partition's batches, in the order its rank was handed them, hold exactly its reference samples."""
    got: dict[int, tuple[list[str], list[int]]] = {p: ([], []) for p in range(PARTITIONS)}
    for r in ranks:
        for b in r["batches"]:
            got[b["partition"]][0].extend(b["keys"])
            got[b["partition"]][1].extend(b["ids"])
    for p in range(PARTITIONS):
        assert got[p] == reference[p], f"partition {p}: {len(got[p][0])} samples, {len(reference[p][0])} expected"


def summed(ranks: list[dict], name: str) -> float:
    return sum(r["figures"][name] for r in ranks)


def steady_rate(times: list[float], ranks: list[dict], paused: tuple[float, float] | None = None) -> tuple[float, float]:
    """The requests the store let through per second while every rank was reading (from the last rank's first batch
    to the first rank's end: the job's start, DataLoader workers and their clients starting on 2 shared cores, and
    its tail are no question of the budget), less ``paused`` (another client's spent windows): (rate, seconds)."""
    lo = max(r["batches"][0]["at"] for r in ranks)
    hi = min(r["ended"] for r in ranks)
    n = sum(1 for t in times if lo <= t <= hi)
    seconds = hi - lo
    if paused is not None:
        seconds -= max(0.0, min(hi, paused[1]) - max(lo, paused[0]))
    return n / seconds, hi - lo


def test_eight_ranks_of_two_workers_read_the_rate_limited_hub_exactly_within_its_limit(tmp_path, files, s3_job,
                                                                                        reference):
    """A Hub that allows 60 resolver requests per 2 s per client (all ranks are one IP here, as one token is
    one client on the Hub), a job that plans 18 a second. Midway another client on the same IP spends two
    windows' quota (as a second job on the same token would): the ranks meet 429s, wait for the resets the
    answers name, and go on, no step lost. (``s3_job``: the S3 test's job reads meanwhile, on a store of its own.)"""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(os.path.dirname(files[0]), repo / "data")
    with HubServer(tmp_path / "store") as hub:
        hub.commit("org/data", directory=repo)
        hub.set_rate_limit(resolvers=60, window_s=2)
        stolen: list[float] = []

        def thief():          # once a third of the epoch was read: spend two whole windows of the job's quota
            while len(hub.allowed()) < FILES * GROUPS // 3:
                if hub._httpd is None:
                    return
                time.sleep(0.05)
            time.sleep(hub.window_left())
            t0 = time.monotonic()
            hub.spend("resolvers", "127.0.0.1")
            time.sleep(hub.window_left() + 0.01)
            hub.spend("resolvers", "127.0.0.1")
            stolen.extend([t0, time.monotonic() + hub.window_left()])

        watcher = threading.Thread(target=thief, daemon=True)
        watcher.start()
        data = {"dataset_name_or_path": "org/data", "data_files": "data/*.parquet", "max_requests_per_s": BUDGET,
                **ORDER}
        ranks = run_job(tmp_path, data, hub_env(hub, tmp_path / "home"))
        watcher.join(timeout=10)
        check_rows(ranks, reference)
        reads = [r for r in hub.requests if "/resolve/" in r.path and r.range]
        assert len(reads) > 0
        allowed = hub.allowed("resolvers")
        stolen_s = stolen[1] - stolen[0]
        rate, steady_s = steady_rate(allowed, ranks, (stolen[0], stolen[1]))
        ratio = rate / BUDGET
        limited = [r.at for r in hub.requests if r.status == 429]
        span = allowed[-1] - allowed[0]
        print(f"\nhub: {len(allowed)} resolver requests let through ({hub.rate_limited} answered 429) for "
              f"{FILES * GROUPS} row groups and {FILES} files in {span:.1f} s ({(len(allowed) / BUDGET + stolen_s) / span:.2f}x "
              f"of the budget's bound over the whole job), {stolen_s:.1f} s of it spent by another client; "
              f"{rate:.1f} requests/s while all ranks read ({steady_s:.1f} s): {ratio:.2f}x of the budget; budget waits "
              f"{summed(ranks, 'budget_wait_s'):.1f} s, rate-limited {summed(ranks, 'rate_limited'):.0f}, their "
              f"waits {summed(ranks, 'rate_limit_wait_s'):.1f} s, coalesced {summed(ranks, 'coalesced_row_groups'):.0f}")
    assert ratio >= 0.8
    # a request per row group and footer at most, + datasets' resolution, + the next epoch's first window each
    # partition fetches for the digest of its saved state's next sample (the pace bounds that prefetch to ~2)
    assert len(allowed) <= FILES * GROUPS + FILES + 8 + 3 * PARTITIONS
    assert hub.rate_limited > 0 and summed(ranks, "rate_limited") > 0 and summed(ranks, "rate_limit_wait_s") > 0
    assert all(stolen[0] <= at <= stolen[1] for at in limited)       # 429s only where another client took the quota
    assert summed(ranks, "budget_waits") > 0 and summed(ranks, "budget_wait_s") > 0
    assert summed(ranks, "retries") == 0                      # a rate limit spends no retry


@pytest.fixture(scope="module")
def s3_job(tmp_path_factory, files):
    """The S3 test's job, started with the module's first test: it reads while the Hub test's job reads (each
    rate-bound, mostly waiting on its own budget; apart, the two would leave the cores idle for ~30 s each). The
    stores are apart: neither job's requests reach the other's store, and each test measures its own store."""
    from s3_server import S3Server

    tmp_path = tmp_path_factory.mktemp("s3_job")
    with S3Server() as srv:
        s3 = srv.admin()
        s3.create_bucket(Bucket="data")
        for path in files:
            s3.upload_file(path, "data", f"ds/{os.path.basename(path)}")
        srv.limit_rate(per_s=30, window_s=2)
        data = {"dataset_name_or_path": "parquet", "data_files": "s3://data/ds/*.parquet",
                "storage_options": {"endpoint_url": srv.endpoint}, "max_requests_per_s": BUDGET,
                "retry_backoff_s": 0.1, **ORDER}
        job = Job(tmp_path, data, srv.env())
        try:
            yield srv, job
        finally:
            job.stop()


def test_eight_ranks_of_two_workers_read_a_slowing_s3_exactly_within_its_rate(s3_job, reference):
    """An S3 endpoint that takes 60 GET / HEAD in any 2 s and answers 503 SlowDown beyond; the job plans 18 a
    second. (Its DataLoader workers make their s3fs clients before their first turn: made inside the first request,
    the 16 workers' first requests of ~5 s reached the store together, 56-60 in 2 s.) The job runs beside the Hub
    test's (``s3_job``)."""
    srv, job = s3_job
    ranks = job.ranks()
    check_rows(ranks, reference)
    allowed = list(srv.allowed_at)
    rate, steady_s = steady_rate(allowed, ranks)
    ratio = rate / BUDGET
    span = allowed[-1] - allowed[0]
    print(f"\ns3: {len(allowed)} GET / HEAD let through ({srv.slowdowns} answered SlowDown) for "
          f"{FILES * GROUPS} row groups and {FILES} files in {span:.1f} s ({len(allowed) / BUDGET / span:.2f}x of "
          f"the budget's bound over the whole job); {rate:.1f} requests/s while all ranks read ({steady_s:.1f} s): "
          f"{ratio:.2f}x of the budget; budget waits {summed(ranks, 'budget_wait_s'):.1f} s, coalesced "
          f"{summed(ranks, 'coalesced_row_groups'):.0f}")
    assert ratio >= 0.8
    refused = [f"{at - allowed[0]:.2f} s: {method} {path}" for at, method, path in srv.refused[:5]]
    assert srv.slowdowns == 0 and summed(ranks, "rate_limited") == 0, refused     # inside the limit by design
    assert summed(ranks, "budget_waits") > 0
