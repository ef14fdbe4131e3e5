"""data.growth: append: files that appear join at the epoch after the furthest one begun, exactly, on resume."""

import collections
import itertools
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from growing_data import FILES, RG, ROWS, add, dataset

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.errors import ConfigError, StreamMismatchError
from resumable_stream.sources.index import load_index
from resumable_stream.state.checkpoint import finish
from resumable_stream.testing import synthetic_rows, write_parquet_dataset


def _cfg(d: str, **kw) -> StreamConfig:
    kw = {"shuffle": True, "buffer_size": 64, "interleave_shards": 2, "block_rows": 16, "growth": "append", **kw}
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(d, "*.parquet"), **kw)


def _ids(stream, n: int) -> list[int]:
    return [r["id"] for r in itertools.islice(stream, n)]


def _epoch(stream, epoch: int) -> list[int]:
    stream.set_epoch(epoch)
    return [r["id"] for r in stream]


def _save(streams, ckpt: str) -> str:
    for s in streams:
        s.save_sidecar(ckpt, manifest=False)
    finish(ckpt, streams[0].world_size)
    return ckpt


def _resume(cfg, ckpt: str, rank: int = 0, world_size: int = 1) -> ResumableStream:
    s = ResumableStream(cfg, rank=rank, world_size=world_size, index_from=ckpt)
    s.load_sidecar(ckpt)
    return s


def test_file_added_between_kill_and_resume_joins_at_the_next_epoch(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d)
    reference = _ids(ResumableStream(cfg), 2 * ROWS)        # the run without growth
    first = ResumableStream(cfg)
    head = _ids(first, 250)
    ckpt = _save([first], str(tmp_path / "ckpt"))
    new = add(d, "part-00009", 1000)                        # appears while the job is down
    resumed = _resume(cfg, ckpt)
    rest = _epoch(resumed, 0)
    assert head + rest == reference[:ROWS]                  # epoch 0 continues with epoch 0's files, exactly
    one = _epoch(resumed, 1)
    assert sorted(one) == sorted(list(range(ROWS)) + new)   # every row once, the new file's included
    assert one != reference[ROWS:]
    # the generation is in the checkpoint's index: a second resume in the middle of epoch 1 replays it
    again = ResumableStream(cfg, index_from=ckpt)
    again.load_sidecar(ckpt)
    _epoch(again, 0)
    again.set_epoch(1)
    mid = _ids(again, 170)
    ckpt2 = _save([again], str(tmp_path / "ckpt2"))
    add(d, "part-00010", 2000)                              # more arrive: they wait for epoch 2
    third = _resume(cfg, ckpt2)
    assert mid + _epoch(third, 1) == one
    assert sorted(_epoch(third, 2)) == sorted(list(range(ROWS)) + new + list(range(2000, 2100)))


def test_file_added_during_an_epoch_waits_for_the_next_one(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d)
    s = ResumableStream(cfg)
    head = _ids(s, 100)
    add(d, "part-00009", 1000)                  # written while the stream reads epoch 0
    head += _ids(s, 100)
    ckpt = _save([s], str(tmp_path / "ckpt"))
    resumed = _resume(cfg, ckpt)
    epoch0 = head + _epoch(resumed, 0)
    assert sorted(epoch0) == list(range(ROWS))
    assert len(_epoch(resumed, 1)) == ROWS + 100


def test_growth_off_is_todays_order_and_append_without_new_files_too(tmp_path):
    d = dataset(tmp_path)
    off = _ids(ResumableStream(_cfg(d, growth="off")), 2 * ROWS)
    assert _ids(ResumableStream(_cfg(d)), 2 * ROWS) == off


def test_every_row_once_per_epoch_across_4_ranks_and_elastic_to_2(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, num_partitions=4, elastic=True)
    ranks = [ResumableStream(cfg, rank=r, world_size=4) for r in range(4)]
    heads = [_ids(s, 30 + 10 * r) for r, s in enumerate(ranks)]
    ckpt = _save(ranks, str(tmp_path / "ckpt"))
    new = add(d, "part-00009", 1000) + add(d, "part-00010", 2000)
    for world in (4, 2):     # the same job resumed on 4 ranks, then (elastic) on 2
        resumed = [_resume(cfg, ckpt, r, world) for r in range(world)]
        epoch0 = collections.Counter(itertools.chain(*heads, *(_epoch(s, 0) for s in resumed)))
        assert sorted(epoch0) == list(range(ROWS)) and set(epoch0.values()) == {1}
        epoch1 = collections.Counter(itertools.chain(*(_epoch(s, 1) for s in resumed)))
        assert sorted(epoch1) == sorted(list(range(ROWS)) + new) and set(epoch1.values()) == {1}


def test_removed_file_is_a_mismatch_unless_allowed(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d, shuffle=False)          # files in order: the first is read completely by row 100
    s = ResumableStream(cfg)
    head = _ids(s, 150)
    ckpt = _save([s], str(tmp_path / "ckpt"))
    gone = os.path.join(d, "part-00000.parquet")
    os.unlink(gone)
    with pytest.raises(StreamMismatchError, match="part-00000.parquet") as e:
        _resume(cfg, ckpt)
    assert ("file removed: " + gone) in [k for k, _, _ in e.value.differences]
    allowed = _cfg(d, shuffle=False, growth_allow_removal=True)
    resumed = _resume(allowed, ckpt)
    assert head + _epoch(resumed, 0) == list(range(ROWS))       # epoch 0 had read it already
    assert _epoch(resumed, 1) == list(range(100, ROWS))         # dropped from epoch 1 on
    # a dropped file that comes back under its path stays dropped (the index lists it so): not read again
    ckpt2 = _save([resumed], str(tmp_path / "ckpt2"))
    add(d, "part-00000", 0, 100)
    back = _resume(allowed, ckpt2)
    assert _epoch(back, 2) == list(range(100, ROWS))


def test_changed_file_already_read_is_a_mismatch(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d)
    s = ResumableStream(cfg)
    _ids(s, 50)
    ckpt = _save([s], str(tmp_path / "ckpt"))
    path = os.path.join(d, "part-00001.parquet")
    pq.write_table(pa.table(synthetic_rows(5000, 100)), path, row_group_size=RG)
    add(d, "part-00009", 1000)
    with pytest.raises(StreamMismatchError, match="part-00001.parquet"):
        _resume(cfg, ckpt)


def test_new_file_with_other_columns_is_a_mismatch(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d)
    s = ResumableStream(cfg)
    _ids(s, 50)
    ckpt = _save([s], str(tmp_path / "ckpt"))
    pq.write_table(pa.table({"id": [1, 2], "other": ["a", "b"]}), os.path.join(d, "part-00009.parquet"))
    with pytest.raises(StreamMismatchError, match="part-00009.parquet"):
        _resume(cfg, ckpt)


def test_inspect_shows_each_epochs_file_set(tmp_path, capsys):
    from resumable_stream.app.cli import main

    d = dataset(tmp_path)
    cfg = _cfg(d)
    s = ResumableStream(cfg)
    _ids(s, 50)
    ckpt = _save([s], str(tmp_path / "ckpt"))
    add(d, "part-00009", 1000)
    resumed = _resume(cfg, ckpt)
    _ids(resumed, 10)
    ckpt2 = _save([resumed], str(tmp_path / "ckpt2"))
    capsys.readouterr()
    assert main(["inspect", ckpt2]) == 0
    gens = json.loads(capsys.readouterr().out)["index"]["generations"]
    assert [(g["from_epoch"], g["files"], len(g["added"])) for g in gens] == [(0, 4, 4), (1, 5, 1)]
    assert gens[1]["added"] == [os.path.join(d, "part-00009.parquet")]


def test_forged_generations_are_refused(tmp_path):
    from resumable_stream.dataset.growth import generations
    from resumable_stream.errors import SourceError

    index = {"files": [{"path": "a"}, {"path": "b"}]}
    assert generations(index) == [{"from_epoch": 0, "files": 2, "dropped": []}]
    for bad in ({"generations": []}, {"generations": [{"from_epoch": 1, "files": 2, "dropped": []}]},
                {"generations": [{"from_epoch": 0, "files": 3, "dropped": []}]},
                {"generations": [{"from_epoch": 0, "files": 1, "dropped": []},
                                 {"from_epoch": 0, "files": 2, "dropped": []}]},
                {"generations": [{"from_epoch": 0, "files": 2, "dropped": ["zzz"]}]}, "x"):
        with pytest.raises(SourceError, match="growth"):
            generations({**index, "growth": bad})


def test_config_keys():
    with pytest.raises(ConfigError, match="data.growth: got 'sometimes'"):
        StreamConfig(dataset_name_or_path="parquet", data_files="x/*.parquet", growth="sometimes")
    with pytest.raises(ConfigError, match="data.growth_allow_removal"):
        StreamConfig(dataset_name_or_path="parquet", data_files="x/*.parquet", growth_allow_removal="yes")
    with pytest.raises(ConfigError, match="data.growth"):
        StreamConfig(dataset_name_or_path="x", backend="local", growth="append")


def _two_source_mixture(tmp_path) -> tuple[str, StreamConfig]:
    """A growing mixture of source a (the dataset(), ids 0..ROWS-1) and b (300 rows, ids 10,000..10,299); a's
    directory and the config."""
    a = dataset(tmp_path)
    b = str(tmp_path / "b")
    os.makedirs(b)
    pq.write_table(pa.table(synthetic_rows(10_000, 300)), os.path.join(b, "b-00000.parquet"), row_group_size=RG)
    data = {"shuffle": True, "buffer_size": 32, "growth": "append", "stopping": "never", "sources": [
        {"label": "a", "dataset_name_or_path": "parquet", "data_files": os.path.join(a, "*.parquet")},
        {"label": "b", "dataset_name_or_path": "parquet", "data_files": os.path.join(b, "*.parquet")}]}
    return a, StreamConfig.from_dict(data)


def test_mixture_sources_grow_independently(tmp_path):
    from resumable_stream.stream.mixture import MixtureStream

    a, cfg = _two_source_mixture(tmp_path)
    first = MixtureStream(cfg, rank=0, world_size=1)
    head = _ids(first, 300)
    first.save_sidecar(str(tmp_path / "ckpt" / "stream_state"))
    new = add(a, "part-00009", 1000)
    resumed = MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt")), rank=0, world_size=1)
    rest = _ids(resumed, 2400)
    from_a = [i for i in head + rest if i < 10_000]
    assert sorted(from_a[:ROWS]) == list(range(ROWS))                            # a's epoch 0: as it was
    assert sorted(from_a[ROWS:2 * ROWS + 100]) == sorted(list(range(ROWS)) + new)   # epoch 1: grown
    from_b = [i for i in head + rest if i >= 10_000]
    assert sorted(from_b[:300]) == sorted(from_b[300:600]) == list(range(10_000, 10_300))   # b: unchanged


def test_mixture_refresh_files_while_running_grows_each_source_at_its_next_epoch_and_resumes_exactly(tmp_path):
    """A file appended to one source of a running mixture (refresh_files, as the trainer calls at a save) joins
    at that source's next epoch, in that source's index only; a state saved after it resumes exactly."""
    from resumable_stream.dataset.growth import generations
    from resumable_stream.stream.mixture import MixtureStream

    a, cfg = _two_source_mixture(tmp_path)
    s = MixtureStream(cfg, rank=0, world_size=1)
    head = _ids(s, 300)
    assert s.refresh_files() is None                                 # nothing new
    new = add(a, "part-00009", 1000)
    joins = s.refresh_files()
    assert joins == {"a": 1}                                         # a's next epoch; b did not grow
    assert [g["from_epoch"] for g in generations(s.source.sources[0].index)] == [0, 1]
    assert len(generations(s.source.sources[1].index)) == 1
    mid = _ids(s, 300)
    ckpt = str(tmp_path / "ckpt" / "stream_state")
    s.save_sidecar(ckpt)
    saved = load_index(os.path.join(ckpt, "index-a.bin"))          # the grown index is the checkpoint's
    assert len(saved["files"]) == FILES + 1 and len(saved["growth"]["generations"]) == 2
    rest = _ids(s, 1500)
    from_a = [i for i in head + mid + rest if i < 10_000]
    assert sorted(from_a[:ROWS]) == list(range(ROWS))                            # a's epoch 0: as planned
    assert sorted(from_a[ROWS:2 * ROWS + 100]) == sorted(list(range(ROWS)) + new)   # epoch 1: with the new file
    from_b = [i for i in head + mid + rest if i >= 10_000]
    assert sorted(from_b[:300]) == sorted(from_b[300:600]) == list(range(10_000, 10_300))   # b: unchanged
    resumed = MixtureStream(cfg, rank=0, world_size=1, index_from=ckpt)
    resumed.load_sidecar(ckpt)
    assert _ids(resumed, 1500) == rest                               # exact across the growth boundary


@pytest.mark.slow      # a loopback Hub: ~5 s
def test_hub_branch_commit_adding_files_joins_at_the_next_epoch(tmp_path):
    from hub_server import HubServer, use_hub

    from resumable_stream.dataset.growth import describe

    repo = "org/growing"
    src = tmp_path / "repo"
    write_parquet_dataset(str(src / "data"), rows=ROWS, files=FILES, row_group_size=RG)
    with HubServer(tmp_path / "hub-store") as hub:
        hub.create_repo(repo)
        first_commit = hub.commit(repo, directory=src, message="initial")
        with use_hub(hub, tmp_path / "hf-home"):
            cfg = StreamConfig(dataset_name_or_path=repo, data_files="data/*.parquet", shuffle=True,
                               buffer_size=64, growth="append", prefetch_blocks=0)
            reference = _ids(ResumableStream(cfg), ROWS)
            first = ResumableStream(cfg)
            head = _ids(first, 250)
            ckpt = _save([first], str(tmp_path / "ckpt"))
            more = tmp_path / "more"
            more.mkdir()
            add(str(more), "x", 1000)
            new_commit = hub.commit(repo, files={"data/part-00009.parquet": str(more / "x.parquet")}, message="more")
            hub.reset_stats()
            resumed = _resume(cfg, ckpt)
            # the branch resolved again; the files read so far and the new one checked at the new commit from
            # the folder listing datasets' resolution made (no paths-info request), only the new file's footer read
            assert sum("/paths-info/" in r.path for r in hub.requests) == 0
            assert sum("/tree/" in r.path for r in hub.requests) >= 1
            footers = [r.path for r in hub.data_requests() if r.range]
            assert footers and all("part-00009" in p for p in footers)
            assert head + _epoch(resumed, 0) == reference
            one = _epoch(resumed, 1)
            assert sorted(one) == sorted(list(range(ROWS)) + list(range(1000, 1100)))
            assert resumed.fingerprint()["dataset"]["hub_commits"] == {repo: first_commit}
            gens = describe(resumed.source.index)
            assert [g.get("hub_commits") for g in gens] == [{repo: first_commit}, {repo: new_commit}]
            # a commit that rewrites a file already read is a mismatch naming it
            ckpt2 = _save([resumed], str(tmp_path / "ckpt2"))
            pq.write_table(pa.table(synthetic_rows(5000, 100)), str(more / "y.parquet"), row_group_size=RG)
            hub.commit(repo, files={"data/part-00001.parquet": str(more / "y.parquet")}, message="rewrite")
            with pytest.raises(StreamMismatchError, match="part-00001.parquet"):
                _resume(cfg, ckpt2)


def test_hub_commit_without_data_files_costs_one_request_from_the_refresh_after(tmp_path):
    """A running job's refresh after a commit that only touches a README resolves the branch in full once
    (nothing joins; no paths-info: the listing carries the identities); the refreshes after it are one repo-info
    request again, and a later commit adding a file still joins."""
    from hub_server import HubServer, use_hub

    repo = "org/growing"
    src = tmp_path / "repo"
    write_parquet_dataset(str(src / "data"), rows=ROWS, files=FILES, row_group_size=RG)
    with HubServer(tmp_path / "hub-store") as hub:
        hub.create_repo(repo)
        hub.commit(repo, directory=src, message="initial")
        with use_hub(hub, tmp_path / "hf-home"):
            cfg = StreamConfig(dataset_name_or_path=repo, data_files="data/*.parquet", shuffle=True,
                               buffer_size=64, growth="append", prefetch_blocks=0)
            stream = ResumableStream(cfg)
            head = _ids(stream, 50)
            info = ("GET", f"/api/datasets/{repo}")
            hub.reset_stats()
            assert stream.refresh_files() is None
            assert [(r.method, r.path) for r in hub.requests] == [info]       # unmoved: one request

            hub.commit(repo, files={"README.md": b"# growing\n"}, message="docs")
            hub.reset_stats()
            assert stream.refresh_files() is None
            moved = list(hub.requests)
            assert len(moved) > 1 and any("/tree/" in r.path for r in moved)   # resolved in full once
            assert not any("/paths-info/" in r.path for r in moved) and not any(r.range for r in moved)
            hub.reset_stats()
            assert stream.refresh_files() is None
            assert [(r.method, r.path) for r in hub.requests] == [info]       # that commit is known now

            more = tmp_path / "more"
            more.mkdir()
            new = add(str(more), "x", 1000)
            hub.commit(repo, files={"data/part-00009.parquet": str(more / "x.parquet")}, message="more")
            assert stream.refresh_files() == 1
            assert sorted(head + _epoch(stream, 0)) == list(range(ROWS))
            assert sorted(_epoch(stream, 1)) == sorted(list(range(ROWS)) + new)


_RANK_SCRIPT = """
import itertools, json, os, sys
import torch.distributed as dist
from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.state.checkpoint import finish

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"), shuffle=True,
                   buffer_size=64, interleave_shards=2, block_rows=16, growth="append")
ckpt = os.path.join(out, "ckpt", "stream_state")
result = {}
if phase == "first":
    stream = ResumableStream(cfg, rank=rank, world_size=world)
    result["head"] = [r["id"] for r in itertools.islice(stream, 30 + 10 * rank)]
    stream.save_sidecar(ckpt, manifest=False)
    dist.barrier()
    if rank == 0:
        finish(ckpt, world)
elif phase == "live":      # files arrive while the job runs: taken in by refresh_files, collectively
    stream = ResumableStream(cfg, rank=rank, world_size=world)
    result["head"] = [r["id"] for r in itertools.islice(stream, 30 + 10 * rank)]
    dist.barrier()
    if rank == 0:
        staging = os.environ["GROWTH_STAGING"]
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(data, name))
    dist.barrier()
    result["from_epoch"] = stream.refresh_files()
    result["generations"] = stream.source.index["growth"]["generations"]
    stream.set_epoch(0)
    result["epoch0"] = [r["id"] for r in stream]
    stream.set_epoch(1)
    result["epoch1"] = [r["id"] for r in stream]
else:
    stream = ResumableStream(cfg, rank=rank, world_size=world, index_from=ckpt)
    stream.load_sidecar(ckpt)
    result["files"] = len(stream.source.index["files"])
    result["generations"] = stream.source.index["growth"]["generations"]
    stream.set_epoch(0)
    result["epoch0"] = [r["id"] for r in stream]
    stream.set_epoch(1)
    result["epoch1"] = [r["id"] for r in stream]
with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_four_ranks_rank_0_grows_the_index_and_every_row_is_read_once_per_epoch(tmp_path):
    """4 processes over gloo: the first run saves mid-epoch 0; two files appear; the resumed job's rank 0 checks
    and grows the index and broadcasts it: every rank plans with the same generations, epoch 0 ends with its
    4 files, epoch 1 reads all 6, each row exactly once across the ranks."""
    import subprocess
    import sys

    from training_helpers import free_port

    d = dataset(tmp_path)
    (tmp_path / "rank.py").write_text(_RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    staging = tmp_path / "staging"
    staging.mkdir()
    env["GROWTH_STAGING"] = str(staging)

    def run(phase: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                               str(tmp_path / "rank.py"), d, str(tmp_path), phase],
                              env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads((tmp_path / f"{phase}-{r}.json").read_text()) for r in range(4)]

    heads = [r["head"] for r in run("first")]
    new = add(d, "part-00009", 1000) + add(d, "part-00010", 2000)
    resumed = run("resume")
    assert {r["files"] for r in resumed} == {FILES + 2}
    assert all(r["generations"] == resumed[0]["generations"] for r in resumed)
    assert [g["from_epoch"] for g in resumed[0]["generations"]] == [0, 1]
    epoch0 = collections.Counter(itertools.chain(*heads, *(r["epoch0"] for r in resumed)))
    assert sorted(epoch0) == list(range(ROWS)) and set(epoch0.values()) == {1}
    epoch1 = collections.Counter(itertools.chain(*(r["epoch1"] for r in resumed)))
    assert sorted(epoch1) == sorted(list(range(ROWS)) + new) and set(epoch1.values()) == {1}
    # the same job once more, the files arriving while it runs: refresh_files on every rank
    for name in ("part-00009", "part-00010"):
        os.unlink(os.path.join(d, f"{name}.parquet"))
    later = add(str(staging), "part-00011", 3000)
    live = run("live")
    assert {r["from_epoch"] for r in live} == {1}
    assert all(r["generations"] == live[0]["generations"] for r in live)
    epoch0 = collections.Counter(itertools.chain(*(r["head"] + r["epoch0"] for r in live)))
    assert sorted(epoch0) == list(range(ROWS)) and set(epoch0.values()) == {1}
    epoch1 = collections.Counter(itertools.chain(*(r["epoch1"] for r in live)))
    assert sorted(epoch1) == sorted(list(range(ROWS)) + later) and set(epoch1.values()) == {1}


def test_refresh_files_while_running_joins_after_the_furthest_epoch_and_resumes_exactly(tmp_path):
    d = dataset(tmp_path)
    cfg = _cfg(d)
    reference = _ids(ResumableStream(cfg), ROWS)
    s = ResumableStream(cfg)
    head = _ids(s, 250)
    assert s.refresh_files() is None                     # nothing new
    new = add(d, "part-00009", 1000)
    assert s.refresh_files() == 1                        # joins at the next epoch
    assert head + _epoch(s, 0) == reference              # the running epoch keeps its plan
    s.set_epoch(1)
    mid = _ids(s, 200)
    ckpt = _save([s], str(tmp_path / "ckpt"))            # the grown index is the checkpoint's
    rest = [r["id"] for r in s]
    assert sorted(mid + rest) == sorted(list(range(ROWS)) + new)
    resumed = _resume(cfg, ckpt)
    assert _epoch(resumed, 1) == rest
    with pytest.raises(ConfigError, match="DataLoader workers"):
        ResumableStream(cfg, num_workers=2).refresh_files()
    with pytest.raises(ConfigError, match="torch.distributed"):
        ResumableStream(cfg, rank=0, world_size=2).refresh_files()


def test_webdataset_tars_grow_and_a_tar_with_other_members_is_a_mismatch(tmp_path):
    """A tar added to a growing webdataset joins at the next epoch (its features are inferred from its first
    samples, as the index's were; the footer-only path raised 'its features are unknown' for every new tar)."""
    from wds_data import mixed_samples, text_samples, write_tar, write_tars

    d = tmp_path / "d"
    write_tars(d, 2, 20)
    cfg = StreamConfig(dataset_name_or_path="webdataset", data_files=str(d / "*.tar"), growth="append",
                       shuffle=False)
    first = ResumableStream(cfg)
    head = [r["__key__"] for r in itertools.islice(first, 10)]
    ckpt = _save([first], str(tmp_path / "ckpt"))
    write_tar(str(d / "z9.tar"), text_samples(9, 20))
    resumed = _resume(cfg, ckpt)
    resumed.set_epoch(0)
    assert len(head) + len(list(resumed)) == 40
    resumed.set_epoch(1)
    assert len(list(resumed)) == 60
    write_tar(str(d / "z8.tar"), mixed_samples(8, 5))          # a tar of other members
    with pytest.raises(StreamMismatchError, match="z8.tar.* its columns"):
        _resume(cfg, ckpt)


_HUB_RANK_SCRIPT = """
import itertools, json, os, sys, time
import torch.distributed as dist
from resumable_stream import ResumableStream, StreamConfig

def wait_for(name):
    while not os.path.exists(os.path.join(out, name)):
        time.sleep(0.02)

def signal(name):
    if rank == 0:
        open(os.path.join(out, name), "w").close()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
repo, out = sys.argv[1], sys.argv[2]
cfg = StreamConfig(dataset_name_or_path=repo, data_files="data/*.parquet", shuffle=True, buffer_size=64,
                   growth="append", prefetch_blocks=0)
stream = ResumableStream(cfg, rank=rank, world_size=world)
head = [r["id"] for r in itertools.islice(stream, 20)]
dist.barrier()
signal("opened"); wait_for("committed")
first = stream.refresh_files()
dist.barrier()
signal("refreshed"); wait_for("again")
second = stream.refresh_files()
dist.barrier()
signal("refreshed-again"); wait_for("read")
stream.set_epoch(1)
epoch1 = [r["id"] for r in stream]
with open(os.path.join(out, f"hub-{rank}.json"), "w") as f:
    json.dump({"first": first, "second": second, "epoch1": epoch1}, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_hub_refresh_asks_the_hub_once_per_job(tmp_path):
    """2 ranks over gloo on the loopback Hub: at refresh_files only rank 0 asks (the index is broadcast); a
    branch that moved costs the same requests as for one process (datasets' resolution, whose listing carries
    the identities: no paths-info; the new file's footer only); a branch that has not moved costs one repo-info
    request per job."""
    import subprocess
    import sys
    import time

    from hub_server import HubServer, use_hub
    from training_helpers import free_port

    repo = "org/growing"
    src = tmp_path / "repo"
    write_parquet_dataset(str(src / "data"), rows=ROWS, files=FILES, row_group_size=RG)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "rank.py").write_text(_HUB_RANK_SCRIPT)

    def wait_for(name: str, proc) -> None:
        deadline = time.monotonic() + 180
        while not (out / name).exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {name}"
            time.sleep(0.05)

    with HubServer(tmp_path / "hub-store") as hub:
        hub.create_repo(repo)
        hub.commit(repo, directory=src, message="initial")
        with use_hub(hub, tmp_path / "hf-home"):
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                                     str(tmp_path / "rank.py"), repo, str(out)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for("opened", proc)
                more = tmp_path / "more"
                more.mkdir()
                new = add(str(more), "x", 1000)
                hub.commit(repo, files={"data/part-00009.parquet": str(more / "x.parquet")}, message="more")
                hub.reset_stats()
                (out / "committed").touch()
                wait_for("refreshed", proc)
                moved = list(hub.requests)
                hub.reset_stats()
                (out / "again").touch()
                wait_for("refreshed-again", proc)
                unmoved = list(hub.requests)
                (out / "read").touch()
                _, err = proc.communicate(timeout=180)
                assert proc.returncode == 0, err[-3000:]
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    results = [json.loads((out / f"hub-{r}.json").read_text()) for r in range(2)]
    assert [r["first"] for r in results] == [1, 1] and [r["second"] for r in results] == [None, None]
    info = f"/api/datasets/{repo}"
    assert sum(r.method == "GET" and r.path == info for r in moved) == 2      # ours + datasets' resolution: once
    assert sum("/paths-info/" in r.path for r in moved) == 0
    footers = [r.path for r in moved if "/resolve/" in r.path and r.range]
    assert footers and all("part-00009" in p for p in footers)
    assert [(r.method, r.path) for r in unmoved] == [("GET", info)]      # one repo-info request, nothing else
    epoch1 = collections.Counter(itertools.chain(*(r["epoch1"] for r in results)))
    assert sorted(epoch1) == sorted(list(range(ROWS)) + new) and set(epoch1.values()) == {1}


# ---------------------------------------------------------------------------- a state a trainer keeps itself
def test_a_state_a_trainer_keeps_carries_the_index_and_the_files_since_join_at_the_next_epoch(tmp_path):
    """DCP, accelerate, Lightning keep StreamLoader.state_dict() in their own checkpoints, with no stream_state
    directory to hold the index of a growing dataset: the state carries it. A file that appeared between the
    save and the resume joins at the epoch after the furthest begun, exactly as through a checkpoint directory;
    an index too large to carry is refused when the state is written."""
    import torch

    from resumable_stream.loader import StreamLoader
    from resumable_stream.state import job_state
    from resumable_stream.state.job_state import decode_state_dict

    d = dataset(tmp_path)
    cfg = _cfg(d, num_partitions=2)

    def loader():
        return StreamLoader(ResumableStream(cfg), 10, collate_fn=lambda rows: [r["id"] for r in rows])

    reference = [i for b in itertools.islice(loader(), 2 * ROWS // 10) for i in b]
    first = loader()
    head = [i for b in itertools.islice(first, 25) for i in b]
    saved = torch.load(_saved(first.state_dict(), tmp_path), weights_only=True)   # as a trainer keeps it
    assert set(decode_state_dict(saved, "x")["indexes"]) == {None}
    new = add(d, "part-00009", 1000)                        # appears while the job is down
    resumed = loader()
    resumed.load_state_dict(saved)
    rest = [i for b in itertools.islice(resumed, (ROWS - 250) // 10) for i in b]
    assert head + rest == reference[:ROWS]                  # epoch 0 continues with epoch 0's files, exactly
    one = [i for b in itertools.islice(resumed, (ROWS + len(new)) // 10) for i in b]
    assert sorted(one) == sorted(list(range(ROWS)) + new)   # epoch 1: every row once, the new file's included
    # what a checkpoint directory gives for the same save
    ckpt = str(tmp_path / "ckpt")
    first.save_sidecar(ckpt)
    through_dir = StreamLoader(ResumableStream(cfg, index_from=ckpt), 10, collate_fn=lambda rows: [r["id"] for r in rows])
    through_dir.load_sidecar(ckpt)
    assert [i for b in itertools.islice(through_dir, (ROWS - 250) // 10 + (ROWS + len(new)) // 10)
            for i in b] == rest + one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job_state, "MAX_CARRIED_INDEX_BYTES", 100)
        with pytest.raises(ConfigError, match="data.growth: the state of a growing dataset carries its index.*Checkpoints"):
            loader().state_dict()


def _saved(state: dict, tmp_path) -> str:
    import torch

    path = str(tmp_path / "trainer_state.pt")
    torch.save(state, path)
    return path
