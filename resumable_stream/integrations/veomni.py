"""A resumable stream as VeOmni's training dataset and dataloader (VeOmni 0.1.12), registered as
``resumable_stream`` on import. Our loader, not VeOmni's ``StatefulDataLoader``: that one restarts at every
VeOmni epoch and replays batches with workers (docs/veomni.md has the measurements)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..config.stream_config import StreamConfig
from ..errors import ConfigError
from .checkpoints import RowsCollator, TrainerLoader

NAME = "resumable_stream"     # the datasets_type and dataloader.type this module registers


class VeOmniStreamDataset:
    """What :func:`build_dataset` returns: the ``data:`` config and VeOmni's transform; the stream is opened by
    :func:`build_dataloader`, which knows the workers. No ``__len__``: VeOmni counts steps from its own keys."""

    def __init__(self, config: Any, transform: Callable | None, train_path: str):
        self.config, self.transform, self.train_path = config, transform, train_path

    def __iter__(self) -> Iterator[Any]:
        raise ConfigError(f"data.dataloader.type: the {NAME} dataset is read by the {NAME} dataloader; set "
                          f"data.dataloader.type: {NAME} in VeOmni's yaml (docs/veomni.md)")


def build_dataset(train_path: str, transform: Callable | None = None, dataloader: dict | None = None,
                  **_veomni_data_keys: Any) -> VeOmniStreamDataset:
    """VeOmni's ``build_dataset`` for ``datasets_type: resumable_stream``: ``train_path`` is a resumable-stream
    ``*.yml`` whose data keys decide the order (VeOmni's ``train.seed`` seeds the model, not the data)."""
    dl_type = (dataloader or {}).get("type", NAME)
    if dl_type != NAME:
        raise ConfigError(f"data.dataloader.type: got {dl_type!r}; allowed: {NAME!r} with data.datasets_type: "
                          f"{NAME} (our dataloader keeps the state of what training consumed; docs/veomni.md)")
    if not isinstance(train_path, str) or not train_path.endswith((".yml", ".yaml")):
        raise ConfigError(f"data.train_path: got {str(train_path)[:200]!r}; allowed: the path of a "
                          "resumable-stream yaml (*.yml) holding the data: keys (docs/veomni.md)")
    if train_path.endswith(".yaml"):
        # VeOmni's DataArguments.__post_init__ takes a train_path ending in .yaml for its multi-source yaml
        # (enable_multisource): its EnvironMeter would then parse our file as one and fail mid-setup.
        raise ConfigError(f"data.train_path: got {train_path[:200]!r}; VeOmni reads a train_path ending in "
                          "'.yaml' as its own multi-source yaml; name the resumable-stream yaml '*.yml'")
    if not os.path.isfile(train_path):
        raise ConfigError(f"data.train_path: {train_path[:200]!r} is not a file; allowed: a resumable-stream yaml")
    if transform is not None and not callable(transform):
        raise ConfigError(f"transform: got {type(transform).__name__}; allowed: VeOmni's data transform (callable)")
    return VeOmniStreamDataset(StreamConfig.from_yaml(train_path), transform, train_path)


class VeOmniStreamLoader(TrainerLoader):
    """VeOmni's ``train_dataloader``: each item is one optimizer step's micro-batches on this rank, as its native
    dataloader makes them with ``dyn_bsz: false``. ``set_epoch`` does nothing: VeOmni's epochs continue the data."""

    where = "VeOmni checkpoint extra_state['train_dataloader']"


class _StepCollator(RowsCollator):
    """A step's raw rows -> VeOmni's transform on each (a list of features per row) -> its micro-batch collator."""

    @staticmethod
    def untransformed(row: dict) -> list[dict]:
        return [row]


def build_dataloader(dataset: Any, micro_batch_size: int, global_batch_size: int, dataloader_batch_size: int,
                     dyn_bsz: bool = True, num_workers: int = 0, prefetch_factor: int | None = None,
                     pin_memory: bool = False, collate_fn: Callable | None = None, drop_last: bool = True,
                     **_veomni_loader_keys: Any) -> VeOmniStreamLoader:
    """VeOmni's ``build_dataloader`` for ``data.dataloader.type: resumable_stream``: the stream of this
    data-parallel rank (sequence-parallel peers read the same rows), micro-batched as VeOmni's own loader does."""
    from veomni.data.data_collator import MainCollator, MakeMicroBatchCollator
    from veomni.distributed.parallel_state import get_parallel_state

    if not isinstance(dataset, VeOmniStreamDataset):
        raise ConfigError(f"data.datasets_type: the {NAME} dataloader reads the {NAME} dataset; got a "
                          f"{type(dataset).__name__} (set data.datasets_type: {NAME})")
    if dyn_bsz:
        raise ConfigError("train.dyn_bsz: got true; allowed: false with the resumable_stream dataloader (VeOmni's "
                          "dynamic batching keeps a buffer of rows outside the dataloader's state; use "
                          "data.packing in the resumable-stream yaml for token-budget batches)")
    if not drop_last:
        raise ConfigError("data.dataloader.drop_last: got false; allowed: true (the stream is endless: every step "
                          "is whole)")
    parallel = get_parallel_state()
    if global_batch_size % (micro_batch_size * parallel.dp_size):
        raise ConfigError(f"train.global_batch_size: got {global_batch_size}; allowed: a multiple of "
                          f"micro_batch_size x dp_size = {micro_batch_size * parallel.dp_size}")
    num_micro_batch = global_batch_size // (micro_batch_size * parallel.dp_size)
    collate = MakeMicroBatchCollator(num_micro_batch=num_micro_batch,
                                     internal_data_collator=collate_fn if collate_fn is not None else MainCollator())
    return VeOmniStreamLoader.of(dataset.config, parallel.dp_rank, parallel.dp_size, dataloader_batch_size,
                                 _StepCollator(dataset.transform, collate), num_workers, prefetch_factor, pin_memory)


def register() -> None:
    """Register the builders in VeOmni's registries as ``resumable_stream`` (once); ConfigError without VeOmni."""
    try:
        from veomni.data.data_loader import DATALOADER_REGISTRY
        from veomni.data.dataset import DATASET_REGISTRY
    except ImportError as e:
        raise ConfigError(f"veomni: cannot be imported ({e}); resumable_stream.integrations.veomni needs VeOmni: "
                          "pip install veomni (docs/veomni.md)") from e
    for registry, builder in ((DATASET_REGISTRY, build_dataset), (DATALOADER_REGISTRY, build_dataloader)):
        if NAME not in list(registry):    # (``in`` on VeOmni's Registry raises ValueError for a missing key)
            registry.register(NAME, builder)


if importlib.util.find_spec("veomni") is not None:    # importing this module is the registration
    register()
