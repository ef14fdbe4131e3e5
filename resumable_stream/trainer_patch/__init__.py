"""Integration with ``transformers.Trainer``: no batch replay, stream sidecars in every checkpoint."""

from .patch import EvalStream, TrainingStream, patch_trainer, stream_loader

__all__ = ["EvalStream", "TrainingStream", "patch_trainer", "run_training", "stream_loader"]


def run_training(config_path: str, overrides=(), **argument_overrides):
    """Train from a yaml file with ``key=value`` ``overrides`` (see :mod:`resumable_stream.trainer_patch.train`)."""
    from .train import run_training as _run

    return _run(config_path, overrides, **argument_overrides)
