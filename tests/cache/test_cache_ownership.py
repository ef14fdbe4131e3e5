"""The block cache only touches its own files, and warmup says when it did not cache the whole plan
(issue 20, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import diskcache
import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, StreamConfig
from resumable_stream.app.cli import main
from resumable_stream.cache import CachedSource
from resumable_stream.cache.ownership import MARKER
from resumable_stream.cache.store import ORPHAN_AGE_S
from resumable_stream.testing import write_parquet_dataset

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("parquet")
    write_parquet_dataset(str(d), rows=3000, files=3, row_group_size=250)
    return str(d)


def _cfg(data: str, cache_dir, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"),
                        cache_dir=str(cache_dir), block_rows=100, **kw)


def _yaml(tmp_path, data: str, cache_dir) -> str:
    path = tmp_path / "warm.yaml"
    path.write_text(yaml.safe_dump({"data": {"dataset_name_or_path": "parquet",
                                             "data_files": os.path.join(data, "*.parquet"),
                                             "cache_dir": str(cache_dir), "block_rows": 100}}))
    return str(path)


def _tree(d) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(d) for f in fs}


def _aged(path) -> None:
    old = time.time() - 2 * ORPHAN_AGE_S
    os.utime(path, (old, old))


def test_another_diskcache_directory_is_refused_and_left_whole(data, tmp_path):
    other = tmp_path / "other"
    with diskcache.Cache(str(other)) as c:
        for i in range(5):
            c.set(f"key{i}", os.urandom(100_000))          # big values: xx/yy/<hex>.val files
    (other / "ab" / "cd").mkdir(parents=True)
    stray = other / "ab" / "cd" / ("e" * 28 + ".val")       # a file no row names: what our sweep used to delete
    stray.write_bytes(b"theirs")
    _aged(stray)
    before = _tree(other)
    with pytest.raises(ConfigError) as err:
        CachedSource(open_plain(data), _cfg(data, other).cache_spec)
    assert str(other) in str(err.value) and MARKER in str(err.value) and "not empty" in str(err.value)
    assert _tree(other) == before
    assert main(["warmup", _yaml(tmp_path, data, other), "--samples", "100", "--no-progress"]) == 2
    assert _tree(other) == before


def open_plain(data: str):
    from resumable_stream.sources import open_source

    return open_source(StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet")).source_spec)


def test_a_directory_of_user_files_is_refused(data, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        CachedSource(open_plain(data), _cfg(data, home).cache_spec)
    assert os.listdir(home) == ["notes.txt"]


def test_a_cache_dir_that_is_a_file_is_an_error(data, tmp_path, capsys):
    f = tmp_path / "cache"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        CachedSource(open_plain(data), _cfg(data, f).cache_spec)
    assert main(["warmup", _yaml(tmp_path, data, f), "--samples", "100", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data.cache_dir" in err and str(f) in err and "is a file" in err


def test_a_new_or_empty_directory_is_marked_and_reused(data, tmp_path):
    for d in (tmp_path / "new", tmp_path / "empty"):
        if d.name == "empty":
            d.mkdir()
        cached = CachedSource(open_plain(data), _cfg(data, d).cache_spec)
        assert list(cached.read(0)) and json.loads((d / MARKER).read_text())["format"]
        cached.close()
        again = CachedSource(open_plain(data), _cfg(data, d).cache_spec)       # ours now: not refused
        assert sum(t.num_rows for t in again.read(0)) == 250 and again.stats()["hits"] > 0
        again.close()


def test_the_sweep_deletes_only_value_files_the_cache_writes(data, tmp_path):
    d = tmp_path / "c"
    cached = CachedSource(open_plain(data), _cfg(data, d).cache_spec)
    list(cached.read(0))
    cached.close()
    (d / "ab" / "cd").mkdir(parents=True)
    theirs, ours = d / "ab" / "cd" / ("1" * 28 + ".val"), d / "ab" / "cd" / ("2" * 28 + ".rsb")
    for f in (theirs, ours):
        f.write_bytes(b"x")
        _aged(f)
    again = CachedSource(open_plain(data), _cfg(data, d).cache_spec)
    list(again.read(1))                                     # the first write of this process sweeps
    again.flush()
    assert theirs.exists() and not ours.exists()


_FULL_WARMUP = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (220_000, 220_000))   # the cache's files stop growing: a full disk
from resumable_stream.app.cli import main
sys.exit(main(["warmup", sys.argv[1], "--samples", "3000", "--no-progress", "--jobs", "1"]))
"""


def test_warmup_on_a_full_disk_exits_non_zero_and_says_how_many_blocks(data, tmp_path):
    d = tmp_path / "c"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", _FULL_WARMUP, _yaml(tmp_path, data, d)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    line = [x for x in p.stderr.splitlines() if "warmup incomplete" in x]
    assert line, p.stderr[-2000:]
    missing, planned = (int(x) for x in line[0].split("warmup incomplete: ")[1].split(" planned")[0].split(" of "))
    assert f"of {planned} planned blocks" in line[0] and 0 < missing < planned
    assert "writing a block" in line[0] and ("I/O error" in line[0] or "File too large" in line[0] or "full" in line[0])


def test_a_complete_warmup_exits_zero(data, tmp_path, capsys):
    assert main(["warmup", _yaml(tmp_path, data, tmp_path / "c"), "--samples", "3000", "--no-progress"]) == 0
    assert "could NOT" not in capsys.readouterr().err
