"""The ``data:`` yaml, validated once into typed settings: the stream config, overrides, the formats registry, the transform keys, the trainer yaml. A leaf above runtime and observe: it imports no reader."""

from .stream_config import MixtureConfig, StreamConfig

__all__ = ["MixtureConfig", "StreamConfig"]
