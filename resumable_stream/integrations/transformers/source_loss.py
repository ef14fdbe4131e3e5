"""``data.log_source_loss``: each mixture source's training loss for ``train_log.jsonl``, summed without gradients
from the logits and the batch's ``source_ids`` (which the patched ``compute_loss`` takes out before the model)."""

from __future__ import annotations

from typing import Any

from ...transforms.chat import IGNORE_INDEX


class SourceLoss:
    """Per source: summed token cross-entropy and labelled tokens since the last :meth:`take`."""

    def __init__(self, sources: int):
        self.sources = sources
        self.sums = [0.0] * sources
        self.tokens = [0] * sources

    def add(self, source_ids: Any, logits: Any, labels: Any) -> None:
        """One micro-batch: ``source_ids`` and ``labels`` (examples, tokens), ``logits`` (examples, tokens, vocab)."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            target = labels[:, 1:].to(logits.device)
            source = source_ids[:, 1:].to(logits.device)
            scores = logits[:, :-1, :].float()
            loss = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="none")
            counted = (target.reshape(-1) != IGNORE_INDEX) & (source.reshape(-1) >= 0)
            index = source.reshape(-1)[counted]
            sums = torch.zeros(self.sources, dtype=torch.float64, device=loss.device)
            sums.index_add_(0, index, loss[counted].double())
            tokens = torch.bincount(index, minlength=self.sources)
        for i, (s, n) in enumerate(zip(sums.tolist(), tokens.tolist())):
            self.sums[i] += s
            self.tokens[i] += int(n)

    def take(self) -> tuple[list[float], list[int]]:
        """The sums and token counts so far; starts a new interval."""
        out = (self.sums, self.tokens)
        self.sums, self.tokens = [0.0] * self.sources, [0] * self.sources
        return out


def source_means(sums: list[float], tokens: list[int], labels: tuple[str, ...]) -> dict[str, float | None]:
    """Each source's mean loss per labelled token (None: none of its tokens in the interval)."""
    return {label: (round(s / n, 6) if n else None) for label, s, n in zip(labels, sums, tokens)}
