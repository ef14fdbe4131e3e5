"""The sample order of every kind of source, pinned.

Each case reads a stream over generated data and compares the sequence of its sample keys with a digest
fixed in this file (recorded from the release whose order every saved checkpoint relies on). The samples'
content is checked too, against an independent reading of the same files (pyarrow for parquet / csv,
``json`` for JSON lines, the lines themselves for text): a change of order, of which rows, or of how a
value is decoded fails here, whatever code path opened the stream (resolved by ``datasets`` or not, from a
saved index or not).

A change that is meant to change the order must update these digests and say so: saved checkpoints of
the earlier order no longer resume onto the same samples.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from resumable_stream import MixtureStream, ResumableStream, StreamConfig
from resumable_stream.testing import synthetic_rows, write_jsonl_dataset, write_parquet_dataset


def _keys_digest(keys: list) -> str:
    return hashlib.blake2b(json.dumps(keys).encode(), digest_size=12).hexdigest()


# ---------------------------------------------------------------------------------------- data, written here
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    out = {}
    for name, rows, files, group in (("p60", 6000, 6, 100), ("p2", 300, 1, 150), ("pa", 1000, 4, 50)):
        write_parquet_dataset(str(root / name), rows=rows, files=files, row_group_size=group)
        out[name] = str(root / name)
    b = root / "pb"
    b.mkdir()
    for f in range(2):      # ids 100000.. : the mixture's second source
        pq.write_table(pa.table(synthetic_rows(100_000 + f * 150, 150)), str(b / f"part-{f:05d}.parquet"),
                       row_group_size=50)
    out["pb"] = str(b)
    write_jsonl_dataset(str(root / "json"), rows=1200, files=4)
    out["json"] = str(root / "json")
    for kind in ("csv", "text"):
        d = root / kind
        d.mkdir()
        for f in range(3):
            rows = synthetic_rows(f * 400, 400)
            if kind == "csv":
                pacsv.write_csv(pa.table(rows), str(d / f"part-{f:05d}.csv"))
            else:
                (d / f"part-{f:05d}.txt").write_text("\n".join(rows["text"]) + "\n", encoding="utf-8")
        out[kind] = str(d)
    return out


def _independent_rows(directory: str) -> dict:
    """key -> row, read without the library: id -> dict for tables, line -> {"text": line} for text."""
    rows = {}
    files = sorted(glob.glob(os.path.join(directory, "*")))
    for f in files:
        if f.endswith(".parquet"):
            table = pq.read_table(f)
        elif f.endswith(".csv"):
            table = pacsv.read_csv(f)
        elif f.endswith(".jsonl"):
            with open(f, encoding="utf-8") as fh:
                table = pa.Table.from_pylist([json.loads(line) for line in fh])
        else:
            with open(f, encoding="utf-8") as fh:
                for line in fh.read().splitlines():
                    rows[line] = {"text": line}
            continue
        for row in table.to_pylist():
            rows[row["id"]] = row
    return rows


def _key(sample: dict):
    return sample["id"] if "id" in sample else sample["text"]


def _check(samples: list[dict], directories: list[str]) -> list:
    """The samples are rows of the files, exactly as read independently; their keys in order."""
    truth = {}
    for d in directories:
        truth.update(_independent_rows(d))
    keys = [_key(s) for s in samples]
    for s, k in zip(samples, keys):
        assert s == truth[k], f"sample {k!r} differs from the file's row: {s!r} != {truth[k]!r}"
    return keys


def _cfg(data, name: str, builder: str = "parquet", ext: str = "parquet", **kw) -> StreamConfig:
    return StreamConfig(dataset_name_or_path=builder, data_files=os.path.join(data[name], f"*.{ext}"), **kw)


# ------------------------------------------------------------------------------------------------ the cases
def _single(data, name, n, rank=0, world_size=1, builder="parquet", ext="parquet", **kw):
    stream = ResumableStream(_cfg(data, name, builder, ext, **kw), rank=rank, world_size=world_size)
    try:
        return _check(list(itertools.islice(stream, n)), [data[name]])
    finally:
        stream.close()


def _resumed(data, name, before, after, **kw):
    cfg = _cfg(data, name, **kw)
    first = ResumableStream(cfg)
    list(itertools.islice(first, before))
    state = first.state_dict()
    first.close()
    again = ResumableStream(cfg)
    again.load_state_dict(state)
    try:
        return _check(list(itertools.islice(again, after)), [data[name]])
    finally:
        again.close()


def _mixture(data, n, **kw):
    cfg = StreamConfig.from_dict({**kw, "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": os.path.join(data[d], "*.parquet"),
         "weight": w} for label, d, w in (("a", "pa", 0.7), ("b", "pb", 0.3))]})
    stream = MixtureStream(cfg, rank=0, world_size=1)
    try:
        return _check(list(itertools.islice(stream, n)), [data["pa"], data["pb"]])
    finally:
        stream.close()


def _from_sidecar(data, tmp, before, after, **kw):
    """Resumed through a state directory: the stream reopens from the index saved with it."""
    cfg = _cfg(data, "p60", **kw)
    first = ResumableStream(cfg)
    list(itertools.islice(first, before))
    first.save_sidecar(os.path.join(tmp, "state"))
    first.close()
    again = ResumableStream(cfg, index_from=os.path.join(tmp, "state"))
    again.load_sidecar(os.path.join(tmp, "state"))
    try:
        return _check(list(itertools.islice(again, after)), [data["p60"]])
    finally:
        again.close()


def _listed(data, tmp, n, **kw):
    """data_files as an explicit list (in reverse file order: the list's order is the files' order), once to
    write data.index_path and once reading from it."""
    files = sorted(glob.glob(os.path.join(data["p60"], "*.parquet")), reverse=True)
    keys = []
    for _ in range(2):
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=files, index_path=os.path.join(tmp, "i.json"),
                           **kw)
        stream = ResumableStream(cfg)
        try:
            keys.append(_check(list(itertools.islice(stream, n)), [data["p60"]]))
        finally:
            stream.close()
    assert keys[0] == keys[1]
    return keys[0]


# case -> (run(data, tmp_dir) -> keys, digest of the keys)
CASES = {
    "parquet shuffled": (
        lambda d, t: _single(d, "p60", 3000, shuffle=True, buffer_size=256), "942dc809b992d2913b278af2"),
    "parquet shuffled, rank 1 of 2, 4 partitions": (
        lambda d, t: _single(d, "p60", 2000, rank=1, world_size=2, shuffle=True, buffer_size=500, num_partitions=4),
        "5972a83376e0a1a41bd85ee4"),
    "parquet in file order": (
        lambda d, t: _single(d, "p60", 2500, shuffle=False), "ba16ad0fc467d19648ba40f7"),
    "parquet over 3 epochs": (
        lambda d, t: _single(d, "pa", 2600, shuffle=True, buffer_size=64, interleave_shards=2, block_rows=16),
        "9d4b134248545074a120fd99"),
    "parquet strided (fewer shards than partitions)": (
        lambda d, t: _single(d, "p2", 250, rank=2, world_size=3, shuffle=True, buffer_size=32),
        "77c3d9580078934e17359746"),
    "parquet resumed": (
        lambda d, t: _resumed(d, "p60", 1234, 900, shuffle=True, buffer_size=512), "107e104cda35c1cfd123312b"),
    "parquet resumed from a state directory": (
        lambda d, t: _from_sidecar(d, t, 1234, 900, shuffle=True, buffer_size=512), "107e104cda35c1cfd123312b"),
    "parquet from a list of files, and from data.index_path": (
        lambda d, t: _listed(d, t, 2500, shuffle=True, buffer_size=300), "3639918ddef2f0355b9a83ad"),
    "json lines shuffled": (
        lambda d, t: _single(d, "json", 1500, builder="json", ext="jsonl", shuffle=True, buffer_size=128),
        "43a0b94b17c522543ec64cee"),
    "csv shuffled": (
        lambda d, t: _single(d, "csv", 1000, builder="csv", ext="csv", shuffle=True, buffer_size=100),
        "44b01d58510cb635c02434e4"),
    "text shuffled": (
        lambda d, t: _single(d, "text", 1000, builder="text", ext="txt", shuffle=True, buffer_size=100),
        "e11fc2f05c8da467fd6f1c93"),
    "mixture": (
        lambda d, t: _mixture(d, 1500, shuffle=True, buffer_size=64), "e58aef039b62ea33b13e3b29"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sample_order_is_pinned(data, case, tmp_path):
    run, expected = CASES[case]
    keys = run(data, str(tmp_path))
    assert _keys_digest(keys) == expected, f"{case}: the sample order changed (first keys {keys[:8]})"
