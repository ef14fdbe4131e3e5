"""Online mixing, an example of changing a mixture's weights from code while training, resumably.

    python examples/online_mixing.py examples/tiny/train_mix.yaml [--every 20] [--eta 2.0] [key=value ...]
    torchrun --nproc_per_node=2 examples/online_mixing.py examples/tiny/train_mix.yaml

Every ``--every`` steps the callback measures the model's loss on a few fixed samples of each source (the
first rows of its first file) and moves weight towards the sources the model does worse on:

    w_s <- w_s * exp(eta * (loss_s - mean loss)), normalised, at least --floor, rounded to 3 decimals

(a small exponentiated-gradient rule in the spirit of online data mixing: an example of the hook,
``MixtureWeightsCallback``, not a claim that it trains better models). The new weights apply from the next
batch on every rank, are logged in train_log.jsonl (``mixture_changes``) and saved in the checkpoints' weight
history, so a run killed and restarted reads the very samples an uninterrupted one reads.
"""

from __future__ import annotations

import argparse
import glob
import math
import sys

import pyarrow.parquet as pq
import torch

from resumable_stream.app.train import run_training
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.integrations.transformers import MixtureWeightsCallback


def probe_texts(config_path: str, overrides: list[str], rows: int) -> dict[str, list[str]]:
    """label -> the text of the first ``rows`` rows of each source's first parquet file."""
    cfg = TrainerConfig.from_yaml(config_path, overrides)
    column = cfg.transform.text_column
    out = {}
    for label, source in zip(cfg.stream.labels, cfg.stream.sources):
        patterns = [source.data_files] if isinstance(source.data_files, str) else list(source.data_files)
        files = sorted(f for pattern in patterns for f in glob.glob(pattern))
        out[label] = pq.read_table(files[0], columns=[column]).column(column).to_pylist()[:rows]
    return out


class LossReweighting(MixtureWeightsCallback):
    """Reweights every ``every`` steps from each source's loss on its probe texts (module doc)."""

    def __init__(self, probes: dict[str, list[str]], every: int, eta: float, floor: float, max_len: int = 64):
        self.probes, self.every, self.eta, self.floor, self.max_len = probes, every, eta, floor, max_len

    def new_weights(self, args, state, current, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every or model is None or processing_class is None:
            return None
        losses = {label: self._loss(model, processing_class, texts) for label, texts in self.probes.items()}
        mean = sum(losses.values()) / len(losses)
        raw = {label: current[label] * math.exp(self.eta * (losses[label] - mean)) for label in losses}
        total = sum(raw.values())
        floored = {label: max(self.floor, w / total) for label, w in raw.items()}
        total = sum(floored.values())
        return {label: round(w / total, 3) for label, w in floored.items()}

    def _loss(self, model, tokenizer, texts: list[str]) -> float:
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            loss = model(**{k: v.to(model.device) for k, v in batch.items()}, labels=labels.to(model.device)).loss
        model.train(was_training)
        return float(loss)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--every", type=int, default=20, help="reweight every N optimizer steps")
    parser.add_argument("--eta", type=float, default=2.0, help="step size of the update")
    parser.add_argument("--floor", type=float, default=0.05, help="the least weight a source keeps")
    parser.add_argument("--probe-rows", type=int, default=8, help="fixed samples per source")
    args, overrides = parser.parse_known_args(argv)
    probes = probe_texts(args.config, overrides, args.probe_rows)
    run_training(args.config, overrides, callbacks=[LossReweighting(probes, args.every, args.eta, args.floor)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
