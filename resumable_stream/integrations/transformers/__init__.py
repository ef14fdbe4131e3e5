"""Integration with ``transformers.Trainer``: no batch replay, stream sidecars in every checkpoint.

The yaml training app built on it is :mod:`resumable_stream.app.train` (``run_training``).
"""

from .patch import EvalStream, TrainingStream, patch_trainer, stream_loader

__all__ = ["EvalStream", "TrainingStream", "patch_trainer", "stream_loader"]
