"""``_target_`` builders for HyperParallel's trainer: our stream as its dataset and train dataloader, whose
``state_dict`` is this rank's, cheap and with no collective (docs/hyper-parallel.md, "The contract")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..config.stream_config import MixtureConfig, StreamConfig
from ..errors import ConfigError
from ..runtime.torch_compat import IterableDataset
from .checkpoints import RowsCollator, TrainerLoader

TARGET = "resumable_stream.integrations.hyper_parallel"

# the keys HyperParallel's own dataloader node carries (examples/training_demo/*.yaml, data.batching): read by
# its trainer or by build_dataloader, not by us
_HP_LOADER_KEYS = frozenset({"dataloader_type", "data_rearrange_map", "data_sharding", "get_batch",
                             "use_background_prefetcher", "pp_shared_data", "persistent_workers"})


class HyperParallelStreamDataset(IterableDataset):
    """What :func:`build_dataset` returns: the ``data:`` config, this rank's place and HyperParallel's transform; the
    stream is opened by :func:`build_dataloader`, which knows the DataLoader workers."""

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
    """The ``dataset._target_`` of HyperParallel's yaml: our ``data:`` keys inline, or ``config``: a resumable-stream
    yaml. ``transform`` is HyperParallel's sample transform; ``mesh_context``'s ``dp_rank`` / ``dp_size`` place
    this rank (None: the stream's defaults); ``tokenizer`` and ``training_config`` are not used."""
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


class HyperParallelStreamLoader(TrainerLoader):
    """HyperParallel's ``train_dataloader`` over our stream: unsized, and the :class:`StreamLoader`'s state (what
    training consumed, cheap, local)."""

    where = "HyperParallel checkpoint extra_state['train_dataloader']"

    def __len__(self) -> int:
        raise TypeError("a resumable stream has no length: the run is training.train_iters (or train_samples) "
                        "steps long")


def build_dataloader(*, dataset: Any, collate_fn: Callable | None = None, batch_sampler: Any = None,
                     batch_size: int = 1, sampler_type: str = "single", dp_world_size: int | None = None,
                     max_seq_len: int | None = None, seed: int | None = None, num_workers: int = 0,
                     drop_last: bool = True, pin_memory: bool = False, prefetch_factor: int | None = None,
                     **hyper_parallel_keys: Any) -> HyperParallelStreamLoader:
    """The ``dataloader._target_`` of HyperParallel's yaml (``num_workers``, ``pin_memory``, ``prefetch_factor``,
    ``drop_last`` from the yaml): refuses another dataset, a batch sampler, another dp_world_size, drop_last false
    and unknown keys, named."""
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
    return HyperParallelStreamLoader.of(dataset.config, dataset.rank, dataset.world_size, batch_size,
                                        RowsCollator(dataset.transform, collate_fn), num_workers, prefetch_factor,
                                        pin_memory)
