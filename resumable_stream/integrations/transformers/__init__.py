"""Integration with ``transformers.Trainer``: no batch replay, stream sidecars in every checkpoint.

The yaml training app built on it is :mod:`resumable_stream.app.train` (``run_training``).
"""

from .callbacks import MixtureWeightsCallback
from .patch import EvalStream, TrainingStream, patch_trainer, stream_loader

__all__ = ["EvalStream", "MixtureWeightsCallback", "TrainingStream", "patch_trainer", "stream_loader"]
