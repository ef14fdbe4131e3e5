"""What the data-path metrics cost, against the step time of the tiny example model.

    .venv/bin/python benchmarks/metrics_overhead.py [--batches 4000] [--steps 40]

1. Per batch: a StreamLoader over local parquet (tokenized text, workers 0) with the metrics as shipped, and
   with every recording call replaced by a no-op, in the same run (alternating rounds, the best of each): the difference per batch.
2. Per logging step: ``DataMetricsLog.on_log`` (a reading of the counters, the figures, the watch), timed alone.
3. The tiny model's step time (examples/tiny/train_lm.yaml, CPU, one thread), from a real Trainer run.
The overhead is (per batch + per log) / step time, i.e. with ``logging_steps: 1``, the worst case.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402,F401  (private HF cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny")


def _loader(data_dir: str):
    from transformers import AutoTokenizer

    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.config.transforms import TransformConfig
    from resumable_stream.loader import StreamLoader
    from resumable_stream.transforms.text import TextProcessor, collate

    tok = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    tok.pad_token = tok.pad_token or tok.eos_token
    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data_dir, "*.parquet"), shuffle=True,
                       buffer_size=1024)
    stream = ResumableStream(cfg)
    factory = functools.partial(TextProcessor, tok, TransformConfig(max_seq_len=64, packing=True))
    return stream, StreamLoader(stream, batch_size=8, processor_factory=factory,
                                collate_fn=functools.partial(collate, pad_token_id=tok.pad_token_id))


def per_batch_seconds(data_dir: str, batches: int) -> float:
    stream, loader = _loader(data_dir)
    it = iter(loader)
    for _ in range(50):        # warm: windows filled, tokenizer loaded
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    took = (time.perf_counter() - t0) / batches
    stream.close()
    return took


class _Off:
    """Every recording call of the metrics a no-op (what the loader cost before them)."""

    def __enter__(self):
        from resumable_stream import loader, source
        from resumable_stream.io import ranged
        from resumable_stream.observe import metrics
        from resumable_stream.sources import parquet_rows as parquet_files
        from resumable_stream.sources import prefetch

        self.saved = []
        noop = lambda *a, **k: None  # noqa: E731
        for module, name in ((metrics, "record_row_group"), (source, "record_row_group"),
                             (prefetch, "record_prefetch_take"), (ranged, "record_request"),
                             (parquet_files, "record_retry"), (metrics.LoaderCounters, "batch"),
                             (loader, "token_count")):
            self.saved.append((module, name, getattr(module, name)))
            setattr(module, name, noop if name != "token_count" else (lambda batch: 0))
        return self

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)


def per_log_seconds(data_dir: str, calls: int = 2000) -> float:
    from resumable_stream.integrations.transformers.data_metrics import DataMetricsLog
    from resumable_stream.observe.monitoring import MonitorSettings

    stream, loader = _loader(data_dir)
    it = iter(loader)
    for _ in range(20):
        next(it)
    log = DataMetricsLog(loader, MonitorSettings(data_bound_steps=50), {"workers": 0}, 0, 1)
    t0 = time.perf_counter()
    for step in range(calls):
        log.on_log({"loss": 1.0}, step)
    took = (time.perf_counter() - t0) / calls
    stream.close()
    return took


def step_seconds(steps: int) -> float:
    import json
    import subprocess

    import yaml

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(TINY, "train_lm.yaml"), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
        doc["data"]["data_files"] = os.path.join(TINY, "data", "*.parquet")
        doc["data"].pop("consumed_log")
        doc["train"].update(output_dir=os.path.join(d, "out"), max_steps=steps, save_steps=10_000, logging_steps=1,
                            disable_tqdm=True)
        path = os.path.join(d, "c.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), path], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(d, "out", "train_log.jsonl"), encoding="utf-8") as f:
            lines = [json.loads(x) for x in f if '"loss"' in x]
    later = lines[5:]          # the first steps include the start
    return sum(x["data_step_s"] for x in later) / len(later)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of on / off, alternating (the best of each)")
    args = ap.parse_args()
    from resumable_stream.testing import write_parquet_dataset

    with tempfile.TemporaryDirectory() as d:
        write_parquet_dataset(d, rows=200_000, files=4, row_group_size=4096)
        on, off = [], []
        for _ in range(args.rounds):
            on.append(per_batch_seconds(d, args.batches))
            with _Off():
                off.append(per_batch_seconds(d, args.batches))
        batch_cost = max(0.0, min(on) - min(off))
        log_cost = per_log_seconds(d)
    step = step_seconds(args.steps)
    print(f"loader per batch: {min(off) * 1e6:.1f} us without metrics, {min(on) * 1e6:.1f} us with "
          f"(+{batch_cost * 1e6:.1f} us)")
    print(f"per logging step (DataMetricsLog.on_log, one rank): {log_cost * 1e6:.1f} us")
    print(f"tiny model step (examples/tiny, CPU, 1 thread): {step * 1e3:.1f} ms")
    share = (batch_cost + log_cost) / step
    print(f"overhead with logging_steps 1: {share:.3%} of the step time ({'PASS' if share < 0.01 else 'FAIL'}: "
          "target < 1%)")


if __name__ == "__main__":
    main()
