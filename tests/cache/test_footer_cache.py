"""After a warmup, a fresh stream over a remote dataset asks at most one request per file before its first sample
(the footers come from the cache directory, keyed by the file's identity), none with a saved index and
``verify_files: false``; a file rewritten at the server is still read afresh (its identity changed)."""

from __future__ import annotations

import collections
import os
import shutil
import urllib.parse

import pytest
from helpers import take_ids
from http_server import FileServer

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.app.warmup import run_warmup
from resumable_stream.sources.footer_cache import FooterCache
from resumable_stream.sources.parquet_footer import footer_digest
from resumable_stream.testing import write_parquet_dataset

pytestmark = pytest.mark.timeout(120)


def _per_file(srv) -> collections.Counter:
    return collections.Counter(urllib.parse.unquote(r.path).rsplit("/", 1)[-1] for r in srv.requests)


def _cfg(urls, cache, **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path="parquet", data_files=list(urls), shuffle=True, buffer_size=64,
                        interleave_shards=2, block_rows=16, cache_dir=cache, **kw)


def test_after_warmup_a_fresh_stream_asks_one_request_per_file_and_none_with_a_saved_index(tmp_path):
    root = tmp_path / "served"
    files = write_parquet_dataset(str(root), rows=1200, files=4, row_group_size=100)
    with FileServer(root) as srv:
        urls = [srv.url(os.path.basename(p)) for p in files]
        cache = str(tmp_path / "cache")
        cfg = _cfg(urls, cache)
        reference = take_ids(ResumableStream(_cfg(urls, None)), 150)

        # a checkpoint after 50 samples (with its index), then the warmup of the next 100 from it
        ckpt = tmp_path / "checkpoint-1"
        s = ResumableStream(cfg.replace(cache_dir=None))
        assert take_ids(s, 50) == reference[:50]
        s.save_sidecar(str(ckpt / "stream_state"))         # the rank file, the dataset index, the manifest
        run_warmup(cfg, 150, progress=False)
        run_warmup(cfg, 100, state_path=str(ckpt), progress=False)

        # fresh stream objects and cache handles: the index is built again, each file's footer from the cache
        srv.reset_stats()
        fresh = ResumableStream(cfg)
        first = take_ids(fresh, 1)
        per_file = _per_file(srv)
        assert max(per_file.values()) <= 1 and sum(per_file.values()) <= len(files), srv.requests
        assert first + take_ids(fresh, 149) == reference
        assert srv.stats()["requests"] == sum(per_file.values()), "the warm blocks need no request"

        # a saved index, checked (one metadata request per file), then not checked (none at all)
        for verify, most in ((True, 1), (False, 0)):
            srv.reset_stats()
            resumed = ResumableStream(cfg.replace(verify_files=verify), index_from=str(ckpt))
            resumed.load_sidecar(str(ckpt))
            assert take_ids(resumed, 1) == reference[50:51]
            per_file = _per_file(srv)
            assert max(per_file.values(), default=0) <= most, (verify, srv.requests)
            assert take_ids(resumed, 99) == reference[51:150]


def test_a_file_rewritten_at_the_server_is_never_read_with_its_kept_footer(tmp_path):
    root = tmp_path / "served"
    files = write_parquet_dataset(str(root), rows=800, files=2, row_group_size=100)
    with FileServer(root) as srv:
        urls = [srv.url(os.path.basename(p)) for p in files]
        cfg = _cfg(urls, str(tmp_path / "cache"))
        before = ResumableStream(cfg).source.index        # the block cache keeps the footers it was built from
        assert len(os.listdir(tmp_path / "cache" / "footers")) == 2

        # the same name, other bytes (other rows and row groups): another identity, so another footer key
        other = write_parquet_dataset(str(tmp_path / "other"), rows=500, files=1, row_group_size=50, words=3)
        shutil.copyfile(other[0], files[0])
        srv.reset_stats()
        after = ResumableStream(cfg).source.index
        per_file = _per_file(srv)
        name = os.path.basename(files[0])
        assert per_file[name] == 2 and per_file[os.path.basename(files[1])] == 1, srv.requests   # HEAD + footer
        changed = after["files"][0]
        with open(files[0], "rb") as f:
            data = f.read()
        footer_len = int.from_bytes(data[-8:-4], "little")
        assert changed["footer"] == footer_digest(data[-8 - footer_len:]) != before["files"][0]["footer"]
        assert sum(rg[0] for rg in changed["row_groups"]) == 500
        epoch = take_ids(ResumableStream(cfg), 900)       # the new file's 500 rows (ids 0-499), then file 1's
        assert sorted(epoch) == sorted([*range(500), *range(400, 800)])


def test_a_damaged_or_versionless_entry_is_not_used(tmp_path):
    kept = FooterCache(str(tmp_path))
    ident = {"path": "https://h/a.parquet", "size": 100, "etag": '"1"'}
    kept.put(ident, b"footer-bytes")
    assert kept.get(ident) == b"footer-bytes"
    assert kept.get({**ident, "etag": '"2"'}) is None and kept.get({**ident, "size": 101}) is None
    (entry,) = os.listdir(tmp_path / "footers")
    path = tmp_path / "footers" / entry
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert kept.get(ident) is None
    versionless = {"path": "https://h/b.parquet", "size": 100}
    kept.put(versionless, b"footer")
    assert kept.get(versionless) is None and len(os.listdir(tmp_path / "footers")) == 1
