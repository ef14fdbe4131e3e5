"""The sources a mixture draws in the sequence of ``datasets.interleave_datasets`` (datasets 4.0; LLaMA-Factory's
``mix_strategy: interleave_*``): the sources in turn without probabilities, else
``numpy.random.default_rng(seed).choice(n, size=1000, p=...)`` block after block, seeded per epoch as datasets'
``_effective_generator``. Draw k of an epoch is a pure function of (seed, epoch, k); the epochs are datasets'
too (docs/mixtures.md)."""

from __future__ import annotations

import numpy as np

MODES = ("datasets_cycle", "datasets_choice")
BLOCK = 1000        # datasets' random_batch_size


def _generator(seed: int, epoch: int, partition: int) -> np.random.Generator:
    if epoch > 0:      # datasets' _effective_generator
        effective = int(np.random.default_rng(seed).integers(0, 1 << 63)) - epoch
        seed = (1 << 63) + effective if effective < 0 else effective
    # one rank and one worker (partition 0): datasets' own generator; other partitions: their own sequence
    return np.random.default_rng(seed if partition == 0 else [seed, partition])


class DatasetsDraws:
    """Blocks of draws of one mixture, per (epoch, partition), continued without regenerating."""

    def __init__(self, mode: str, weights: tuple[float, ...], seed: int):
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
        self.mode, self.seed, self.n = mode, int(seed), len(weights)
        p = np.asarray(weights, dtype=np.float64)
        with np.errstate(over="ignore"):
            if not np.isfinite(p.sum()):      # weights near the float maximum: the sum overflows
                p = p / p.max()
        self.p = p if p.sum() == 1.0 else p / p.sum()
        self._at: dict[int, tuple[int, int, np.random.Generator]] = {}   # partition -> (epoch, next block, rng)

    def block(self, epoch: int, partition: int, start: int) -> tuple[int, list[int]]:
        """(first draw, sources) of the block holding draw ``start`` of (epoch, partition)."""
        first = start // BLOCK
        if self.mode == "datasets_cycle":
            return first * BLOCK, [(first * BLOCK + i) % self.n for i in range(BLOCK)]
        at = self._at.get(partition)
        if at is None or at[0] != epoch or at[1] > first:
            at = (epoch, 0, _generator(self.seed, epoch, partition))
        _, k, rng = at
        while True:
            picks = rng.choice(self.n, size=BLOCK, p=self.p)
            k += 1
            if k > first:
                self._at[partition] = (epoch, k, rng)
                return first * BLOCK, picks.tolist()
