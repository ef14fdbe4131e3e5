"""The dataset index at scale: held columnar (FileTable), broadcast as one checked binary message, planned
from one array of row counts, with the very entries, fingerprint and order of the JSON form.

Small-scale runs of what benchmarks/index_scale.py measures at 1M files (the same synthetic index).
"""

from __future__ import annotations

import heapq
import json

import numpy as np
import pytest

from resumable_stream import SourceError, StreamConfig
from resumable_stream.dataset.index_message import decode_message, encode_message
from resumable_stream.plan import Layout, RowCounts, deal_shards, epoch_shard_order
from resumable_stream.sources import open_source
from resumable_stream.sources.base import ShardInfo
from resumable_stream.sources.fingerprint_files import dataset_fingerprint, digest
from resumable_stream.sources.index import (
    compact_index,
    decode_index,
    encode_index,
    identity_of,
    load_index,
    save_index,
)
from resumable_stream.sources.index import encode_message as encode_index_message
from resumable_stream.sources.index_table import FileTable, pack_index
from resumable_stream.testing import synthetic_parquet_index

pytestmark = pytest.mark.timeout(60)


def _index(files: int = 300) -> dict:
    index = synthetic_parquet_index(files, 10, 100)
    remote = index["files"][7]                # a remote file's identity markers instead of an mtime
    del remote["mtime"]
    remote.update({"path": "https://host/a b/ü.parquet", "etag": '"abc-1"', "last-modified": "Mon, 1 Jan 2024"})
    index["files"][8]["row_groups"] = []      # a file without row groups
    index["files"][9]["row_groups"][0][0] = 0      # an empty row group (left out of the plan)
    return index


def test_the_table_holds_the_very_entries_and_their_json_is_byte_identical():
    index = _index()
    table = compact_index(index)
    assert isinstance(table["files"], FileTable)
    assert list(table["files"]) == index["files"] and table["files"] == index["files"]
    assert table["files"][-1] == index["files"][-1] and table["files"][5:7] == index["files"][5:7]
    assert table["files"].paths() == [f["path"] for f in index["files"]]      # one of them not ASCII
    assert encode_index(table) == json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    # ~12 bytes per row group of 100 rows, ~60 per file plus its path: not the ~2 KB of objects per file
    assert table["files"].nbytes < 300 * (10 * 12 + 100)


def test_an_old_json_index_file_still_loads_and_comes_back_columnar(tmp_path):
    index = _index()
    path = tmp_path / "index.json"
    path.write_text(json.dumps(index))       # as every index written before the table (and still written)
    loaded = load_index(str(path))
    assert isinstance(loaded["files"], FileTable) and list(loaded["files"]) == index["files"]
    save_index(str(tmp_path / "again.json"), loaded)
    assert json.loads((tmp_path / "again.json").read_text()) == index


def test_an_index_the_table_cannot_hold_stays_a_list():
    index = _index(20)
    index["files"][3]["footer"] = "not hex"
    assert isinstance(compact_index(index)["files"], list)


def test_the_packed_message_round_trips_and_is_compact():
    index = synthetic_parquet_index(10_000, 10, 1000)
    message = encode_index_message(index)
    json_bytes = len(encode_index(index))
    assert message[:8] == b"RSINDEX1" and len(message) < 0.6 * json_bytes
    back = decode_index(message, "from rank 0")
    assert back["files"] == compact_index(index)["files"]
    assert {k: v for k, v in back.items() if k != "files"} == {k: v for k, v in index.items() if k != "files"}


def _forged(change) -> bytes:
    table = compact_index(_index(30))
    arrays = table["files"].arrays()
    change(arrays)
    return pack_index({**table, "files": FileTable(arrays)})


@pytest.mark.parametrize("change, needle", [
    (lambda a: a.update(end=np.where(np.arange(len(a["end"])) == 5, 10**12, a["end"]).astype("<i8")),
     "not inside its file"),
    (lambda a: a.update(start=a["end"].astype("<i8") + 1), "not inside its file"),
    (lambda a: a.update(path_offsets=a["path_offsets"][::-1].copy()), "path_offsets"),
    (lambda a: a.update(paths=np.where(np.arange(len(a["paths"])) == 3, 0, a["paths"]).astype(np.uint8)), "NUL"),
    (lambda a: a.update(paths=np.full(len(a["paths"]), 0xFF, np.uint8)), "UTF-8"),
    (lambda a: a.update(group_offsets=a["group_offsets"] + 1), "group_offsets"),
    (lambda a: a.update(mtime=a["mtime"][:-1]), "mtime: 29 values; the header says 30"),
    (lambda a: a.update(footer_bytes=(a["size"] + 1).astype("<i8")), "footer"),
    (lambda a: a.update(rows=a["rows"].astype("<f8")), "dtype"),
    (lambda a: a.update(extras=np.frombuffer(b"x" * len(a["extras"]), np.uint8)), "identity keys"),
])
def test_a_forged_message_is_refused_naming_what_is_wrong(change, needle):
    with pytest.raises(SourceError, match=f"dataset index from rank 0: .*{needle}"):
        decode_index(_forged(change), "from rank 0")


def test_a_truncated_or_padded_message_is_refused_at_every_cut():
    message = encode_index_message(_index(30))
    for cut in (9, 16, 100, len(message) // 2, len(message) - 1):
        with pytest.raises(SourceError, match="dataset index x: .*(truncated|runs past)"):
            decode_index(message[:cut], "x")
    with pytest.raises(SourceError, match="after the last array"):
        decode_index(message + b"\0", "x")
    with pytest.raises(SourceError, match="length .* runs past the end"):
        decode_index(message[:8] + (1 << 62).to_bytes(8, "little") + message[16:], "x")


def test_the_open_message_carries_indexes_footers_and_errors_and_refuses_a_truncated_one():
    index = _index(40)
    message = encode_message([{"index": index, "footers": {"/corpus/part-0000000.parquet": b"\x01PAR1"}}, None],
                             {"seed": 3})
    back = decode_message(message)
    assert back["agree"] == {"seed": 3} and back["error"] is None and back["sources"][1] is None
    assert list(back["sources"][0]["index"]["files"]) == index["files"]
    assert back["sources"][0]["footers"] == {"/corpus/part-0000000.parquet": b"\x01PAR1"}
    failed = decode_message(encode_message([], {}, {"type": "SourceError", "message": "boom"}))
    assert failed["error"] == {"type": "SourceError", "message": "boom"}
    with pytest.raises(SourceError, match="rank 0"):
        decode_message(message[:-3])


def _old_deal(order, row_counts, num_partitions):
    """The deal as it was written before (heappop then heappush): the order must not change."""
    known = [c for c in row_counts if c is not None]
    fallback = (sum(known) / len(known)) if known else 1.0
    heap = [(0.0, p) for p in range(num_partitions)]
    dealt = [[] for _ in range(num_partitions)]
    for shard in order.tolist():
        load, p = heapq.heappop(heap)
        dealt[p].append(shard)
        rows = row_counts[shard]
        heapq.heappush(heap, (load + (fallback if rows is None else rows), p))
    return dealt


def test_the_deal_and_the_plan_are_those_of_the_tuple_form():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5000, 3000).tolist()
    order = epoch_shard_order(3000, 7, 2, True)
    for parts in (1, 7, 64, 512):
        assert deal_shards(order, counts, parts) == _old_deal(order, counts, parts)
    with_unknown = [None if i % 5 == 0 else c for i, c in enumerate(counts)]
    assert deal_shards(order, with_unknown, 64) == _old_deal(order, with_unknown, 64)
    for parts in (8, 512, 4096):        # 4096 partitions of 3000 shards: strided
        kw = dict(num_shards=3000, num_partitions=parts, seed=7, shuffle=True, buffer_size=64, interleave=4,
                  block_rows=8)
        as_array, as_tuple = Layout(row_counts=RowCounts(np.asarray(counts, np.uint32)), **kw), \
            Layout(row_counts=tuple(counts), **kw)
        assert as_array == Layout(row_counts=RowCounts(np.asarray(counts, np.int64)), **kw)
        for epoch in (0, 3):
            for p in (0, parts // 2, parts - 1):
                assert as_array.shards_for(epoch, p) == as_tuple.shards_for(epoch, p)
                assert as_array.partition_rows(epoch, p) == as_tuple.partition_rows(epoch, p)


def test_a_source_over_10k_files_has_the_shards_and_fingerprint_of_the_list_form():
    index = synthetic_parquet_index(10_000, 10, 1000)
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files="/corpus/*.parquet", shuffle=True)
    source = open_source(cfg.source_spec, index=decode_index(encode_index_message(index), "x"))
    files = index["files"]
    shards = [ShardInfo(0, f["path"], g, rg[0]) for f in files for g, rg in enumerate(f["row_groups"])]
    shards = [ShardInfo(i, s.file, s.part, s.num_rows) for i, s in enumerate(shards)]
    assert len(source.shards) == 100_000
    for i in (0, 9, 10, 54_321, 99_999, -1):
        assert source.shards[i] == shards[i]
    listed = dataset_fingerprint(cfg.source_spec, "parquet", [identity_of(f) for f in files], shards)
    # the same but the files: their count and the digest of the very identities the list form lists
    assert source.fingerprint == {**listed, "files": {"count": 10_000, "digest": digest(listed["files"])}}


@pytest.mark.parametrize("path, needle", [("", "''; allowed"), ("a\0b", "no NUL"), ("x" * 5000, "1 to 4096 bytes")])
def test_a_json_index_with_a_bad_path_is_refused_naming_the_file(tmp_path, path, needle):
    index = _index(12)
    index["files"][2]["path"] = path
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=f"dataset index .*index.json.*files\\[2\\] has path .*{needle}"):
        load_index(str(tmp_path / "index.json"))
