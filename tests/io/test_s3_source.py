"""Parquet on S3 (``s3://bucket/prefix/*.parquet`` through s3fs) against moto's S3 server on 127.0.0.1.

The server authenticates every request (``tests/_support/s3_server.py``): the tests read as an IAM user allowed
the ``data`` bucket only, with its key in the environment, exactly as a job on AWS would. Nothing goes
beyond 127.0.0.1 (fake keys, EC2 metadata lookup off).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from repo_paths import REPO_ROOT
from s3_server import S3Server

from resumable_stream import ResumableStream, SourceError, StreamConfig, StreamMismatchError
from resumable_stream.app.cli import main
from resumable_stream.sources.fingerprint_files import identities
from resumable_stream.testing import synthetic_rows, write_parquet_dataset

pytest.importorskip("s3fs")
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("hub_offline")]

ROWS, FILES, ROW_GROUP, BUFFER = 480, 3, 40, 64
ROOT = REPO_ROOT
DOCS_BUCKET = "my-datasets"          # the bucket of the config in docs/s3.md


class Bucket:
    """The module's S3 server and the parquet dataset uploaded to ``s3://data/ds/``."""

    def __init__(self, srv: S3Server, local: list[str]):
        self.srv, self.local = srv, local
        self.reference: list[int] | None = None

    def config(self, prefix: str = "ds", **kw) -> StreamConfig:
        kw.setdefault("shuffle", True)
        kw.setdefault("buffer_size", BUFFER)
        kw.setdefault("retry_backoff_s", 0.05)
        kw.setdefault("timeout_s", 10.0)
        kw.setdefault("storage_options", {"endpoint_url": self.srv.endpoint})
        return StreamConfig(dataset_name_or_path="parquet", data_files=f"s3://data/{prefix}/*.parquet", **kw)

    def upload(self, prefix: str, bucket: str = "data") -> list[str]:
        """Copy the local dataset to ``s3://bucket/prefix/`` (a fresh prefix for tests that change it)."""
        s3 = self.srv.admin()
        keys = []
        for p in self.local:
            keys.append(f"{prefix}/{os.path.basename(p)}")
            s3.upload_file(p, bucket, keys[-1])
        return [f"s3://{bucket}/{k}" for k in keys]

    def yaml_file(self, directory, cfg: StreamConfig) -> str:
        path = os.path.join(directory, "s3.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({"data": {k: v for k, v in cfg.to_dict().items() if v is not None}}, f)
        return path


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    local = write_parquet_dataset(str(tmp_path_factory.mktemp("s3_src")), rows=ROWS, files=FILES,
                                  row_group_size=ROW_GROUP)
    with S3Server(readable=("data", "missing", DOCS_BUCKET)) as srv, pytest.MonkeyPatch.context() as mp:
        for key, value in srv.env().items():
            mp.setenv(key, value)          # subprocesses (the CLI) inherit the reader's credentials
        s3 = srv.admin()
        for name in ("data", "private", DOCS_BUCKET):
            s3.create_bucket(Bucket=name)
        b = Bucket(srv, local)
        b.upload("ds")
        b.upload("ds", bucket="private")
        yield b


def _take(stream, n: int) -> list[int]:
    return [row["id"] for row in itertools.islice(stream, n)]


def _reference(b: Bucket) -> list[int]:
    """The uninterrupted shuffled stream read from local copies of the same files (same content: same order)."""
    if b.reference is None:
        local = StreamConfig(dataset_name_or_path="parquet", data_files=sorted(b.local), shuffle=True,
                             buffer_size=BUFFER)
        b.reference = _take(ResumableStream(local), ROWS + 96)
    return b.reference


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "resumable_stream.app.cli", *argv], capture_output=True, text=True,
                          env=full, timeout=150)


# ------------------------------------------------------------------------------ resolution and identity
@pytest.mark.slow
def test_s3_pattern_resolves_every_row_once_with_etag_identity(bucket):
    stream = ResumableStream(bucket.config())
    fp_files = identities(stream.source.fingerprint["files"])
    assert [f["path"] for f in fp_files] == [f"s3://data/ds/{os.path.basename(p)}" for p in sorted(bucket.local)]
    for f, local in zip(fp_files, sorted(bucket.local)):
        with open(local, "rb") as fh:
            content = fh.read()
        assert f["size"] == len(content)
        assert f["etag"] == f'"{hashlib.md5(content).hexdigest()}"'    # S3's ETag of a single-part upload
        assert f["footer"]
    assert sorted(_take(stream, ROWS)) == list(range(ROWS))
    assert _take(ResumableStream(bucket.config()), ROWS + 96) == _reference(bucket)


def _threads_share_filesystems() -> bool:
    """Does fsspec give every thread the same S3 filesystem (and listing cache)? Newer fsspec does
    (filesystem_spec#2028); fsspec 2025.3.0 (beside LLaMA-Factory 0.9.5) gives each thread its own, so
    datasets' threaded per-file info() (the files' origin metadata) starts with an empty listing cache: one
    HEAD more per object, datasets' own, before ours."""
    from concurrent.futures import ThreadPoolExecutor

    import fsspec

    def make():
        return fsspec.filesystem("s3", anon=True, endpoint_url="http://127.0.0.1:1")

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(make).result() is make()


def test_requests_to_open_and_read_are_two_listings_plus_one_per_object_then_one_per_row_group(bucket):
    import fsspec

    srv = bucket.srv
    # no filesystem of an earlier test: with per-thread ones, a new thread can get a dead one's id, and its
    # listing cache
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    before = len(srv.requests)
    stream = ResumableStream(bucket.config(prefetch_blocks=0))
    opened = srv.requests[before:]
    objects = [f"/data/ds/{os.path.basename(p)}" for p in sorted(bucket.local)]
    # datasets' listing to resolve the pattern, ours of the directory (every object's size and ETag: no
    # HeadObject each), then one footer read per object; where threads do not share filesystems (fsspec
    # 2025.3.0, beside LLaMA-Factory) datasets' own threaded info() adds a HEAD per object
    per_object = ("GET",) if _threads_share_filesystems() else ("HEAD", "GET")
    assert sorted(opened) == sorted([("GET", "/data")] * 2 + [(m, o) for o in objects for m in per_object])
    before = len(srv.requests)
    assert sorted(_take(stream, ROWS)) == list(range(ROWS))
    # a ranged GET per row group: the footers read to open are kept with the index, never fetched again
    assert sorted(srv.requests[before:]) == sorted([("GET", o) for o in objects] * (ROWS // FILES // ROW_GROUP))


def test_identities_from_one_listing_are_those_a_head_of_each_object_gives(bucket):
    from resumable_stream.io.ranged import listed_identities
    from resumable_stream.sources import RetryPolicy
    from resumable_stream.sources.resolve import file_identity

    urls = [f"s3://data/ds/{os.path.basename(p)}" for p in sorted(bucket.local)]
    spec = bucket.config().source_spec
    retry = RetryPolicy(spec.net, remote=True, data=spec.data)
    options = retry.storage_options
    before = len(bucket.srv.requests)
    listed = listed_identities(urls, options)
    assert bucket.srv.requests[before:] == [("GET", "/data")]         # one listing for the directory
    assert listed == {u: file_identity(u, retry) for u in urls}
    assert all(set(ident) == {"path", "size", "etag"} for ident in listed.values())
    assert listed_identities(urls[:1], options) == {}                  # one object: its HeadObject is as cheap
    assert listed_identities([u.replace("/ds/", "/nothing/") for u in urls], options) == {}   # not listed: HEADs


def test_the_s3_client_is_made_before_a_request_waits_its_turn(bucket, monkeypatch):
    """A client made lazily, inside the first request, takes seconds in a fresh DataLoader worker on busy cores: the
    requests whose turns under the job's budget came meanwhile then reach the store together, past its rate (8 ranks
    x 2 workers drew SlowDowns so). The client is made first, then the request waits its turn."""
    import s3fs

    from resumable_stream.io import budget, ranged

    events = []
    connect, acquire = s3fs.S3FileSystem.connect, budget.acquire
    monkeypatch.setattr(s3fs.S3FileSystem, "connect", lambda fs, *a, **k: events.append("client") or connect(fs, *a, **k))
    monkeypatch.setattr(budget, "acquire", lambda path, paced=True: events.append("turn") or acquire(path, paced))
    monkeypatch.setattr(ranged, "_FILESYSTEMS", {})                    # this process has made none yet
    url = f"s3://data/ds/{os.path.basename(sorted(bucket.local)[0])}"
    options = {"s3": {"endpoint_url": bucket.srv.endpoint}}
    assert ranged.read_range(url, 0, 4, options) == b"PAR1"
    assert ranged.read_range(url, 4, 8, options)
    assert events == ["client", "turn", "turn"]


def test_a_single_s3_file_as_dataset_name_or_path(bucket):
    url = f"s3://data/ds/{os.path.basename(sorted(bucket.local)[1])}"
    cfg = StreamConfig(dataset_name_or_path=url, storage_options={"endpoint_url": bucket.srv.endpoint})
    stream = ResumableStream(cfg)
    assert [f["path"] for f in identities(stream.source.fingerprint["files"])] == [url]
    assert _take(stream, ROWS // FILES) == pq.read_table(sorted(bucket.local)[1]).column("id").to_pylist()


def test_rewritten_s3_object_is_a_mismatch_naming_it(bucket, tmp_path):
    urls = bucket.upload("rewrite")
    cfg = bucket.config("rewrite")
    first = ResumableStream(cfg)
    _take(first, 50)
    first.save_sidecar(tmp_path)
    # same rows, other values: the object is rewritten (new ETag), the key is the same
    table = pq.read_table(bucket.local[1])
    other = tmp_path / "other.parquet"
    pq.write_table(table.set_column(1, table.column_names[1], table.column(1).take(
        list(reversed(range(table.num_rows))))), other, row_group_size=ROW_GROUP)
    bucket.srv.admin().upload_file(str(other), "data", urls[1].split("/", 3)[3])
    with pytest.raises(StreamMismatchError) as err:
        ResumableStream(cfg.replace(resume_state_path=str(tmp_path)))
    assert urls[1] in str(err.value) and "etag" in str(err.value)


def test_an_s3_object_rewritten_mid_epoch_is_refused_by_if_match(bucket, tmp_path):
    """The ranged GETs say If-Match: <ETag from the index>: the store refuses the new object's bytes (412)."""
    urls = bucket.upload("midepoch")
    cfg = bucket.config("midepoch", shuffle=False, prefetch_blocks=0, interleave_shards=1)
    it = iter(ResumableStream(cfg))
    first = [next(it)["id"] for _ in range(ROW_GROUP)]
    table = pq.read_table(bucket.local[0])
    other = tmp_path / "other.parquet"
    pq.write_table(table.set_column(0, "id", pa.array([i + 10**6 for i in table.column("id").to_pylist()])),
                   other, row_group_size=ROW_GROUP)
    bucket.srv.admin().upload_file(str(other), "data", urls[0].split("/", 3)[3])
    with pytest.raises(StreamMismatchError) as err:
        for row in it:
            assert row["id"] < 10**6                  # never a row of the new object
    assert urls[0] in str(err.value) and "If-Match refused: HTTP 412" in str(err.value)
    assert first == pq.read_table(bucket.local[0]).column("id").to_pylist()[:ROW_GROUP]


@pytest.mark.slow   # forked DataLoader workers over the S3 server
def test_two_ranks_with_forked_dataloader_workers_read_every_row_once(bucket):
    """Forked DataLoader workers open their own s3fs filesystem (aiobotocore after fork)."""
    import torch.utils.data

    seen = []
    for rank in range(2):
        stream = ResumableStream(bucket.config(), rank=rank, world_size=2, num_workers=2)
        stream.set_epoch(0)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2, timeout=60)
        seen.append([int(row["id"]) for row in loader])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(ROWS))


# ------------------------------------------------------------------------------ exact resume across processes
@pytest.mark.parametrize("k", [37, 2 * BUFFER, ROWS])
@pytest.mark.slow
def test_shuffled_resume_across_processes_is_exact(bucket, tmp_path, k):
    ref = _reference(bucket)
    cfg_path = bucket.yaml_file(tmp_path, bucket.config())
    state = tmp_path / "state"
    first = _cli("peek", cfg_path, "--num", str(k), "--fields", "id", "--save-state", str(state))
    assert first.returncode == 0, first.stderr
    assert [json.loads(line)["id"] for line in first.stdout.splitlines()] == ref[:k]
    resumed = _cli("peek", cfg_path, "--num", "96", "--fields", "id", "--resume-from", str(state))
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line)["id"] for line in resumed.stdout.splitlines()] == ref[k:k + 96]


# ------------------------------------------------------------------------------ cache and warmup
def test_warmup_fills_the_cache_then_reading_makes_no_s3_request(bucket, tmp_path, capsys):
    n = 200
    cached = bucket.config(cache_dir=str(tmp_path / "cache"), prefetch_blocks=0)
    assert main(["warmup", bucket.yaml_file(tmp_path, cached), "--samples", str(n)]) == 0
    assert "warmup:" in capsys.readouterr().err
    stream = ResumableStream(cached)
    before = bucket.srv.count(prefix="/data/ds/")
    assert _take(stream, n) == _reference(bucket)[:n]
    assert bucket.srv.count(prefix="/data/ds/") == before, bucket.srv.requests[-5:]
    assert stream.source.stats()["misses"] == 0


# ------------------------------------------------------------------------------ faults
@pytest.mark.slow
def test_resets_and_5xx_from_s3_are_retried_and_the_sequence_is_identical(bucket):
    kinds = itertools.cycle(["reset", "503", "500"])
    injected = []

    def fault(method: str, path: str) -> str | None:
        if method == "GET" and path.startswith("/data/faults/") and len(injected) < 9:
            injected.append(next(kinds))
            return injected[-1]
        return None

    bucket.upload("faults")
    # botocore's own retries off: the faults reach s3fs and our retry layer
    cfg = bucket.config("faults", storage_options={"endpoint_url": bucket.srv.endpoint,
                                                   "config_kwargs": {"retries": {"max_attempts": 1}}})
    bucket.srv.faults.append(fault)
    try:
        got = _take(ResumableStream(cfg), ROWS + 96)
    finally:
        bucket.srv.faults.remove(fault)
    assert len(injected) == 9 and set(injected) == {"reset", "503", "500"}
    assert got == _reference(bucket)


# ------------------------------------------------------------------------------ bad input
def _one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("resumable-stream: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("data_files,answer", [
    ("s3://missing/ds/*.parquet", "HTTP 404 NoSuchBucket"),
    ("s3://private/ds/*.parquet", "HTTP 403 AccessDenied"),
])
@pytest.mark.slow
def test_missing_or_forbidden_bucket_is_one_line_exit_2_without_retries(bucket, tmp_path, data_files, answer):
    cfg = bucket.config().replace(data_files=data_files, retry_backoff_s=5.0)
    bucket_path = "/" + data_files.split("/")[2]
    before = bucket.srv.count(prefix=bucket_path)
    r = _cli("peek", bucket.yaml_file(tmp_path, cfg), "--num", "1")
    line = _one_line_error(r)
    assert "data.data_files" in line and data_files in line and answer in line
    # answers, not faults: no retry (with data.retries 5 that would be 6 rounds of these requests)
    assert "retry" not in r.stderr
    assert bucket.srv.count(prefix=bucket_path) - before <= 6


@pytest.mark.slow
def test_wrong_credentials_are_one_line_exit_2(bucket, tmp_path):
    cfg_path = bucket.yaml_file(tmp_path, bucket.config(retry_backoff_s=5.0))
    r = _cli("peek", cfg_path, "--num", "1", env={"AWS_ACCESS_KEY_ID": "AKIAWRONGKEY00000000"})
    line = _one_line_error(r)
    assert "retry" not in r.stderr
    assert "data.data_files" in line and "s3://data/ds/*.parquet" in line
    assert "HTTP 403 InvalidAccessKeyId" in line


def test_in_process_missing_bucket_is_a_source_error(bucket):
    with pytest.raises(SourceError, match=r"s3://missing: HTTP 404 NoSuchBucket"):
        ResumableStream(bucket.config().replace(data_files="s3://missing/ds/*.parquet"))


# ------------------------------------------------------------------------------ the documented config
def test_the_s3_config_of_the_docs_runs_against_the_server(bucket, tmp_path):
    text = open(os.path.join(ROOT, "docs", "s3.md")).read()
    block = re.search(r"<!-- tested-config: s3 -->\s*```yaml\n(.*?)```", text, re.S)
    assert block, "docs/s3.md: no yaml block after <!-- tested-config: s3 -->"
    data = yaml.safe_load(block.group(1))["data"]
    prefix = data["data_files"].split("/", 3)[3].rsplit("/", 1)[0]
    assert data["data_files"].startswith(f"s3://{DOCS_BUCKET}/")
    bucket.upload(prefix, bucket=DOCS_BUCKET)
    data["storage_options"]["endpoint_url"] = bucket.srv.endpoint
    data.pop("cache_dir", None)
    cfg = StreamConfig.from_dict(data)
    assert sorted(_take(ResumableStream(cfg), ROWS)) == list(range(ROWS))


# ------------------------------------------------------------------------------ relocated data (docs/relocating-data.md)
def _local_config(paths: list[str], **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=sorted(paths), shuffle=True, buffer_size=BUFFER,
                        **kw)


def test_a_local_checkpoint_resumes_on_an_s3_copy(bucket, tmp_path):
    ref, k = _reference(bucket), 150
    first = ResumableStream(_local_config(bucket.local))
    assert _take(first, k) == ref[:k]
    first.save_sidecar(tmp_path)
    bucket.upload("local-copy")
    resumed = ResumableStream(bucket.config("local-copy", resume_state_path=str(tmp_path)))
    assert _take(resumed, 96) == ref[k:k + 96]


def test_an_s3_checkpoint_resumes_on_a_local_copy_and_on_another_prefix(bucket, tmp_path):
    ref, k = _reference(bucket), 150
    urls = bucket.upload("to-local")
    first = ResumableStream(bucket.config("to-local"))
    assert _take(first, k) == ref[:k]
    first.save_sidecar(tmp_path / "state")
    s3 = bucket.srv.admin()
    local = []
    for url in urls:                        # s3 -> local (new mtimes, of course)
        local.append(str(tmp_path / "copy" / os.path.basename(url)))
        os.makedirs(os.path.dirname(local[-1]), exist_ok=True)
        s3.download_file("data", url.split("/", 3)[3], local[-1])
        s3.copy_object(Bucket="data", Key="copied/" + os.path.basename(url),    # s3 -> s3: the ETag is compared
                       CopySource={"Bucket": "data", "Key": url.split("/", 3)[3]})
    resumed = ResumableStream(_local_config(local, resume_state_path=str(tmp_path / "state")))
    assert _take(resumed, 96) == ref[k:k + 96]
    again = ResumableStream(bucket.config("copied", resume_state_path=str(tmp_path / "state")))
    assert _take(again, 96) == ref[k:k + 96]


def test_an_s3_copy_with_an_edited_object_is_a_mismatch_naming_it(bucket, tmp_path):
    first = ResumableStream(_local_config(bucket.local))
    _take(first, 50)
    first.save_sidecar(tmp_path / "state")
    urls = bucket.upload("edited-copy")
    table = pq.read_table(bucket.local[2])
    pq.write_table(table.set_column(1, table.column_names[1], table.column(1).take(
        list(reversed(range(table.num_rows))))), tmp_path / "x.parquet", row_group_size=ROW_GROUP)
    bucket.srv.admin().upload_file(str(tmp_path / "x.parquet"), "data", urls[2].split("/", 3)[3])
    with pytest.raises(StreamMismatchError) as err:
        ResumableStream(bucket.config("edited-copy", resume_state_path=str(tmp_path / "state")))
    assert f"file modified: {urls[2]} (footer; was {sorted(bucket.local)[2]})" in str(err.value)
    assert urls[0] not in str(err.value) and urls[1] not in str(err.value)


@pytest.mark.slow      # moto in this process: a few seconds of CPU
def test_growing_s3_prefix_new_object_joins_at_the_next_epoch(bucket, tmp_path):
    """data.growth: append on S3: an object uploaded between a save and its resume joins at the next epoch,
    its identity (ETag) from the listing; the objects read so far are checked as without growth."""
    bucket.upload("grow")
    cfg = bucket.config("grow", growth="append")
    first = ResumableStream(cfg)
    head = _take(first, 200)
    first.save_sidecar(str(tmp_path / "stream_state"))
    extra = tmp_path / "extra.parquet"
    pq.write_table(pa.table(synthetic_rows(5000, 80)), extra, row_group_size=ROW_GROUP)
    bucket.srv.admin().upload_file(str(extra), "data", "grow/part-00009.parquet")
    resumed = ResumableStream(cfg.replace(resume_state_path=str(tmp_path)))
    resumed.set_epoch(0)
    assert head + [r["id"] for r in resumed] == _reference(bucket)[:ROWS]
    resumed.set_epoch(1)
    assert sorted(r["id"] for r in resumed) == sorted([*range(ROWS), *range(5000, 5080)])
    assert resumed.source.index["files"][-1]["path"] == "s3://data/grow/part-00009.parquet"
