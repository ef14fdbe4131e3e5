"""WebDataset tar shards read by byte ranges from a tar index (:mod:`.tar_index`): a shard is a run of samples of
one tar, each member's header checked again before its data is used; the samples are made by ``datasets``' own
webdataset code. Bad samples keep their row (docs/webdataset.md#bad-input).
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Iterator
from itertools import islice, pairwise

import pyarrow as pa

from ..config.specs import SourceSpec
from ..errors import BAD_SAMPLE_COLUMN, SourceError, StreamMismatchError
from ..io.net import RetryPolicy
from ..io.ranged import read_range
from ..observe.metrics import record_row_group
from . import tar_index
from .base import FetchesAhead, ScannedReader, fetcher, shards_of_runs
from .fingerprint_files import dataset_fingerprint
from .index import identity_of
from .parquet import prefetch_depth

log = logging.getLogger(__name__)

# What datasets' feature inference reads (WebDataset.NUM_EXAMPLES_FOR_FEATURES_INFERENCE).
INFERENCE_SAMPLES = 5
# Members never decoded here: datasets' decoder for them unpickles (torch.load).
_REFUSED = {"pth": "a .pth member is a pickle; it is not decoded"}


def _builder():
    from datasets.packaged_modules.webdataset.webdataset import WebDataset

    return WebDataset


# ------------------------------------------------------------------------------ index
def index_file(path: str, retry: RetryPolicy | None, identity: dict, whole: bool = False) -> dict:
    """One tar's index entry: its ``identity`` and one pass over it; ``whole``: IncompleteFileError for a tar
    not complete yet (``tar_index.scan_tar``)."""
    if not isinstance(identity.get("size"), int):
        raise SourceError(f"data file {path!r}: its size is unknown; a tar needs one to be indexed")
    fetch = fetcher(path, retry, identity, "to index it")
    return tar_index.tar_entry(identity, tar_index.scan_tar(path, identity["size"], fetch, whole=whole))


def infer_features(entry: dict, retry: RetryPolicy | None, max_member_bytes: int):
    """The features datasets' webdataset builder infers from a tar's first samples (its _split_generators)."""
    import datasets
    from datasets.features.features import cast_to_python_objects

    wds = _builder()
    first = list(islice(range(len(entry["samples"])), INFERENCE_SAMPLES))
    if not first:
        raise SourceError(f"data file {entry['path']!r}: holds no sample; the features are inferred from the "
                          "first tar's first samples")
    items = []
    for i, (files, why) in zip(first, _Reader(entry, retry, max_member_bytes).files(0, len(first))):
        if why is not None:
            raise SourceError(f"data file {entry['path']!r}: sample {entry['samples'][i][0]!r}, read to infer the "
                              f"features: {why}")
        items += files
    # one pipeline over them, as the builder's: its examples' key order is the features' column order
    examples = list(wds._get_pipeline_from_tar(entry["path"], iter(items)))
    if any(ex.keys() != examples[0].keys() for ex in examples):
        raise SourceError(f"data file {entry['path']!r}: its first samples do not have the same members (datasets "
                          "infers the features from them and refuses it too)")
    tables = [pa.Table.from_pylist(cast_to_python_objects([ex], only_1d_for_numpy=True)) for ex in examples]
    features = datasets.Features.from_arrow_schema(pa.concat_tables(tables, promote_options="default").schema)
    kinds = ((wds.IMAGE_EXTENSIONS, datasets.Image), (wds.AUDIO_EXTENSIONS, datasets.Audio),
             (wds.VIDEO_EXTENSIONS, datasets.Video), (getattr(wds, "MESH_EXTENSIONS", []),
                                                        getattr(datasets, "Mesh", None)))
    for field in examples[0]:
        ext = field.rsplit(".", 1)[-1].lower()
        for exts, kind in kinds:
            if kind is not None and ext in exts:
                features[field] = kind()
    return features


def check_local(entry: dict, retry: RetryPolicy | None) -> str:
    """A local tar against its entry at no network cost: the header before the first member of each shard
    (and of the last sample; a sparse member's is not checked: it is never read). ``entry['layout']`` when
    they match, else what differs."""
    path = entry["path"]
    picks = sorted({*entry["shards"], len(entry["samples"]) - 1} - {-1})
    try:
        with open(path, "rb") as f:
            for i in picks:
                member = next((m for m in entry["samples"][i][1] if len(m) == 3), None)
                if member is None:
                    continue
                _, offset, size = member
                f.seek(offset - tar_index.BLOCK)
                problem = tar_index.header_problem(f.read(tar_index.BLOCK), size)
                if problem is not None:
                    return f"member layout changed (sample {entry['samples'][i][0]!r}: {problem})"
    except OSError as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return entry["layout"]


# ------------------------------------------------------------------------------ reading
class _Reader:
    """The members of one tar's samples, from ranged reads whose headers are checked against the entry."""

    def __init__(self, entry: dict, retry: RetryPolicy | None, max_member_bytes: int):
        self.entry, self.retry, self.max_bytes = entry, retry, max_member_bytes

    def spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Byte ranges covering samples [lo, hi): each member's header and data, coalesced; a member over the
        limit or sparse (never fetched) cuts the range."""
        out: list[list[int]] = []
        size = self.entry["size"]
        for _, members in self.entry["samples"][lo:hi]:
            for _, offset, n, *sparse in members:
                if n > self.max_bytes or sparse:
                    out.append([])
                    continue
                start, end = offset - tar_index.BLOCK, min(offset + n, size)
                if out and out[-1]:
                    out[-1][1] = end
                else:
                    out.append([start, end])
        return [(a, b) for a, b in (s for s in out if s)]

    def files(self, lo: int, hi: int) -> Iterator[tuple[list, str | None]]:
        """Per sample of [lo, hi): its members as (name, file) and None, or [] and why it is bad."""
        chunks = [(a, self._checked(a, b, lo, hi)) for a, b in self.spans(lo, hi)]
        size = self.entry["size"]
        for key, members in self.entry["samples"][lo:hi]:
            items, why = [], None
            for suffix, offset, n, *sparse in members:
                ext = suffix.rsplit(".", 1)[-1].lower()
                if sparse:
                    why = (f"member .{suffix} is a sparse file (tar --sparse): the tar holds its data without its "
                           "holes, and sparse members are not read")
                elif n > self.max_bytes:
                    why = f"member .{suffix} of {n} bytes is over data.max_member_bytes ({self.max_bytes})"
                elif offset + n > size:
                    why = f"member .{suffix} is cut short by the end of the tar ({size - offset} of {n} bytes)"
                elif ext in _REFUSED:
                    why = f"member .{suffix}: {_REFUSED[ext]}"
                if why is not None:
                    break
                start, data = next((a, d) for a, d in chunks if a <= offset and offset + n <= a + len(d))
                items.append((f"{key}.{suffix}", io.BytesIO(data[offset - start:offset - start + n])))
            yield ([], why) if why is not None else (items, None)

    def members(self, lo: int, hi: int) -> Iterator[tuple[dict | None, str | None]]:
        """Per sample of [lo, hi): (the builder's example, None) or (None, why it is bad)."""
        wds = _builder()
        for (key, _), (items, why) in zip(self.entry["samples"][lo:hi], self.files(lo, hi)):
            if why is None:
                try:
                    yield next(iter(wds._get_pipeline_from_tar(self.entry["path"], iter(items)))), None
                    continue
                except Exception as e:   # a decoder's refusal: json, utf-8, int, npy, ...
                    why = f"{_culprit(wds, self.entry['path'], key, items)} does not decode ({type(e).__name__}: " \
                          f"{str(e)[:200]})"
            yield None, why

    def _checked(self, start: int, end: int, lo: int, hi: int) -> bytes:
        """Bytes [start, end) whose member headers (of samples [lo, hi)) are the index's; one more read when
        they are not, then a StreamMismatchError naming the file."""
        path = self.entry["path"]
        for attempt in range(2):
            data = read_range(path, start, end, self.retry.storage_options if self.retry else {}, self.entry)
            problem = self._header_problem(data, start, lo, hi)
            if problem is None:
                return data
            if attempt == 0:
                log.warning("data file %r: %s; reading it once more from the source", path, problem)
        raise StreamMismatchError(
            f"data file {path!r}: its member layout no longer matches the dataset index ({problem}, on two reads); "
            "the tar changed since the index or checkpoint was made (rebuild the index)",
            [(f"file modified: {path} (layout)", self.entry["layout"], "changed")])

    def _header_problem(self, data: bytes, start: int, lo: int, hi: int) -> str | None:
        end = start + len(data)
        for key, members in self.entry["samples"][lo:hi]:
            for suffix, offset, n, *sparse in members:
                if not sparse and start <= offset - tar_index.BLOCK and offset <= end:
                    block = data[offset - tar_index.BLOCK - start:offset - start]
                    problem = tar_index.header_problem(block, n)
                    if problem is not None:
                        return f"sample {key!r} member .{suffix} at byte {offset}: {problem}"
        return None


def _culprit(wds, path: str, key: str, items: list) -> str:
    """Which member of sample ``key`` its decoders refuse (each decoded alone; "a member": none alone)."""
    for name, file in items:
        file.seek(0)
        try:
            list(wds._get_pipeline_from_tar(path, iter([(name, file)])))
        except Exception:
            return f"member .{name[len(key) + 1:]}"
    return "a member"


def _bad(path: str, key: str, why: str) -> str:
    """The reason a bad sample's row carries (``__bad_sample__``), logged too."""
    reason = f"data file {path!r}: sample {key!r}: {why}"
    log.warning("%s; a bad sample, its member columns are None", reason)
    return reason


class WebDatasetSource(FetchesAhead):
    """Indexed WebDataset tars: one shard per run of samples, read by byte ranges (picklable)."""

    def __init__(self, spec: SourceSpec, index: dict, retry: RetryPolicy, footers: dict | None = None):
        self.index = index
        self._features_dict = index["features"]
        self._files = index["files"]
        self._retry = retry if retry.remote else None
        self._policy = retry
        self._max_bytes = spec.read.max_member_bytes
        self._runs = [(f, a, b) for f, entry in enumerate(self._files)
                      for a, b in pairwise([*entry["shards"], len(entry["samples"])])]
        self.shards = shards_of_runs(self._files, self._runs, lambda run: run[2] - run[1])
        self.fingerprint = dataset_fingerprint(spec, index["builder"],
                                               [identity_of(f, WebDatasetReader.layout_keys) for f in self._files],
                                               self.shards, max_member_bytes=spec.read.max_member_bytes)
        self.column_names = [*self._features_dict, BAD_SAMPLE_COLUMN]
        self._fetch_ahead(self._fetch_shard, prefetch_depth(spec.read, retry.remote), spec.read.prefetch_memory_mb,
                          self._shard_bytes, remote=retry.remote)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "features"}      # made again where it is read

    @functools.cached_property
    def features(self):
        import datasets

        return datasets.Features.from_dict(self._features_dict)

    def _shard_bytes(self, shard: int) -> int:
        """The bytes a fetch ahead of ``shard`` transfers (from its hinted start)."""
        f, a, b = self._runs[shard]
        a += min(self._starts.get(shard, 0), b - a)
        return sum(end - start for start, end in _Reader(self._files[f], None, self._max_bytes).spans(a, b))

    def _fetch_shard(self, shard: int) -> pa.Table:
        """A fetch ahead: the samples from the hinted start on (its row count says where it starts)."""
        return self._read_from(shard, self._starts.get(shard, 0))

    def _read_from(self, shard: int, start_row: int) -> pa.Table:
        """Samples ``start_row`` on of ``shard`` as one table, in the dataset's features."""
        f, a, b = self._runs[shard]
        entry = self._files[f]
        features = self.features
        media = [k for k, v in features.items() if type(v).__name__ in ("Image", "Audio", "Video", "Mesh")]
        rows, bad = [], []
        reader = _Reader(entry, self._policy, self._max_bytes)
        for (key, _), (example, why) in zip(entry["samples"][a + start_row:b], reader.members(a + start_row, b)):
            bad.append(None if why is None else _bad(entry["path"], key, why))
            if why is not None:
                example = {"__key__": key, "__url__": entry["path"]}
            for field in features:                     # as the builder's _generate_examples fills them
                example.setdefault(field, None)
            for field in media:
                if example[field] is not None:
                    example[field] = {"path": f"{example['__key__']}.{field}", "bytes": example[field]}
            rows.append(features.encode_example(example))
        table = pa.Table.from_pylist(rows, schema=features.arrow_schema)
        record_row_group(table.num_rows)
        return table.append_column(pa.field(BAD_SAMPLE_COLUMN, pa.string()), pa.array(bad, pa.string()))

    def read(self, shard: int, start_row: int = 0) -> Iterator[pa.Table]:
        table = self._opened(shard, start_row, self._first_table)
        if table.num_rows:
            yield table

    def _first_table(self, shard: int, start_row: int) -> pa.Table:
        table = self._taken(shard)
        if table is not None:
            # a shard's row count never changes (a bad sample is a row): the fetch started at `first`
            first = self.shards[shard].num_rows - table.num_rows
            if first <= start_row:
                return table.slice(start_row - first) if start_row > first else table
            # it starts after the row asked for (another reader's hint): read from the row here
        return self._read_from(shard, start_row)   # inside the shard: only the samples from there


class WebDatasetReader(ScannedReader):
    """The registry's webdataset entry (``registry._BUILTIN``): tars indexed by :mod:`.tar_index`."""

    # per sample its key and members, the cut into shards and the rule that made it: layout, not identity
    layout_keys = ("samples", "shards", "shard_rule")
    # the layout digest: a local tar's headers are re-checked against it on resume (a remote one: not re-read)
    content_keys = ("layout",)

    scan = staticmethod(index_file)

    def infer_features(self, spec: SourceSpec, entry: dict, footer: bytes | None, retry: RetryPolicy | None):
        return infer_features(entry, retry, spec.read.max_member_bytes)

    def entry_problem(self, entry: dict) -> str | None:
        return tar_index.entry_problem(entry)

    def local_check(self, path: str, identity: dict, retry: RetryPolicy | None, entry: dict) -> dict:
        return {"layout": check_local(entry, retry)}

    def open_indexed(self, spec: SourceSpec, index: dict, retry: RetryPolicy,
                     footers: dict[str, bytes] | None = None) -> WebDatasetSource:
        return WebDatasetSource(spec, index, retry, footers)


READER = WebDatasetReader()
