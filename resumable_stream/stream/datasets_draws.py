"""The sources a mixture draws, in the sequence of ``datasets.interleave_datasets`` over iterable datasets
(datasets 4.0; what ``llamafactory-cli`` mixes with ``mix_strategy: interleave_*``), for a mixture that must
take the very samples it takes.

* without probabilities: the sources in turn (``CyclingMultiSourcesExamplesIterable``);
* with them: ``numpy.random.default_rng(seed).choice(n, size=1000, p=probabilities)``, block after block
  (``RandomlyCyclingMultiSourcesExamplesIterable``); from the second epoch the generator is seeded as datasets'
  ``IterableDataset._effective_generator`` seeds it for ``set_epoch(epoch)``.

Draw k of an epoch is a pure function of (seed, epoch, k): a resume regenerates the blocks before k once
(k / 1000 calls of numpy), then continues block by block.

datasets' epochs go with its draws (``MixtureStream`` does them): each epoch restarts every source from its first
row and draws from draw 0 again; a source runs out with its last row (datasets reads one row ahead), and the epoch
ends right after it (``first_exhausted``) or after that of the last source to run out (``all_exhausted``; one
that ran out before restarts at once from its first row)."""

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
