"""Streaming from the Hugging Face Hub, for real, offline: a loopback Hub (tests/_support/hub_server.py) serves dataset
repos with commits; ``datasets`` / ``huggingface_hub`` resolve and read them through their own code paths
(repo info, tree listing, ``resolve`` with Range), exactly as against huggingface.co."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import take_ids
from hub_server import HubServer, use_hub
from repo_paths import REPO_ROOT

from resumable_stream import ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.sources.fingerprint_files import identities
from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.timeout(180)

REPO = "org/data"
FILES, ROWS, GROUP = 4, 800, 50


@pytest.fixture
def hub(tmp_path):
    """A loopback Hub with ``org/data`` (4 parquet files of 4 row groups in data/, and a README), this
    process and its children pointed at it."""
    src = tmp_path / "repo"
    write_parquet_dataset(str(src / "data"), rows=ROWS, files=FILES, row_group_size=GROUP)
    (src / "README.md").write_text("# org/data\n")
    with HubServer(tmp_path / "hub-store") as srv:
        srv.create_repo(REPO)
        srv.first_commit = srv.commit(REPO, directory=src, message="initial")
        srv.local = src
        with use_hub(srv, tmp_path / "hf-home") as env:
            srv.env = env
            yield srv


def hub_config(**kw) -> StreamConfig:
    base = dict(dataset_name_or_path=REPO, data_files="data/*.parquet", shuffle=True, shuffle_seed=3,
                buffer_size=120, prefetch_blocks=0)
    return StreamConfig(**{**base, **kw})


def local_rows(directory) -> list[dict]:
    return sorted((r for f in sorted(directory.glob("data/*.parquet")) for r in pq.read_table(f).to_pylist()),
                  key=lambda r: r["id"])


def run_cli(hub, *args: str, timeout: float = 150, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **hub.env, **(env or {}),
           "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}
    return subprocess.run([sys.executable, "-m", "resumable_stream", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_yaml(path, **data) -> str:
    path.write_text(yaml.safe_dump({"data": data}))
    return str(path)


# ---------------------------------------------------------------------------- resolution
def test_hub_id_streams_the_repo_at_its_commit(hub):
    stream = ResumableStream(hub_config(shuffle=False))
    rows = [dict(r) for r in itertools.islice(stream, ROWS)]
    assert sorted(rows, key=lambda r: r["id"]) == local_rows(hub.local)
    files = [f["path"] for f in identities(stream.source.fingerprint["files"])]
    assert files == [f"hf://datasets/{REPO}@{hub.first_commit}/data/part-{i:05d}.parquet" for i in range(FILES)]
    assert stream.source.fingerprint["hub_commits"] == {REPO: hub.first_commit}
    assert len(stream.source.shards) == FILES * ROWS // FILES // GROUP          # one shard per row group
    # identities asked in one batch equal those verify_files asks file by file (else every resume re-indexes)
    from resumable_stream.io.hub import file_identities
    from resumable_stream.sources.resolve import file_identity
    indexed = {k: v for k, v in identities(stream.source.fingerprint["files"])[1].items() if k != "footer"}
    assert file_identities(files)[files[1]] == file_identity(files[1]) == indexed
    # ranged reads only (no 5 MB read-ahead): each file's footer once (read to index it, kept to decode its
    # row groups), then each row group once
    data = [r for r in hub.data_requests() if r.method == "GET" and r.path.endswith(".parquet")]
    assert all(r.status == 206 for r in data) and len(data) == FILES + len(stream.source.shards)


def test_hf_path_on_a_branch_is_pinned_to_its_commit_and_reads_like_the_hub_id(hub):
    by_id = take_ids(ResumableStream(hub_config()), 300)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=f"hf://datasets/{REPO}@main/data/*.parquet",
                       shuffle=True, shuffle_seed=3, buffer_size=120, prefetch_blocks=0)
    stream = ResumableStream(cfg)
    assert stream.source.fingerprint["hub_commits"] == {REPO: hub.first_commit}
    assert take_ids(stream, 300) == by_id
    # a repo without data_files: datasets finds data/*.parquet by itself
    assert take_ids(ResumableStream(hub_config(data_files=None)), 300) == by_id


# ---------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_shuffled_resume_in_a_new_process_continues_exactly(hub, tmp_path):
    config = write_yaml(tmp_path / "hub.yaml", dataset_name_or_path=REPO, data_files="data/*.parquet",
                        shuffle=True, shuffle_seed=5, buffer_size=150)
    whole = run_cli(hub, "peek", config, "--num", "500", "--fields", "id")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli(hub, "peek", config, "--num", "170", "--fields", "id", "--save-state", str(tmp_path / "st"))
    assert first.returncode == 0, first.stderr[-3000:]
    rest = run_cli(hub, "peek", config, "--num", "330", "--fields", "id", "--resume-from", str(tmp_path / "st"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in whole.stdout.splitlines()]
    assert [json.loads(line)["id"] for line in first.stdout.splitlines() + rest.stdout.splitlines()] == ids
    assert ids != sorted(ids)                                                 # really shuffled


@pytest.mark.slow
def test_new_commit_is_a_mismatch_naming_the_revision_unless_pinned(hub, tmp_path):
    reference = take_ids(ResumableStream(hub_config()), 400)
    first = ResumableStream(hub_config())
    assert take_ids(first, 150) == reference[:150]
    first.save_sidecar(str(tmp_path / "ckpt" / "stream_state"))
    hub.reset_stats()
    same = ResumableStream(hub_config(resume_state_path=str(tmp_path / "ckpt")))
    assert take_ids(same, 50) == reference[150:200]
    # the checkpoint's index is reused (no footer read to index), its files verified against the listing
    # datasets' resolution made (no paths-info request)
    assert sum("/paths-info/" in r.path for r in hub.requests) == 0
    assert not any(r.range and r.range.startswith("bytes=0-") for r in hub.data_requests())

    more = tmp_path / "more.parquet"
    write_parquet_dataset(str(tmp_path / "more"), rows=100, files=1, row_group_size=GROUP)
    os.replace(tmp_path / "more" / "part-00000.parquet", more)
    new = hub.commit(REPO, files={"data/part-00009.parquet": str(more)}, message="more rows")

    with pytest.raises(StreamMismatchError) as info:
        ResumableStream(hub_config(resume_state_path=str(tmp_path / "ckpt")))
    msg = str(info.value)
    assert "data.revision" in msg and hub.first_commit in msg and new in msg and REPO in msg

    hub.reset_stats()
    pinned = ResumableStream(hub_config(revision=hub.first_commit, resume_state_path=str(tmp_path / "ckpt")))
    assert pinned.source.fingerprint["hub_commits"] == {REPO: hub.first_commit}
    # (a new resolution: the config names another revision; its file identities from datasets' listing)
    assert sum("/paths-info/" in r.path for r in hub.requests) == 0
    assert take_ids(pinned, 250) == reference[150:400]
    # the new commit is what an unpinned fresh run reads
    assert ResumableStream(hub_config()).source.fingerprint["hub_commits"] == {REPO: new}


def test_branch_revision_is_read_at_its_commit(hub, tmp_path):
    hub.commit(REPO, delete=("data/part-00003.parquet",), message="fewer files", branch="small")
    stream = ResumableStream(hub_config(revision="small", shuffle=False))
    assert len(identities(stream.source.fingerprint["files"])) == FILES - 1
    assert stream.source.fingerprint["hub_commits"] == {REPO: hub.head(REPO, "small")}


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("data", "key", "status", "code"), [
    (dict(dataset_name_or_path="org/nope"), "data.dataset_name_or_path", "404", "RepoNotFound"),
    (dict(dataset_name_or_path=REPO, revision="no-such-branch"), "data.revision", "404", "RevisionNotFound"),
    (dict(dataset_name_or_path="org/private"), "data.dataset_name_or_path", "401", "RepoNotFound"),
])
@pytest.mark.slow
def test_missing_repo_revision_or_token_is_one_line_exit_2_without_retries(hub, tmp_path, data, key, status,
                                                                         code):
    hub.create_repo("org/private", private=True)
    hub.commit("org/private", directory=hub.local)
    config = write_yaml(tmp_path / "bad.yaml", **data, data_files="data/*.parquet", retries=3,
                        retry_backoff_s=0.01)
    hub.reset_stats()
    proc = run_cli(hub, "peek", config, "--num", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and key in error[0] and status in error[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # an answer, not a fault: never retried (datasets' request, and at most one of ours to read the status)
    answered = [r for r in hub.requests if r.error_code == code]
    assert 1 <= len(answered) <= 2, [(r.method, r.path, r.status) for r in hub.requests]
    assert all(str(r.status) == status for r in answered)


@pytest.mark.slow
def test_private_repo_streams_with_a_token_and_a_wrong_token_is_refused(hub, tmp_path):
    hub.create_repo("org/private", private=True)
    hub.commit("org/private", directory=hub.local)
    hub.tokens.add("hf_good")
    config = write_yaml(tmp_path / "p.yaml", dataset_name_or_path="org/private", data_files="data/*.parquet")
    ok = run_cli(hub, "peek", config, "--num", "3", "--fields", "id", env={"HF_TOKEN": "hf_good", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0"})
    assert ok.returncode == 0 and len(ok.stdout.splitlines()) == 3, ok.stderr[-3000:]
    assert all(r.status != 401 for r in hub.requests)
    bad = run_cli(hub, "peek", config, "--num", "3", env={"HF_TOKEN": "hf_wrong", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0"})
    assert bad.returncode == 2 and "401" in bad.stderr and "token" in bad.stderr, bad.stderr[-3000:]


# ---------------------------------------------------------------------------- rate limits
@pytest.mark.slow
def test_rate_limits_and_server_errors_leave_the_sequence_unchanged(hub):
    reference = take_ids(ResumableStream(hub_config(prefetch_blocks=2)), 500)
    hub.retry_after_s = 0
    hub.set_faults(rate=0.3, kinds=("429", "500", "503", "reset"), seed=7, paths=("*.parquet",),
                   methods=("GET",), first=40)
    faulted = ResumableStream(hub_config(prefetch_blocks=2, retries=6, retry_backoff_s=0.01))
    assert take_ids(faulted, 500) == reference
    assert hub.stats()["faults"]["429"] > 0 and hub.stats()["faults_injected"] >= 5


def test_retry_after_is_waited_with_jitter(monkeypatch):
    try:
        import httpx2
    except ImportError:   # huggingface_hub 1.x (beside LLaMA-Factory 0.9.5) sends its requests with httpx
        import httpx as httpx2
    from huggingface_hub.utils import hf_raise_for_status

    from resumable_stream.io import net as source

    request = httpx2.Request("GET", "http://127.0.0.1:1/datasets/org/data/resolve/main/a.parquet")
    limited = httpx2.Response(429, headers={"Retry-After": "3"}, request=request)
    with pytest.raises(Exception) as info:
        hf_raise_for_status(limited)
    spec = hub_config(retry_backoff_s=0.5).source_spec
    retry = source.RetryPolicy(spec.net, remote=True, data=spec.data)
    waits = [retry.delay(0, info.value) for _ in range(200)]
    assert all(3.0 <= w <= 3.0 * (1 + source._JITTER) for w in waits)     # at least Retry-After
    assert len(set(waits)) > 100                                          # jittered: ranks do not retry together
    plain = [retry.delay(2) for _ in range(200)]                          # ordinary backoff: 0.5 * 2**2, jittered
    assert all(2.0 <= w <= 2.0 * (1 + source._JITTER) for w in plain) and len(set(plain)) > 100
    huge = httpx2.Response(429, headers={"Retry-After": "86400"}, request=request)
    with pytest.raises(Exception) as info:
        hf_raise_for_status(huge)
    assert retry.delay(0, info.value) <= source._MAX_RETRY_AFTER_S * (1 + source._JITTER)   # capped
    assert source.retry_after_s({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a date in the past


def test_http_request_retry_honours_retry_after(tmp_path, caplog):
    from http_server import FileServer

    write_parquet_dataset(str(tmp_path / "d"), rows=200, files=1, row_group_size=100)
    with FileServer(tmp_path / "d") as srv:
        srv.retry_after_s = 1
        seen = []
        srv.faults.append(lambda rec: 429 if rec.range and len(seen) < 1 and not seen.append(rec) else None)
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url("part-00000.parquet")],
                           retries=2, retry_backoff_s=0.01, prefetch_blocks=0)
        with caplog.at_level("WARNING", logger="resumable_stream.io"):
            ids = take_ids(ResumableStream(cfg), 200)
        assert sorted(ids) == list(range(200))
        # a ranged GET's 429 pauses the process's requests to the server (io/budget.py), for Retry-After at least
        waits = [float(r.getMessage().rsplit(" for ", 1)[1].split()[0]) for r in caplog.records
                 if "HTTP 429" in r.getMessage()]
        assert waits and all(w >= 1.0 for w in waits), caplog.text     # Retry-After: 1, not the 0.01 s backoff


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_asks_the_hub_api_once_whatever_its_ranks(hub, tmp_path):
    """torchrun jobs of 1 and 3 ranks: rank 0 resolves the repo and indexes its files (file identities from
    datasets' folder listing, no paths-info request), the other ranks get the index over torch.distributed and read their row
    groups with one ranged GET each: the API requests do not grow with the ranks, nor with the files."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    from hub_requests import REPO as BENCH_REPO
    from hub_requests import job_requests

    hub.commit(BENCH_REPO, directory=hub.local)
    one = job_requests(hub, str(tmp_path / "home1"), "ours", 1, 150, str(tmp_path))
    three = job_requests(hub, str(tmp_path / "home3"), "ours", 3, 150, str(tmp_path))
    assert one["api"] == three["api"] <= 5, (one, three)
    # rank 0 reads every footer once and broadcasts them with the index; each rank then reads only its own
    # row groups: the job reads each footer once and each row group it consumes once
    footers = [r for r in hub.data_requests() if r.range and r.range.endswith(f"-{_size_of(hub, r.path) - 1}")]
    assert len(footers) == FILES, [(r.path, r.range) for r in footers]
    # the listings are datasets' (data/*.parquet), none per file; they carry the identities
    assert sum("/tree/" in r.path for r in hub.requests) <= 2
    assert sum("/paths-info/" in r.path for r in hub.requests) == 0


def _size_of(hub, url_path: str) -> int:
    rev, path = url_path.split("/resolve/", 1)[1].split("/", 1)
    return hub.repos[url_path.split("/")[2] + "/" + url_path.split("/")[3]].commit_of(rev).files[path].size


# ---------------------------------------------------------------------------- index, block cache, warmup
def _row_group_reads(hub) -> int:
    """Ranged reads of row groups (not footers: those end at the file's last byte)."""
    sizes = {b.oid: b.size for c in hub.repos[REPO].commits.values() for b in c.files.values()}
    ends = {str(s - 1) for s in sizes.values()}
    return sum(1 for r in hub.data_requests() if r.range and r.range.rsplit("-", 1)[1] not in ends)


@pytest.mark.slow
def test_warmup_fills_the_cache_and_a_second_run_reads_no_row_group(hub, tmp_path):
    cfg = hub_config(cache_dir=str(tmp_path / "cache"), index_path=str(tmp_path / "index.json"))
    reference = take_ids(ResumableStream(hub_config()), 400)
    config = write_yaml(tmp_path / "warm.yaml", **{k: v for k, v in cfg.to_dict().items() if v is not None})
    hub.reset_stats()
    warm = run_cli(hub, "warmup", config, "--samples", "400", "--no-progress")
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert _row_group_reads(hub) > 0

    hub.reset_stats()
    stream = ResumableStream(cfg)                                      # also writes the dataset index
    assert take_ids(stream, 400) == reference
    assert _row_group_reads(hub) == 0                                  # every row group from the cache
    assert (tmp_path / "index.json").is_file()
    # trusting the saved index (verify_files: false): not a single request to the Hub
    hub.reset_stats()
    assert take_ids(ResumableStream(cfg.replace(verify_files=False)), 400) == reference
    assert hub.requests == []


# ---------------------------------------------------------------------------- docs
def test_docs_hub_config_runs(hub, tmp_path):
    """The config of docs/hub.md (marker ``tested-config: hub``) streams from the loopback Hub as it is, with
    its cache directory moved under tmp_path."""
    page = (pathlib.Path(REPO_ROOT) / "docs" / "hub.md").read_text()
    block = page.split("<!-- tested-config: hub -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    doc = yaml.safe_load(block)
    doc["data"]["cache_dir"] = str(tmp_path / "cache")
    cfg = StreamConfig.from_dict(doc["data"])
    assert (cfg.dataset_name_or_path, cfg.data_files, cfg.revision) == (REPO, "data/*.parquet", "main")
    stream = ResumableStream(cfg)
    assert sorted(take_ids(stream, ROWS)) == [r["id"] for r in local_rows(hub.local)]
    assert stream.source.fingerprint["hub_commits"] == {REPO: hub.first_commit}


@pytest.mark.parametrize("path", ["parquet", "https://example.com/a.parquet", "."])
def test_revision_without_a_hub_repo_is_a_config_error(path):
    from resumable_stream import ConfigError

    with pytest.raises(ConfigError, match=r"data\.revision: got 'v1'.*a Hub repo id"):
        StreamConfig(dataset_name_or_path=path, data_files="x.parquet" if path == "parquet" else None,
                     revision="v1")
    assert StreamConfig(dataset_name_or_path="hf://org/data", revision="v1").revision == "v1"


def test_identities_from_datasets_listing_are_those_paths_info_gives(hub, tmp_path):
    """A stream's file identities come from the folder listing ``datasets`` made while resolving (no paths-info
    request), and they are exactly what a paths-info request answers for the same commit: size, blob id and
    LFS sha256. A file not in any listing is asked."""
    from huggingface_hub import HfFileSystem

    from resumable_stream.io.hub import file_identities, listed_identities

    hub.reset_stats()
    stream = ResumableStream(hub_config())
    assert not any("/paths-info/" in r.path for r in hub.requests)
    files = [f["path"] for f in stream.source.index["files"]]
    listed = listed_identities(files, {})
    asked = file_identities(files)
    assert set(listed) == set(files) and listed == asked
    assert all(i["sha256"] and i["blob_id"] and i["size"] > 0 for i in listed.values())
    assert [f["size"] for f in stream.source.index["files"]] == [asked[f]["size"] for f in files]
    HfFileSystem().invalidate_cache()
    assert listed_identities(files, {}) == {}
    hub.reset_stats()
    ResumableStream(hub_config(resume_state_path=None))
    assert not any("/paths-info/" in r.path for r in hub.requests)
