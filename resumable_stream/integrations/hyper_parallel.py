"""``_target_`` builders for HyperParallel's trainer (mindspore-ai/hyper-parallel): our stream as its dataset and
its train dataloader.

In HyperParallel's yaml (examples/hyper_parallel/train_stream.yaml is the whole file)::

    dataset:
      _target_: resumable_stream.integrations.hyper_parallel.build_dataset
      backend: hf                    # our data: keys, inline (the RFC's keys and ours) ...
      dataset_name_or_path: parquet
      data_files: /data/*.parquet
      shuffle: true
      shuffle_seed: 42
      # ... or `config: stream.yml` naming a resumable-stream yaml
    dataloader:
      _target_: resumable_stream.integrations.hyper_parallel.build_dataloader
      num_workers: 2
      use_background_prefetcher: true

The contract, as HyperParallel's public sources define it (the files and lines the tests' harness follows are
quoted there, tests/_support/hp_trainer.py):

- ``BaseTrainer._build_dataset`` calls ``config.dataset.build(transform=, tokenizer=, mesh_context=,
  training_config=)``: :func:`build_dataset` takes those, reads this rank's place from ``mesh_context``
  (``dp_rank`` / ``dp_size``: tensor / context / pipeline peers read the same rows) and returns an iterable
  dataset (so no batch sampler is made for it).
- ``data.batching.build_dataloader`` calls the dataloader target's ``build(dataset=, collate_fn=,
  batch_sampler=, batch_size=<micro_batch_size>, sampler_type=, dp_world_size=, max_seq_len=, seed=)`` next to
  the yaml's own keys: :func:`build_dataloader` returns a :class:`HyperParallelStreamLoader` whose items are
  ``collate_fn([transform(row) for row in batch_size rows])``, as its ``FixedBatchDataLoader`` makes them.
- ``len(train_dataloader)`` raises ``TypeError`` (an unsized stream: the run is ``training.train_iters``
  steps long); ``set_epoch`` does nothing (the stream's epochs roll over per partition).
- ``HyperIter`` with ``use_background_prefetcher`` calls ``state_dict()`` after every item it prefetches and
  keeps the one of the item training took; without it, ``CheckpointerCallback`` calls it at the save. Either
  way it is this rank's state, O(its partitions), with no collective: a snapshot per item costs what copying
  a few small dicts costs. ``CheckpointerCallback`` writes it into ``extra_state['train_dataloader']`` (per
  rank with ``save_extra_state_per_rank: true``, its default) and calls ``load_state_dict`` before the first
  step of a resume.

HyperParallel itself is not imported here (it is not on the package index); the builders need only the
arguments it passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..config.stream_config import MixtureConfig, StreamConfig
from ..errors import ConfigError
from ..loader import StreamLoader
from ..runtime.torch_compat import IterableDataset
from ..stream.mixture import open_stream

TARGET = "resumable_stream.integrations.hyper_parallel"

# the keys HyperParallel's own dataloader node carries (examples/training_demo/*.yaml, data.batching): read by
# its trainer or by build_dataloader, not by us
_HP_LOADER_KEYS = frozenset({"dataloader_type", "data_rearrange_map", "data_sharding", "get_batch",
                             "use_background_prefetcher", "pp_shared_data", "persistent_workers"})


class HyperParallelStreamDataset(IterableDataset):
    """What :func:`build_dataset` returns: the stream's ``data:`` config, this rank's place and HyperParallel's
    sample transform. An iterable dataset (HyperParallel makes no batch sampler for it); the stream is opened
    by :func:`build_dataloader`, which knows the DataLoader workers."""

    def __init__(self, config: StreamConfig | MixtureConfig, transform: Callable | None, rank: int | None,
                 world_size: int | None):
        super().__init__()
        self.config, self.transform, self.rank, self.world_size = config, transform, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        raise ConfigError(f"dataloader._target_: the resumable_stream dataset is read by {TARGET}.build_dataloader; "
                          "set it as the dataloader's _target_ (docs/hyper-parallel.md)")


def build_dataset(*, transform: Callable | None = None, tokenizer: Any = None, mesh_context: Any = None,
                  training_config: Any = None, config: str | None = None, **data_keys: Any,
                  ) -> HyperParallelStreamDataset:
    """The ``dataset._target_`` of HyperParallel's yaml.

    Args:
        transform: HyperParallel's sample transform (``dataset.data_transform``): a row to a training sample.
        tokenizer, training_config: passed by HyperParallel; the tokenizer is the transform's, the seeds and
            batch sizes are the dataloader's and ours (``shuffle_seed``).
        mesh_context: HyperParallel's MeshContext: ``dp_rank`` / ``dp_size`` place this rank (None: the
            stream's defaults, torch.distributed or $RANK / $WORLD_SIZE).
        config: a resumable-stream yaml (its ``data:`` section), instead of the keys inline.
        **data_keys: our ``data:`` keys (docs/configuration.md).
    Raises:
        ConfigError: no keys, both a file and keys, or a wrong key or value (named).
    """
    del tokenizer, training_config
    if config is not None and data_keys:
        raise ConfigError(f"dataset: got config={config!r} and the keys {sorted(data_keys)}; allowed: one of them "
                          "(a resumable-stream yaml, or its data: keys inline)")
    if config is not None:
        if not isinstance(config, str):
            raise ConfigError(f"dataset.config: got {type(config).__name__}; allowed: the path of a resumable-stream "
                              "yaml")
        stream_config = StreamConfig.from_yaml(config)
    elif data_keys:
        # only the stream's keys: the sample transform is HyperParallel's (dataset.data_transform), so our
        # transform keys (tokenizer, packing, ...) would be silently unused; they are refused, named
        stream_config = StreamConfig.from_dict(data_keys, extra_keys=())
    else:
        raise ConfigError("dataset: no data keys; allowed: our data: keys inline (dataset_name_or_path, ...) or "
                          "config: a resumable-stream yaml (docs/hyper-parallel.md)")
    if transform is not None and not callable(transform):
        raise ConfigError(f"transform: got {type(transform).__name__}; allowed: HyperParallel's sample transform "
                          "(a callable) or None")
    rank, world_size = _dp_place(mesh_context)
    return HyperParallelStreamDataset(stream_config, transform, rank, world_size)


def _dp_place(mesh_context: Any) -> tuple[int | None, int | None]:
    if mesh_context is None:
        return None, None
    rank, size = getattr(mesh_context, "dp_rank", None), getattr(mesh_context, "dp_size", None)
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise ConfigError(f"mesh_context: dp_rank={rank!r}, dp_size={size!r}; allowed: integers with "
                          "0 <= dp_rank < dp_size (HyperParallel's MeshContext)")
    return rank, size


class HyperParallelStreamLoader:
    """HyperParallel's ``train_dataloader`` over our stream: unsized, ``set_epoch``, and the
    :class:`StreamLoader`'s ``state_dict`` / ``load_state_dict`` (what training consumed, cheap, local)."""

    def __init__(self, loader: StreamLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        raise TypeError("a resumable stream has no length: the run is training.train_iters (or train_samples) "
                        "steps long")

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state, where="HyperParallel checkpoint extra_state['train_dataloader']")

    def pop_consumed_keys(self) -> list[str]:
        """The keys of the samples in the items handed out since the last call (``loader.keep_keys``)."""
        return self.loader.pop_consumed_keys()


class _ItemCollator:
    """An item's raw rows -> HyperParallel's transform on each -> its collate_fn (picklable: runs in the
    DataLoader workers)."""

    def __init__(self, transform: Callable | None, collate_fn: Callable | None):
        self.transform, self.collate_fn = transform, collate_fn

    def __call__(self, rows: list[dict]) -> Any:
        samples = [self.transform(row) for row in rows] if self.transform is not None else rows
        return self.collate_fn(samples) if self.collate_fn is not None else samples


def build_dataloader(*, dataset: Any, collate_fn: Callable | None = None, batch_sampler: Any = None,
                     batch_size: int = 1, sampler_type: str = "single", dp_world_size: int | None = None,
                     max_seq_len: int | None = None, seed: int | None = None, num_workers: int = 0,
                     drop_last: bool = True, pin_memory: bool = False, prefetch_factor: int | None = None,
                     **hyper_parallel_keys: Any) -> HyperParallelStreamLoader:
    """The ``dataloader._target_`` of HyperParallel's yaml (its ``data.batching.build_dataloader`` passes the
    keyword arguments; ``num_workers`` / ``pin_memory`` / ``prefetch_factor`` / ``drop_last`` come from the
    yaml).

    Raises:
        ConfigError: another dataset, a batch sampler, a dp_world_size that is not the dataset's, drop_last
            false, or a key neither HyperParallel's nor ours (named).
    """
    del max_seq_len, seed     # the stream's order is its own (shuffle_seed); no token budget: fixed batches
    unknown = sorted(set(hyper_parallel_keys) - _HP_LOADER_KEYS)
    if unknown:
        raise ConfigError(f"dataloader: unknown keys {unknown}; allowed: num_workers, pin_memory, prefetch_factor, "
                          f"drop_last and HyperParallel's own {sorted(_HP_LOADER_KEYS)}")
    if not isinstance(dataset, HyperParallelStreamDataset):
        raise ConfigError(f"dataset._target_: {TARGET}.build_dataloader reads the dataset of {TARGET}.build_dataset; "
                          f"got a {type(dataset).__name__}")
    if batch_sampler is not None:
        raise ConfigError(f"batch_sampler: got a {type(batch_sampler).__name__}; allowed: None (the stream orders "
                          "and shards its own rows)")
    if sampler_type not in ("single", "cyclic"):
        raise ConfigError(f"dataloader.sampler_type: got {sampler_type!r}; allowed: 'single' or 'cyclic' (one "
                          "order: the stream's)")
    if dp_world_size is not None and dataset.world_size is not None and dp_world_size != dataset.world_size:
        raise ConfigError(f"dp_world_size: got {dp_world_size}, the dataset was built for dp_size "
                          f"{dataset.world_size}; allowed: the same mesh")
    if drop_last is not True:
        raise ConfigError(f"dataloader.drop_last: got {drop_last!r}; allowed: true (the stream is endless: every "
                          "item is whole)")
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError(f"collate_fn: got {type(collate_fn).__name__}; allowed: the trainer's collator (callable)")
    stream = open_stream(dataset.config, rank=dataset.rank, world_size=dataset.world_size, num_workers=num_workers)
    loader = StreamLoader(stream, batch_size, collate_fn=_ItemCollator(dataset.transform, collate_fn),
                          num_workers=num_workers, prefetch_factor=prefetch_factor if num_workers else None,
                          pin_memory=pin_memory, per_rank_state=True)   # saved per rank; HyperIter asks after
    return HyperParallelStreamLoader(loader)                            # every item, from its prefetch thread
