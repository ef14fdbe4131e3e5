"""The source registry, kept honest by docs/internals.md: the toy format "How to add a source" shows is
written out of the page, registered as the page says, and must pass the exact-resume checks (shuffled, several
partitions, saves and resumes at random points, a SIGKILL, an elastic re-partition), be indexed by
``resumable-stream index`` and be verified on resume like parquet."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
from helpers import seeded_rng, take_ids, through_sidecar
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, ResumableStream, StreamConfig, StreamMismatchError
from resumable_stream.config import formats as registry
from resumable_stream.errors import SourceError
from resumable_stream.sources import open_source
from resumable_stream.sources.index import load_index, save_index
from resumable_stream.state.checkpoint import write_manifest

ROOT = REPO_ROOT
FILES, LINES = 4, 150          # 600 rows; shards of 64 lines: 3 per file (64, 64, 22), 12 in all
ROWS = FILES * LINES


def doc_blocks() -> tuple[str, str]:
    """The module and the registry entry of the section "How to add a source" (its two python blocks)."""
    with open(os.path.join(ROOT, "docs", "internals.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## How to add a source", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and blocks[0].startswith("# lines_source.py\n"), "the section's python blocks moved"
    return blocks[0], blocks[1]


@pytest.fixture(scope="module")
def lines_format(tmp_path_factory):
    module, entry = doc_blocks()
    where = tmp_path_factory.mktemp("plugin")
    (where / "lines_source.py").write_text(module)
    sys.path.insert(0, str(where))
    try:
        exec(compile(entry, "docs/internals.md (registry entry)", "exec"), {})
        yield str(where)
    finally:
        registry.unregister("lines")
        sys.modules.pop("lines_source", None)
        sys.path.remove(str(where))


@pytest.fixture(scope="module")
def lines_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("lines")
    for k in range(FILES):
        (d / f"part-{k}.lines").write_text("".join(f"{k * LINES + i}\n" for i in range(LINES)))
    return str(d)


def lines_config(directory: str, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="lines", data_files=os.path.join(directory, "*.lines"), **kw)


def ids_of(stream, n):
    return [int(x) for x in take_ids(stream, n, column="line")]


def test_the_doc_module_is_registered_and_reads_every_line(lines_format, lines_data):
    src = open_source(lines_config(lines_data).source_spec)
    assert type(src).__name__ == "LinesSource" and src.index["reader"] == "lines"
    assert [s.num_rows for s in src.shards] == [64, 64, 22] * FILES
    assert src.fingerprint["builder"] == "lines" and len(src.fingerprint["files"]) == FILES
    assert "shards" not in src.fingerprint["files"][0] and "digest" in src.fingerprint["files"][0]
    assert sorted(ids_of(ResumableStream(lines_config(lines_data), source=src), ROWS)) == list(range(ROWS))
    # a single file by its extension needs no builder name
    one = StreamConfig(dataset_name_or_path=os.path.join(lines_data, "part-1.lines"))
    assert sorted(ids_of(ResumableStream(one), LINES)) == list(range(LINES, 2 * LINES))


@pytest.mark.parametrize("world_size,interleave", [(1, 2), (2, 1), (3, 2)])
def test_exact_resume_at_random_points(lines_format, lines_data, world_size, interleave):
    cfg = lines_config(lines_data, shuffle=True, buffer_size=50, interleave_shards=interleave, num_partitions=6)
    src = open_source(cfg.source_spec)
    rng = seeded_rng(f"lines-resume-{world_size}-{interleave}")
    for rank in range(world_size):
        def make():
            return ResumableStream(cfg, rank=rank, world_size=world_size, source=src)  # noqa: B023

        per_rank = ROWS // world_size
        reference = ids_of(make(), per_rank)
        assert reference != sorted(reference)                       # shuffled
        for stop in sorted(rng.sample(range(1, per_rank - 1), 4)):
            first = make()
            head = ids_of(first, stop)
            resumed = make()
            resumed.load_state_dict(through_sidecar(first.state_dict()))
            assert head + ids_of(resumed, per_rank - stop) == reference, (rank, stop)
    every = []
    for rank in range(world_size):                                  # the epoch: each row once over the ranks
        s = ResumableStream(cfg, rank=rank, world_size=world_size, source=src)
        s.set_epoch(0)
        every += [int(row["line"]) for row in s]
    assert sorted(every) == list(range(ROWS))


def test_elastic_re_partition_reads_each_row_once(lines_format, lines_data, tmp_path):
    cfg = lines_config(lines_data, shuffle=True, buffer_size=40, num_partitions=6, elastic=True)
    src = open_source(cfg.source_spec)
    rng = seeded_rng("lines-elastic")
    ids, resume_from = [], None
    for step, world in enumerate((2, 3)):
        state_dir = str(tmp_path / f"step{step}")
        for rank in range(world):
            s = ResumableStream(cfg, rank=rank, world_size=world, source=src)
            if resume_from:
                s.load_sidecar(resume_from)
            s.set_epoch(0)
            ids += ids_of(s, rng.randrange(0, 60))
            s.save_sidecar(state_dir)
        write_manifest(state_dir, world)
        resume_from = state_dir
    for rank in range(6):                                           # finish the epoch on 6 ranks
        s = ResumableStream(cfg, rank=rank, world_size=6, source=src)
        s.load_sidecar(resume_from)
        s.set_epoch(0)
        ids += [int(row["line"]) for row in s]
    counts = Counter(ids)
    assert sorted(counts) == list(range(ROWS)) and set(counts.values()) == {1}


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    exec(open(sys.argv[2]).read(), {})                  # the doc's registry entry
    from resumable_stream import ResumableStream, StreamConfig
    cfg = StreamConfig(dataset_name_or_path="lines", data_files=sys.argv[3], shuffle=True, buffer_size=50,
                       num_partitions=2)
    stream = ResumableStream(cfg)
    for n, row in enumerate(stream, 1):
        print(row["line"], flush=True)
        if n % 7 == 0:
            stream.save_sidecar(sys.argv[4])
            print("saved", n, flush=True)
""")


@pytest.mark.slow
def test_a_sigkilled_reader_resumes_exactly(lines_format, lines_data, tmp_path):
    _, entry = doc_blocks()
    (tmp_path / "entry.py").write_text(entry)
    (tmp_path / "child.py").write_text(_CHILD)
    cfg = lines_config(lines_data, shuffle=True, buffer_size=50, num_partitions=2)
    reference = ids_of(ResumableStream(cfg), 2 * ROWS)              # into the second epoch
    kill_at = seeded_rng("lines-kill").randrange(20, ROWS + 100)
    state = str(tmp_path / "state")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), lines_format, str(tmp_path / "entry.py"),
                              os.path.join(lines_data, "*.lines"), state], stdout=subprocess.PIPE, text=True, env=env)
    printed = 0
    try:
        for line in child.stdout:
            if not line.startswith("saved"):
                assert int(line) == reference[printed]
                printed += 1
                if printed == kill_at:
                    break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    resumed = ResumableStream(cfg)
    resumed.load_sidecar(state)
    consumed = sum(resumed.partition_state(p).consumed for p in resumed.partitions)   # the last complete save
    assert consumed % 7 == 0 and kill_at - 7 <= consumed <= kill_at + 7
    assert ids_of(resumed, 100) == reference[consumed:consumed + 100]


def test_resumable_stream_index_writes_a_lines_index_that_is_verified(lines_format, lines_data, tmp_path, capsys):
    from resumable_stream.app.cli import main

    cfg_path = tmp_path / "lines.yaml"
    cfg_path.write_text(json.dumps({"data": {"dataset_name_or_path": "lines",
                                             "data_files": os.path.join(lines_data, "*.lines")}}))
    out = str(tmp_path / "index.json")
    assert main(["index", str(cfg_path), "-o", out, "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "lines" and summary["shards"] == 3 * FILES and summary["rows"] == ROWS
    assert "row_groups" not in summary
    index = load_index(out)
    assert index["reader"] == "lines"
    cfg = lines_config(lines_data, index_path=out)
    assert sorted(ids_of(ResumableStream(cfg), ROWS)) == list(range(ROWS))

    # a rewrite of the same size and mtime: only the reader's local check (its digest) can see it
    moved = tmp_path / "copy"
    os.makedirs(moved)
    for name in os.listdir(lines_data):
        (moved / name).write_bytes(open(os.path.join(lines_data, name), "rb").read())
    copied = lines_config(str(moved))
    save_index(out, open_source(copied.source_spec).index)
    target = moved / "part-2.lines"
    st = os.stat(target)
    data = target.read_bytes()
    target.write_bytes(data[:-4] + b"999\n")                      # its last line, 449, becomes 999
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StreamMismatchError, match=r"part-2\.lines \(digest\)"):
        ResumableStream(copied.replace(index_path=out))


def test_an_unregistered_format_is_a_config_error_listing_the_registered_ones(lines_format, tmp_path):
    with pytest.raises(ConfigError, match=r"source format 'webdataset2': not registered; registered formats: "
                                          r"jsonl, lines, parquet"):
        registry.format_named("webdataset2")
    src_index = {"format": "resumable-stream-index", "version": 1, "resolution": {}, "features": {},
                 "reader": "nope", "files": [{"path": "/x", "size": 1}]}
    path = tmp_path / "index.json"
    path.write_text(json.dumps(src_index))
    with pytest.raises(SourceError, match=r"index\.json.*source format 'nope': not registered; registered "
                                          r"formats: jsonl, lines, parquet"):
        load_index(str(path))


def test_an_index_without_a_reader_is_refused(parquet_small, tmp_path):
    """One index format at 1.0: an index that does not name the format that reads it (as development builds
    wrote them) is refused, naming the key, not taken for parquet."""
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(parquet_small, "*.parquet"))
    index = open_source(cfg.source_spec).index
    assert index["reader"] == "parquet"
    del index["reader"]
    save_index(str(tmp_path / "old.json"), index)
    with pytest.raises(SourceError, match=r"old\.json.*missing 'reader' \(the name of the format"):
        load_index(str(tmp_path / "old.json"))
    with pytest.raises(ConfigError, match=r"dataset index: 'reader' got None; allowed: the name of the registered"):
        registry.format_of_index(index)


def test_a_format_that_claims_anothers_builder_or_extension_is_refused(lines_format):
    with pytest.raises(ConfigError, match=r"'pq2': \.parquet already belongs to format 'parquet'"):
        registry.register(registry.SourceFormat("pq2", ("pq2",), (".parquet",), reader=object()))
    with pytest.raises(ConfigError, match="built in"):
        registry.unregister("parquet")


def test_a_lines_checkpoint_resumes_from_its_saved_index_and_inspects(lines_format, lines_data, tmp_path, capsys):
    from resumable_stream.app.cli import main

    cfg = lines_config(lines_data, shuffle=True, buffer_size=30)
    first = ResumableStream(cfg)
    head = ids_of(first, 45)
    state = str(tmp_path / "state")
    first.save_sidecar(state)
    assert load_index(os.path.join(state, "index.json"))["reader"] == "lines"
    resumed = ResumableStream(cfg.replace(resume_state_path=state))
    resumed.load_sidecar(state)
    assert head + ids_of(resumed, 100) == ids_of(ResumableStream(cfg), 145)
    assert main(["inspect", state]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["index"]["format"] == "lines" and shown["index"]["files"] == FILES
