"""Mixtures on the job-level path: each source resolved and indexed once per job (rank 0, shared over
torch.distributed, or a saved index), every source's index saved with the checkpoint and verified on resume."""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
from http_server import FileServer
from repo_paths import REPO_ROOT
from training_helpers import free_port

from resumable_stream import ConfigError, SidecarError, StreamConfig, StreamMismatchError
from resumable_stream.app.cli import main as cli_main
from resumable_stream.sources.index import load_index
from resumable_stream.stream.mixture import MixtureStream, open_stream
from resumable_stream.testing import write_parquet_dataset

FAST = {"retries": 2, "retry_backoff_s": 0.02, "timeout_s": 5.0}


def _samples(stream, n: int) -> list[list]:
    """The next ``n`` samples, then the stream's fetches ahead stopped (so that counted requests are a step's)."""
    out = [[row["id"], row["text"]] for row in itertools.islice(stream, n)]
    stream.close()
    return out


def _count(requests) -> collections.Counter:
    return collections.Counter((r.method, "ranged" if r.range else "whole") for r in requests)


def _mixture(urls: dict[str, list[str]], **data) -> dict:
    """A ``data:`` section mixing the sources ``urls`` (label -> file URLs or paths), weights 2:1."""
    return {"shuffle": True, "buffer_size": 16, **FAST, **data, "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": files, "weight": 2 if i == 0 else 1}
        for i, (label, files) in enumerate(urls.items())]}


def _shrink(path: str) -> None:
    """Rewrite a parquet file with fewer rows (another size, footer and identity)."""
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows // 2), path, row_group_size=max(1, table.num_rows // 4))


@pytest.fixture
def two_sites(tmp_path):
    """Two parquet datasets (labels ``web``: 4 files, ``code.v2``: 3 files) served over loopback HTTP."""
    files = {"web": write_parquet_dataset(str(tmp_path / "d" / "web"), rows=400, files=4, row_group_size=25),
             "code.v2": write_parquet_dataset(str(tmp_path / "d" / "code"), rows=240, files=3, row_group_size=20)}
    with FileServer(tmp_path / "d") as srv:
        srv.files = files
        srv.urls = {label: [srv.url(os.path.relpath(p, tmp_path / "d")) for p in paths]
                    for label, paths in files.items()}
        yield srv


# ---------------------------------------------------------------------------- the checkpoint's indexes
def test_each_source_index_is_saved_in_the_checkpoint_and_reused_without_resolving(two_sites, tmp_path):
    cfg = StreamConfig.from_dict(_mixture(two_sites.urls))
    whole = _samples(MixtureStream(cfg, rank=0, world_size=1), 300)
    first = MixtureStream(cfg, rank=0, world_size=1)
    assert _samples(first, 120) == whole[:120]
    state = tmp_path / "ckpt" / "stream_state"
    first.save_sidecar(str(state))
    manifest = json.loads((state / "manifest.json").read_text())
    assert {label: e["file"] for label, e in manifest["indexes"].items()} == {
        "web": "index-web.bin", "code.v2": "index-code.v2.bin"}
    assert "index" not in manifest            # a mixture has no single index
    saved = load_index(str(state / "index-code.v2.bin"))
    assert [f["path"] for f in saved["files"]] == two_sites.urls["code.v2"]

    two_sites.reset_stats()     # a restart opens from the saved indexes: no resolution, no footer read
    resumed = MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt"), verify_files=False))
    assert two_sites.requests == []
    assert _samples(resumed, 180) == whole[120:]
    two_sites.reset_stats()     # verify_files (default): one identity request per file of each source
    open_stream(cfg, rank=0, world_size=1, index_from=str(tmp_path / "ckpt"))
    assert _count(two_sites.requests) == {("HEAD", "whole"): 7}

    # a second save into the directory: the next generation's indexes, the first ones removed
    resumed.save_sidecar(str(state))
    manifest = json.loads((state / "manifest.json").read_text())
    assert manifest["indexes"]["web"]["file"] == "index.g1-web.bin"
    assert sorted(f for f in os.listdir(state) if f.startswith("index")) == [
        "index.g1-code.v2.bin", "index.g1-web.bin"]

    # an index that no longer matches its manifest entry is refused, naming it
    path = state / "index.g1-web.bin"
    path.write_bytes(path.read_bytes().replace(b'"row_groups', b'"row_grouqs'))
    with pytest.raises(SidecarError, match="index.g1-web.bin"):
        MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "ckpt")))


def test_a_checkpoint_without_source_indexes_still_resumes(two_sites, tmp_path):
    """A mixture checkpoint written before mixtures saved their indexes: the sources are resolved."""
    cfg = StreamConfig.from_dict(_mixture(two_sites.urls))
    first = MixtureStream(cfg, rank=0, world_size=1)
    _samples(first, 50)
    first.save_sidecar(str(tmp_path / "state"))
    expected = _samples(first, 40)
    manifest_path = tmp_path / "state" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest.pop("indexes").values():
        os.remove(tmp_path / "state" / entry["file"])
    manifest_path.write_text(json.dumps(manifest))
    two_sites.reset_stats()
    resumed = MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "state")))
    assert _count(two_sites.requests) == {("GET", "ranged"): 7}   # resolved: identity and footer, one GET each
    assert _samples(resumed, 40) == expected


@pytest.mark.parametrize("entry", [{"file": "../index-web.json"}, {"file": "index-code.json"},
                                   {"file": "index-web.json", "bytes": -1}, "index-web.json"])
def test_a_manifest_naming_a_source_index_elsewhere_is_refused(two_sites, tmp_path, entry):
    cfg = StreamConfig.from_dict(_mixture(two_sites.urls))
    first = MixtureStream(cfg, rank=0, world_size=1)
    first.save_sidecar(str(tmp_path / "state"))
    manifest_path = tmp_path / "state" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    good = manifest["indexes"]["web"]
    manifest["indexes"]["web"] = {**good, **entry} if isinstance(entry, dict) else entry
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SidecarError, match=r"corrupt field indexes\['web'\]"):
        MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "state")))


@pytest.mark.parametrize("verify", [True, False])
def test_a_changed_file_in_one_source_is_caught_on_resume_naming_the_source_and_file(tmp_path, verify):
    files = {"web": write_parquet_dataset(str(tmp_path / "web"), rows=200, files=2, row_group_size=25),
             "code": write_parquet_dataset(str(tmp_path / "code"), rows=240, files=3, row_group_size=20)}
    cfg = StreamConfig.from_dict(_mixture(files))
    first = MixtureStream(cfg, rank=0, world_size=1)
    _samples(first, 30)
    first.save_sidecar(str(tmp_path / "state"))
    _shrink(files["code"][2])
    with pytest.raises(StreamMismatchError) as info:
        resumed = MixtureStream(cfg.replace(resume_state_path=str(tmp_path / "state"), verify_files=verify))
        _samples(resumed, 440)       # without verify_files: found when the file's footer is read
    assert "'code'" in str(info.value) and files["code"][2] in str(info.value), str(info.value)
    if verify:
        assert any(d[0].startswith(f"file resized: {files['code'][2]}") for d in info.value.differences)


# ---------------------------------------------------------------------------- data.sources[i].index_path
def test_each_source_has_its_own_index_path_written_once_then_reused(two_sites, tmp_path):
    section = _mixture(two_sites.urls, verify_files=False)
    for s in section["sources"]:
        s["index_path"] = str(tmp_path / f"{s['label']}.json")
    cfg = StreamConfig.from_dict(section)
    reference = _samples(MixtureStream(cfg, rank=0, world_size=1), 100)
    assert [f["path"] for f in json.loads((tmp_path / "web.json").read_text())["files"]] == two_sites.urls["web"]
    two_sites.reset_stats()
    again = MixtureStream(cfg, rank=0, world_size=1)
    assert two_sites.requests == []
    assert _samples(again, 100) == reference
    _shrink(two_sites.files["code.v2"][1])      # a given index that no longer matches: an error naming it
    with pytest.raises(StreamMismatchError, match=r"code\.v2\.json' \(source 'code\.v2'\) does not match the data"):
        MixtureStream(cfg.replace(verify_files=True), rank=0, world_size=1)


def test_index_path_next_to_sources_or_shared_by_two_sources_is_refused(tmp_path):
    urls = {"a": ["a.parquet"], "b": ["b.parquet"]}
    with pytest.raises(ConfigError, match=r"data\.index_path: got .* next to data\.sources.*data\.sources\[i\]"):
        StreamConfig.from_dict(_mixture(urls, index_path=str(tmp_path / "i.json")))
    section = _mixture(urls)
    for s in section["sources"]:
        s["index_path"] = str(tmp_path / "i.json")
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.index_path: got .*data\.sources\[0\] too"):
        StreamConfig.from_dict(section)


# ---------------------------------------------------------------------------- one resolution per job
_RANK_SCRIPT = textwrap.dedent("""
    import itertools, json, os, sys, urllib.request
    import torch.distributed as dist
    from resumable_stream import StreamConfig
    from resumable_stream.state.checkpoint import finish
    from resumable_stream.stream.mixture import MixtureStream
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    stream = MixtureStream(StreamConfig.from_dict(spec["data"]), rank=rank, world_size=world)
    dist.barrier()
    if rank == 0:       # a request that marks, in the server's records, where opening ended
        try:
            urllib.request.urlopen(spec["marker"], timeout=10)
        except OSError:
            pass
    dist.barrier()
    rows = lambda n: [[r["id"], r["text"]] for r in itertools.islice(stream, n)]
    taken = rows(6)
    state_dir = os.path.join(out, "ckpt", "stream_state")
    stream.save_sidecar(state_dir, manifest=False)
    dist.barrier()
    if rank == 0:
        finish(state_dir, world)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"shards": [len(s.shards) for s in stream.source.sources], "next": rows(6)}, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_four_ranks_open_a_two_source_mixture_with_one_request_per_file(tmp_path):
    """4 ranks, 2 sources of 24 remote files: rank 0 resolves and indexes each source (a HEAD and a footer
    read per file), the others get the indexes over gloo: O(files) requests, not O(ranks x files). A
    restart from the checkpoint the job saved makes no resolution request and continues rank 0 exactly;
    a file of one source changed since is a StreamMismatchError naming the source and the file."""
    per_source = 24
    for label in ("web", "code"):
        write_parquet_dataset(str(tmp_path / "d" / label), rows=per_source * 40, files=per_source, row_group_size=20)
    with FileServer(tmp_path / "d") as srv:
        urls = {label: [srv.url(f"{label}/part-{i:05d}.parquet") for i in range(per_source)]
                for label in ("web", "code")}
        section = _mixture(urls)
        (tmp_path / "spec.json").write_text(json.dumps({"data": section, "marker": srv.url("opened")}))
        (tmp_path / "rank.py").write_text(_RANK_SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p),
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                               str(tmp_path / "rank.py"), str(tmp_path / "spec.json"), str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
        assert [r["shards"] for r in ranks] == [[per_source * 2, per_source * 2]] * 4
        marker = next(i for i, r in enumerate(srv.requests) if r.path == "/opened")
        opening = srv.requests[:marker]
        files = 2 * per_source
        # each file's identity and footer in one GET of its last bytes (a suffix range)
        assert _count(opening) == {("GET", "ranged"): files}, _count(opening)
        assert sorted(r.path for r in opening if (r.range or "").startswith("bytes=-")) == sorted(
            f"/{label}/part-{i:05d}.parquet" for label in urls for i in range(per_source))

        cfg = StreamConfig.from_dict(section)
        ckpt = str(tmp_path / "ckpt")
        srv.reset_stats()
        resumed = MixtureStream(cfg.replace(resume_state_path=ckpt, verify_files=False), rank=0, world_size=4)
        assert srv.requests == []                         # opened from the indexes the job saved
        assert _samples(resumed, 6) == ranks[0]["next"]
        srv.reset_stats()
        MixtureStream(cfg.replace(resume_state_path=ckpt), rank=0, world_size=4)
        assert _count(srv.requests) == {("HEAD", "whole"): files}    # verify_files: identities only

        changed = tmp_path / "d" / "code" / "part-00007.parquet"
        _shrink(str(changed))
        with pytest.raises(StreamMismatchError) as info:
            MixtureStream(cfg.replace(resume_state_path=ckpt), rank=0, world_size=4)
        assert "'code'" in str(info.value) and urls["code"][7] in str(info.value), str(info.value)


# ---------------------------------------------------------------------------- the CLI: index, warmup
def _yaml(tmp_path, section: dict) -> str:
    path = tmp_path / "mix.yaml"
    path.write_text(json.dumps({"data": section}))      # JSON is yaml
    return str(path)


def test_index_command_writes_one_index_per_source_for_their_index_path(two_sites, tmp_path, capsys):
    section = _mixture(two_sites.urls)
    assert cli_main(["index", _yaml(tmp_path, section), "-o", str(tmp_path / "idx"), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["directory"] == str(tmp_path / "idx")
    assert {label: (s["index"], s["files"], s["rows"]) for label, s in summary["sources"].items()} == {
        "web": (str(tmp_path / "idx" / "web.json"), 4, 400), "code.v2": (str(tmp_path / "idx" / "code.v2.json"), 3, 240)}
    for s in section["sources"]:
        s["index_path"] = str(tmp_path / "idx" / f"{s['label']}.json")
    two_sites.reset_stats()
    MixtureStream(StreamConfig.from_dict({**section, "verify_files": False}), rank=0, world_size=1)
    assert two_sites.requests == []


def test_index_command_names_the_source_it_cannot_index(two_sites, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from resumable_stream.testing import synthetic_rows

    notes = str(tmp_path / "notes.csv")
    pacsv.write_csv(pa.table(synthetic_rows(0, 20)), notes)
    section = _mixture(two_sites.urls)
    section["sources"].append({"label": "notes", "dataset_name_or_path": "csv", "data_files": [notes]})
    assert cli_main(["index", _yaml(tmp_path, section), "-o", str(tmp_path / "idx"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data.sources[2].dataset_name_or_path" in err and "which has no dataset index" in err
    assert "(jsonl, parquet, webdataset; docs/formats.md)" in err and ".py" not in err
    assert not (tmp_path / "idx").exists()         # nothing written unless every source is indexed


def test_warmup_of_a_mixture_from_a_checkpoint_then_reading_makes_no_requests(two_sites, tmp_path, capsys):
    from resumable_stream.state.checkpoint import finish

    section = _mixture(two_sites.urls, block_rows=8, interleave_shards=1)
    cfg = StreamConfig.from_dict(section)
    ckpt = tmp_path / "checkpoint-3"
    state_dir = str(ckpt / "stream_state")
    references = []
    for rank in range(2):
        s = MixtureStream(cfg, rank=rank, world_size=2)
        _samples(s, 30 + 11 * rank)
        s.save_sidecar(state_dir, manifest=False)
        references.append(_samples(s, 90))
    finish(state_dir, 2)

    cached = {**section, "cache_dir": str(tmp_path / "cache")}
    assert cli_main(["warmup", _yaml(tmp_path, cached), "--resume-from", str(ckpt), "--samples", "90", "--no-progress"]) == 0
    assert "fetched" in capsys.readouterr().err
    for rank in range(2):
        s = MixtureStream(StreamConfig.from_dict(cached), rank=rank, world_size=2, index_from=str(ckpt))
        s.load_sidecar(str(ckpt))
        two_sites.reset_stats()
        assert _samples(s, 90) == references[rank]
        assert two_sites.requests == [], _count(two_sites.requests)
        assert s.source.stats()["misses"] == 0


def test_inspect_shows_and_checks_each_source_index(two_sites, tmp_path, capsys):
    first = MixtureStream(StreamConfig.from_dict(_mixture(two_sites.urls)), rank=0, world_size=1)
    _samples(first, 10)
    first.save_sidecar(str(tmp_path / "state"))
    assert cli_main(["inspect", str(tmp_path / "state")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["index"] is None
    assert shown["indexes"] == {"web": {"file": "index-web.bin", "files": 4, "row_groups": 16},
                                "code.v2": {"file": "index-code.v2.bin", "files": 3, "row_groups": 12}}
    (tmp_path / "state" / "index-web.bin").write_text("{}")
    assert cli_main(["inspect", str(tmp_path / "state")]) == 2
    assert "index-web.bin" in capsys.readouterr().err


# ---------------------------------------------------------------------------- trainer restarts
@pytest.mark.slow
def test_trainer_restart_of_a_mixture_reuses_the_indexes_saved_with_its_checkpoint(tmp_path):
    """``build_trainer`` opens a mixture knowing the checkpoint it will resume: a restart reuses each source's
    saved index (zero requests with verify_files off, one HEAD per file on) and ends where an uninterrupted
    run does."""
    import yaml

    from resumable_stream.app.train import build_trainer, resolve_resume
    from resumable_stream.config.trainer import TrainerConfig

    tiny = os.path.join(REPO_ROOT, "examples", "tiny")
    names = {"lm": "data", "notes": "data_notes"}
    files = {label: sorted(f for f in os.listdir(os.path.join(tiny, d)) if f.endswith(".parquet"))
             for label, d in names.items()}
    with FileServer(tiny) as srv:
        def config(name, max_steps, **data_keys):
            with open(os.path.join(tiny, "train_mix.yaml"), encoding="utf-8") as f:
                doc = yaml.safe_load(f)
            doc["data"].pop("consumed_log")
            for source in doc["data"]["sources"]:
                source["data_files"] = [srv.url(f"{names[source['label']]}/{f}") for f in files[source["label"]]]
            doc["data"].update(**FAST, **data_keys)
            doc["model"]["tokenizer"] = os.path.join(tiny, "tokenizer")
            doc["train"].update(output_dir=str(tmp_path / name), max_steps=max_steps, save_steps=2, logging_steps=1,
                                disable_tqdm=True)
            p = tmp_path / f"{name}-{max_steps}.yaml"
            p.write_text(yaml.safe_dump(doc))
            return TrainerConfig.from_yaml(str(p))

        def final_loss(trainer):
            return [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]

        whole = build_trainer(config("whole", 4))
        whole.train()
        first = build_trainer(config("cut", 2, verify_files=False))
        first.train()
        assert sorted(json.loads((tmp_path / "cut" / "checkpoint-2" / "stream_state" / "manifest.json").read_text())
                      ["indexes"]) == ["lm", "notes"]
        srv.reset_stats()
        restarted = build_trainer(config("cut", 4, verify_files=False))
        assert srv.requests == []                     # the mixture opened from checkpoint-2's indexes
        restarted.train(resume_from_checkpoint=resolve_resume(config("cut", 4), restarted))
        assert final_loss(restarted) == final_loss(whole)
        srv.reset_stats()
        build_trainer(config("cut", 4))               # verify_files (default): one identity request per file
        assert _count(srv.requests) == {("HEAD", "whole"): sum(map(len, files.values()))}
