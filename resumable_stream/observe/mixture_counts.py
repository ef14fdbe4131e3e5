"""The realized mixture: each source's samples and tokens in the batches training consumed, counted where a batch
is built and carried with it, so prefetched batches never count and no memory is shared (docs/mixtures.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

NO_SOURCE = -1      # in a batch's source_ids: padding, or a token whose source is not known


def mixture_labels(stream: Any) -> tuple[str, ...] | None:
    """The source labels of a mixture stream, in order; None for a single dataset."""
    if getattr(stream, "kind", None) != "mixture":
        return None
    return tuple(stream.config.labels)


def consumed_by_source(snapshot: Any) -> list[int]:
    """Per source, the samples a mixture partition's state (``MixturePartitionState``) has consumed."""
    return [int(s.consumed) for s in snapshot.sources]


def example_runs(example: dict, index: dict[str, int]) -> list[tuple[int, int]]:
    """``(source, tokens)`` of each sample in a training example, in token order (source NO_SOURCE: a key of no
    known source). ``key_tokens`` (TextProcessor.take(with_key_tokens=True)) splits a packed block between its
    samples; without it the example's tokens are its first sample's."""
    keys = example.get("keys") or []
    ids = example.get("input_ids")
    total = len(ids) if ids is not None else 0
    per_key = example.get("key_tokens")
    if per_key is None or len(per_key) != len(keys):
        per_key = [total] + [0] * (len(keys) - 1) if keys else []
    return [(index.get(str(key).split("/", 1)[0], NO_SOURCE), int(n)) for key, n in zip(keys, per_key) if n]


def tokens_by_source(runs: list[list[tuple[int, int]]], sources: int) -> list[int]:
    """Per source, the tokens of a batch whose examples have these :func:`example_runs`."""
    out = [0] * sources
    for example in runs:
        for i, n in example:
            if i != NO_SOURCE:
                out[i] += n
    return out


def source_id_rows(runs: list[list[tuple[int, int]]]) -> list[np.ndarray]:
    """Per example, the source of each of its tokens (a batch's ``source_ids`` before padding)."""
    return [np.repeat(np.asarray([i for i, _ in example], dtype=np.int64), [n for _, n in example])
            for example in runs]


def realized_shares(counts: dict[str, int]) -> dict[str, float | None]:
    """Each source's share of ``counts`` (None for all when there are none)."""
    total = sum(counts.values())
    return {label: (round(n / total, 6) if total else None) for label, n in counts.items()}
