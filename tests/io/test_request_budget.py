"""The job's request budget (``data.max_requests_per_s``, resumable_stream/io/budget.py) and what a store's rate-limit
answer does, against a loopback Hub that limits resolver requests per client and window as the Hub does
(tests/_support/hub_server.py: 429 with ``RateLimit`` / ``RateLimit-Policy`` / ``Retry-After``) and a loopback S3 that
answers 503 SlowDown past a request rate (tests/_support/s3_server.py). The many-rank jobs are in
test_rate_limited_jobs.py."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from http_server import FileServer
from hub_server import HubServer, use_hub

from resumable_stream import ConfigError, ResumableStream, SourceError, StreamConfig
from resumable_stream.config.stream_config import REQUEST_RATE_NAMES
from resumable_stream.io import budget
from resumable_stream.observe.metrics import figures, snapshot
from resumable_stream.sources import open_source
from resumable_stream.sources.prefetch import Prefetcher
from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.timeout(120)

REPO = "org/data"
FILES, ROWS, GROUP = 4, 1600, 100          # 16 row groups


@pytest.fixture(autouse=True)
def fresh_budget(monkeypatch):
    """Every test starts with this process's budgets, shares and buckets empty (they are process-wide)."""
    monkeypatch.setattr(budget, "_state", budget._Process())


@pytest.fixture
def hub(tmp_path):
    src = tmp_path / "repo"
    write_parquet_dataset(str(src / "data"), rows=ROWS, files=FILES, row_group_size=GROUP)
    with HubServer(tmp_path / "hub-store") as srv:
        srv.commit(REPO, directory=src, message="initial")
        with use_hub(srv, tmp_path / "hf-home"):
            yield srv


def hub_config(**kw) -> StreamConfig:
    base = dict(dataset_name_or_path=REPO, data_files="data/*.parquet", shuffle=True, shuffle_seed=3,
                buffer_size=200, retry_backoff_s=0.05)
    return StreamConfig(**{**base, **kw})


def _get(url: str, token: str | None = None):
    headers = {"Range": "bytes=0-9", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers


def _delta(before: dict) -> dict:
    now = snapshot()
    return {k: now[k] - before.get(k, 0) for k in now}


# ---------------------------------------------------------------------------- the loopback stores
def test_the_hub_limits_each_client_and_token_per_window_with_its_headers(hub):
    """Past its quota a client gets 429; huggingface_hub's own parser reads the answer's headers (remaining 0,
    the reset, the policy); a token has a quota of its own, and the next window lets the client in again."""
    from huggingface_hub.utils import parse_ratelimit_headers

    hub.tokens.add("tok")
    hub.set_rate_limit(resolvers=3, window_s=2)
    url = hub.base_url + f"/datasets/{REPO}/resolve/main/data/part-00000.parquet"
    answers = [_get(url) for _ in range(4)]
    assert [status for status, _ in answers] == [206, 206, 206, 429]
    first = parse_ratelimit_headers(answers[0][1])
    assert (first.resource_type, first.remaining, first.limit, first.window_seconds) == ("resolvers", 2, 3, 2)
    info = parse_ratelimit_headers(answers[3][1])
    assert info.remaining == 0 and 1 <= info.reset_in_seconds <= 2 and (info.limit, info.window_seconds) == (3, 2)
    assert answers[3][1]["Retry-After"] == str(info.reset_in_seconds)
    assert budget.ratelimit_headers(answers[3][1]) == (0, info.reset_in_seconds, 3, 2)      # ours reads the same
    assert [_get(url, token="tok")[0] for _ in range(4)] == [206, 206, 206, 429]          # the token's own quota
    assert _get(hub.base_url + f"/api/datasets/{REPO}")[0] < 400                           # the API is not limited
    time.sleep(info.reset_in_seconds + 0.1)
    assert _get(url)[0] == 206                                                             # a new window
    assert hub.rate_limited == 2 and len(hub.allowed("resolvers")) == 7


def test_s3_answers_slowdown_past_its_request_rate():
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config
    from botocore.exceptions import ClientError
    from s3_server import S3Server

    with S3Server() as srv:
        srv.admin().create_bucket(Bucket="data")
        srv.admin().put_object(Bucket="data", Key="x", Body=b"0123456789")
        srv.limit_rate(per_s=5)
        s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                          aws_access_key_id=srv.reader_key["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=srv.reader_key["AWS_SECRET_ACCESS_KEY"],
                          config=Config(retries={"total_max_attempts": 1}))
        answers = []
        for _ in range(8):
            try:
                s3.get_object(Bucket="data", Key="x", Range="bytes=0-3")
                answers.append("ok")
            except ClientError as e:
                answers.append(e.response["Error"]["Code"])
                limit = budget.rate_limit_of(e)
                assert limit is not None and limit.slowdown and limit.reset_s is None
        assert answers[:5] == ["ok"] * 5 and set(answers[5:]) == {"SlowDown"}
        assert srv.slowdowns == 3 and len(srv.allowed_at) == 5
        time.sleep(1.05)
        s3.get_object(Bucket="data", Key="x", Range="bytes=0-3")        # the next second lets it through


def test_rate_limit_answers_of_every_client_library_name_their_reset():
    try:
        import httpx2
    except ImportError:
        import httpx as httpx2
    import aiohttp
    from huggingface_hub.utils import hf_raise_for_status
    from multidict import CIMultiDict

    headers = {"RateLimit": '"resolvers";r=0;t=42', "RateLimit-Policy": '"fixed window";"resolvers";q=5000;w=300'}
    request = httpx2.Request("GET", "http://127.0.0.1:1/datasets/org/data/resolve/main/a.parquet")
    with pytest.raises(Exception) as hub_error:
        hf_raise_for_status(httpx2.Response(429, headers=headers, request=request))
    assert budget.rate_limit_of(hub_error.value).reset_s == 42.0
    http_error = aiohttp.ClientResponseError(None, (), status=429, headers=CIMultiDict({"Retry-After": "7"}))
    assert budget.rate_limit_of(http_error).reset_s == 7.0
    both = aiohttp.ClientResponseError(None, (), status=429, headers=CIMultiDict({**headers, "Retry-After": "50"}))
    assert budget.rate_limit_of(both).reset_s == 50.0                      # the later of the two
    assert budget.rate_limit_of(aiohttp.ClientResponseError(None, (), status=429)).reset_s is None
    assert budget.rate_limit_of(aiohttp.ClientResponseError(None, (), status=503)) is None     # a fault, not a limit
    assert budget.rate_limit_of(OSError("reset")) is None
    try:
        raise SourceError("wrapped") from hub_error.value
    except SourceError as e:
        assert budget.rate_limit_of(e).reset_s == 42.0                     # found down the chain
    # the header forms huggingface_hub parses, read alike
    from huggingface_hub.utils import parse_ratelimit_headers

    for value, policy in (('"api";r=0;t=55', '"fixed window";"api";q=500;w=300'),
                          ('"resolvers";r=12;t=3', None), ('"pages" ; r = 1 ; t = 9', '"x";q=1;w=60')):
        hdrs = {"ratelimit": value, **({"ratelimit-policy": policy} if policy else {})}
        theirs = parse_ratelimit_headers(hdrs)
        assert budget.ratelimit_headers(hdrs) == (theirs.remaining, theirs.reset_in_seconds, theirs.limit,
                                                  theirs.window_seconds)


# ---------------------------------------------------------------------------- shares, pauses, defaults
def test_each_process_paces_at_its_share_of_the_job_and_rebalances():
    budget.register(budget.RequestBudget(80.0))
    budget.set_consumers(4)                          # e.g. 2 ranks x 2 workers
    path = "hf://datasets/org/data@0000000000000000000000000000000000000000/x.parquet"
    assert budget.process_rate(path) == 20.0
    before = snapshot()
    t0 = time.monotonic()
    for _ in range(6):
        budget.acquire(path)
    took = time.monotonic() - t0
    assert 6 / 20.0 - 0.02 <= took < 6 / 20.0 + 1.0        # one request every 1 / 20 s: it starts empty (no burst)
    d = _delta(before)
    # the waits are what pacing added: at most the time taken (a loaded machine spends some of it elsewhere)
    assert d["budget_waits"] == 6 and 0.1e6 <= d["budget_wait_us"] <= took * 1e6 + 1e4
    budget.set_consumers(8)                          # another topology (an elastic restart): another share
    assert budget.process_rate(path) == 10.0
    with budget.opening_alone():                     # rank 0 opening while the others wait: the whole rate
        assert budget.process_rate(path) == 80.0
    assert budget.process_rate(path) == 10.0
    budget.register(budget.RequestBudget(40.0))      # a second source on the same store: the lower rate
    assert budget.process_rate(path) == 5.0
    assert budget.process_rate("/local/file.parquet") is None
    assert budget.process_rate("http://127.0.0.1:9/x") == 5.0            # a number: every store, each its own bucket


def test_a_rate_limit_answer_pauses_every_thread_of_the_process():
    budget.register(budget.RequestBudget("unlimited"))
    path = "s3://bucket/a.parquet"
    begun = time.monotonic()
    budget.acquire(path)                             # unlimited: no wait
    before = snapshot()
    limited_at = time.monotonic()
    pause = budget.limited(path, budget.RateLimit(0.5, "HTTP 429"))
    assert 0.5 <= pause <= 0.5 + budget._RESET_JITTER_S
    waited, ended = [], []

    def request():
        t0 = time.monotonic()
        budget.acquire(path)
        ended.append(time.monotonic())
        waited.append(ended[-1] - t0)

    threads = [threading.Thread(target=request) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ended) == 3 and min(ended) >= limited_at + pause - 0.005      # none went before the reset
    d = _delta(before)
    assert d["rate_limited"] == 1 and d["rate_limit_wait_us"] >= 0.9 * sum(waited) * 1e6 and d["budget_waits"] == 0
    assert budget.waited_since(begun) == 0.0         # this thread waited for nothing (the others did)
    budget.acquire(path)                             # the reset passed
    assert budget.process_rate(path) is None


def test_a_slowdown_halves_the_pace_and_time_brings_it_back(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock[0])
    budget.register(budget.RequestBudget(100.0))
    path = "s3://bucket/a.parquet"
    assert budget.process_rate(path) == 100.0
    first = budget.limited(path, budget.RateLimit(None, "HTTP 503 SlowDown", slowdown=True))
    second = budget.limited(path, budget.RateLimit(None, "HTTP 503 SlowDown", slowdown=True))
    assert budget.process_rate(path) == 25.0                           # halved twice
    assert 0.1 <= first <= 0.125 + 1e-6 and second >= 0.2             # backoff doubles, S3 names no reset
    clock[0] += budget._RECOVERY_S
    assert budget.process_rate(path) == pytest.approx(50.0)            # doubled back after 5 s without one
    clock[0] += 3 * budget._RECOVERY_S
    assert budget.process_rate(path) == 100.0                          # and no higher than the share


def test_default_rates_follow_the_hub_tier_the_token_and_the_store(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co")
    auto = budget.RequestBudget(None)
    monkeypatch.setattr(budget, "_hub_token_present", lambda: False)
    assert auto.job_rate("hf") == pytest.approx(3000 * 0.9 / 300)       # anonymous: 3,000 per 5 minutes per IP
    monkeypatch.setattr(budget, "_hub_token_present", lambda: True)
    assert auto.job_rate("hf") == pytest.approx(5000 * 0.9 / 300)       # a free token: 15 requests/s for the job
    assert auto.job_rate("s3://bucket") == pytest.approx(5500 * 0.9)
    assert auto.job_rate("http://host:80") is None
    for tier, quota in (("hub-pro", 12_000), ("hub-team", 20_000), ("hub-enterprise", 50_000),
                        ("hub-enterprise-plus", 100_000)):
        assert budget.RequestBudget(tier).job_rate("hf") == pytest.approx(quota * 0.9 / 300)
        assert budget.RequestBudget(tier).job_rate("s3://b") == pytest.approx(5500 * 0.9)   # S3 as by default
    assert budget.RequestBudget(12.5).job_rate("hf") == 12.5 == budget.RequestBudget(12.5).job_rate("http://h:1")
    assert budget.RequestBudget("unlimited").job_rate("hf") is None
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hf-mirror.example")
    assert auto.job_rate("hf") is None                                  # a mirror: its own limits
    assert set(REQUEST_RATE_NAMES) == {*budget.HUB_TIERS, "unlimited"}


@pytest.mark.parametrize("value", [0, -1, 0.0001, 2_000_000, float("nan"), float("inf"), "hub-gold", True, [5]])
def test_a_bad_request_rate_names_the_key(value):
    with pytest.raises(ConfigError, match=r"data\.max_requests_per_s: got .*allowed: null .*hub-free"):
        StreamConfig(dataset_name_or_path="parquet", data_files="x.parquet", max_requests_per_s=value)


@pytest.mark.parametrize("value", [-1, float("inf"), "5", 100_000])
def test_a_bad_rate_limit_wait_names_the_key(value):
    with pytest.raises(ConfigError, match=r"data\.rate_limit_wait_s: got .*allowed: a number of seconds from 0"):
        StreamConfig(dataset_name_or_path="parquet", data_files="x.parquet", rate_limit_wait_s=value)


def test_the_budget_travels_with_the_source_and_registers_in_a_new_process():
    import pickle

    from resumable_stream.io.net import RetryPolicy

    spec = StreamConfig(dataset_name_or_path="parquet", data_files="s3://b/x.parquet", max_requests_per_s=7.0,
                        rate_limit_wait_s=30).source_spec
    policy = RetryPolicy(spec.net, remote=True, data=spec.data)
    assert budget.process_rate("s3://b/x.parquet") == 7.0 and budget.max_wait_s("s3://b/x.parquet") == 30.0
    budget._state = budget._Process()                # what a spawned DataLoader worker starts with
    assert budget.process_rate("s3://b/x.parquet") is None
    pickle.loads(pickle.dumps(policy))               # the worker unpickles the source, and its policy
    assert budget.process_rate("s3://b/x.parquet") == 7.0


# ---------------------------------------------------------------------------- prefetch under a budget
def test_prefetch_runs_no_further_ahead_than_the_pace_serves():
    rate = [None]
    release = threading.Event()              # no fetch ends before the test says: nothing is measured meanwhile

    class Rows:
        def fetch(self, shard: int) -> pa.Table:
            release.wait(30)
            return pa.table({"x": [shard]})

        def rate(self):
            return rate[0]

    rows = Rows()
    prefetcher = Prefetcher(rows.fetch, cap=64, rate=rows.rate)
    prefetcher.hint(0, list(range(100)))
    assert prefetcher.depth_for(0) == 8                  # FIRST_DEPTH, unpaced
    rate[0] = 2.0                                        # 2 requests/s: ceil(2 x 0.1 s) + 1 keep the pace busy
    assert prefetcher.depth_for(0) == 2
    prefetcher._fetch_s = 1.5
    assert prefetcher.depth_for(0) == 4                  # ceil(2 x 1.5) + 1
    prefetcher.hint(1, list(range(100, 200)))            # two partitions in the process share it
    assert prefetcher.depth_for(0) == prefetcher.depth_for(1) == 2
    assert prefetcher.stats()["started"] == 8 + 2        # partition 0's before the pace was known, 1's after
    release.set()
    prefetcher.close()


# ---------------------------------------------------------------------------- coalescing
def _same_layout_site(tmp_path):
    """Two files of other rows with the same byte layout (tests/io/test_verified_bytes.py): a lying proxy that
    answers one with the other's bytes passes every header check."""
    rows = 4000

    def table(first: int) -> pa.Table:
        ids = list(range(first, first + rows))
        return pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {i:07d}" for i in ids]})

    d = tmp_path / "www"
    d.mkdir()
    for name, first in (("a.parquet", 0), ("b.parquet", 5_000_000)):
        pq.write_table(table(first), str(d / name), row_group_size=500, compression="none", use_dictionary=False)
    return d, rows


def test_paced_fetches_coalesce_adjacent_row_groups_and_still_verify_them(tmp_path):
    d, rows = _same_layout_site(tmp_path)
    with FileServer(d) as srv:
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url("a.parquet")], shuffle=False,
                           buffer_size=1000, max_requests_per_s=1000, retry_backoff_s=0.05)
        source = open_source(cfg.source_spec)
        srv.reset_stats()
        before = snapshot()
        stream = ResumableStream(cfg, source=source)
        stream.set_epoch(0)
        assert [r["id"] for r in stream] == list(range(rows))       # every row, in order, once
        gets = [r for r in srv.requests if r.range]
        coalesced = source.prefetch_stats()["coalesced"]
        assert coalesced > 0 and len(gets) + coalesced == 8         # 8 row groups in fewer requests
        assert _delta(before)["coalesced"] == coalesced
        assert any(int(r.range.split("-")[1]) - int(r.range.split("=")[1].split("-")[0]) > 2 * 40_000
                   for r in gets)                                   # a request spans several row groups
        source.close()
        # a proxy answering with another file's bytes: caught in a coalesced read too, not one row of it yielded
        source = open_source(cfg.source_spec)
        srv.ranges_from = {"a.parquet": "b.parquet"}
        yielded = []
        with pytest.raises(SourceError, match="a.parquet"):
            for row in ResumableStream(cfg, source=source):
                yielded.append(row["id"])
        assert yielded == []
        source.close()


# ---------------------------------------------------------------------------- jobs against the rate-limited Hub
def test_a_429_storm_spends_no_retry_and_leaves_the_sequence_unchanged(hub):
    """No budget (unlimited) against a Hub allowing 6 resolver requests per second: the job runs into its
    limit, and with data.retries: 0 every 429 is waited out (RateLimit's reset), none fails a read."""
    reference = [r["id"] for r in itertools.islice(ResumableStream(hub_config(prefetch_blocks=4)), ROWS)]
    cfg = hub_config(prefetch_blocks=4, retries=0, max_requests_per_s="unlimited")
    source = open_source(cfg.source_spec)           # resolved first: the limit is on the reads
    hub.set_rate_limit(resolvers=6, window_s=1)
    before = snapshot()
    got = [r["id"] for r in itertools.islice(ResumableStream(cfg, source=source), ROWS)]
    source.close()
    assert got == reference and sorted(got) == list(range(ROWS))
    assert hub.rate_limited > 0
    f = figures({**dict.fromkeys(("time", "loader_wait_s", "loader_batches", "loader_samples", "loader_tokens",
                                  "cache_hits", "cache_misses", "cache_bytes_read"), 1), **_delta(before)})
    assert f["rate_limited"] > 0 and f["rate_limit_wait_s"] > 0 and f["retries"] == 0


def test_a_budget_inside_the_hubs_limit_draws_no_429(hub):
    """The Hub lets 10 resolver requests per 2 s through; a job that plans 4.5 a second (90 % of it) reads every
    row without one 429, and no window of the server's saw more than its quota."""
    cfg = hub_config(prefetch_blocks=4, max_requests_per_s=4.5)
    source = open_source(cfg.source_spec)
    hub.set_rate_limit(resolvers=10, window_s=2)
    stream = ResumableStream(cfg, source=source)
    stream.set_epoch(0)
    t0 = time.monotonic()
    ids = [r["id"] for r in stream]
    took = time.monotonic() - t0
    source.close()
    assert sorted(ids) == list(range(ROWS)) and hub.rate_limited == 0
    times = hub.allowed("resolvers")
    assert len(times) <= FILES * ROWS // FILES // GROUP                # at most one request per row group
    per_s = (len(times) - 1) / max(1e-9, times[-1] - times[0])
    assert 0.8 * 4.5 <= per_s <= 4.5 * 1.05, per_s        # paced: never above the budget, and kept busy at it
    assert took <= len(times) / 4.5 + 3.0


def test_a_rate_limit_past_its_wait_is_a_clear_error_not_a_hang(hub):
    cfg = hub_config(prefetch_blocks=0, max_requests_per_s="unlimited", rate_limit_wait_s=1)
    source = open_source(cfg.source_spec)
    hub.set_rate_limit(resolvers=1, window_s=30)
    hub.spend("resolvers", "127.0.0.1")             # another job on the same IP spent the window's quota
    t0 = time.monotonic()
    with pytest.raises(SourceError) as err:
        next(iter(ResumableStream(cfg, source=source)))
    assert time.monotonic() - t0 < 10
    text = str(err.value)
    assert "data.rate_limit_wait_s (1)" in text and "RateLimit: 0 left" in text and "data.max_requests_per_s" in text
    assert hub.allowed("resolvers") == [] and hub.rate_limited >= 1


# ---------------------------------------------------------------------------- resolve once, then the CDN
def test_a_hub_file_is_resolved_once_per_process_then_read_from_its_signed_cdn_url(hub):
    """The Hub redirects an LFS file's resolve to a signed CDN URL: the process asks resolve once per file (the
    requests the Hub's rate limit counts) and reads every row group from the CDN without the token; an expired
    or revoked URL is resolved again; the rows are those of a read that resolves every time."""
    reference = [r["id"] for r in itertools.islice(ResumableStream(hub_config(prefetch_blocks=2)), ROWS)]
    hub.tokens.add("tok")
    hub.redirect_lfs = True
    hub.reset_stats()
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
        mp.setenv("HF_TOKEN", "tok")
        cfg = hub_config(prefetch_blocks=2, max_requests_per_s=50)
        stream = ResumableStream(cfg)
        got = [r["id"] for r in itertools.islice(stream, ROWS // 2)]
        resolves = [r for r in hub.data_requests() if r.range]
        assert len(resolves) == FILES                   # one per file: its footer read, then its CDN URL
        assert all(r.status == 302 for r in resolves)
        cdn = [r for r in hub.cdn_requests() if r.range]
        deadline = time.monotonic() + 10     # a prefetch's request may be in flight (no status yet): let it answer
        while any(r.status == 0 for r in cdn) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cdn and all(r.status == 206 and r.client == "127.0.0.1" for r in cdn)      # no token to the CDN
        hub._cdn_secret = b"rotated"                    # every URL handed out so far is refused now (403)
        got += [r["id"] for r in itertools.islice(stream, ROWS - ROWS // 2)]
    stream.source.close()
    assert got == reference
    refused = [r for r in hub.cdn_requests() if r.status == 403]
    assert refused and len([r for r in hub.data_requests() if r.range]) > FILES     # resolved again


def test_a_signed_url_is_not_used_past_its_expiry():
    from resumable_stream.io import hub as hub_io

    now = time.time()
    assert hub_io.signed_url_ttl(f"https://cdn-lfs.hf.co/x?Expires={int(now) + 3600}&Signature=s") == \
        pytest.approx(3600, abs=2)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now - 600))
    assert hub_io.signed_url_ttl(f"https://cas-bridge.xethub.hf.co/x?X-Amz-Date={stamp}&X-Amz-Expires=3600") == \
        pytest.approx(3000, abs=2)
    assert hub_io.signed_url_ttl("https://cdn.example/x") == hub_io._CDN_DEFAULT_TTL_S
    urls = hub_io._SignedUrls()
    urls.remember("hf://a", f"https://c/x?Expires={int(now) + 3600}")
    assert urls.get("hf://a") is not None                       # used until 60 s before it expires
    urls.remember("hf://b", f"https://c/x?Expires={int(now) + 2}")
    assert urls.get("hf://b") is not None                       # a 2 s URL: its first 1.5 s
    urls.remember("hf://c", f"https://c/x?Expires={int(now) - 5}")
    assert urls.get("hf://c") is None                           # expired already: not kept
    time.sleep(1.6)
    assert urls.get("hf://b") is None
