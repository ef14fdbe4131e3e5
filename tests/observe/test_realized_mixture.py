"""The realized mixture (issue 39 item 4): per-source samples and tokens of the batches handed to the training loop,
their Prometheus series, the per-source loss, and the report's panel of target vs realized weights.

References are computed here without the code under test: sample sources from the consumed keys, token counts
by tokenizing the mixture's samples in stream order and cutting the packed blocks by hand, per-source losses
from the model's own loss on one source's rows.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import socket
import urllib.request

import pytest
from repo_paths import REPO_ROOT

from resumable_stream import ConfigError, MixtureStream, StreamConfig
from resumable_stream.loader import StreamLoader
from resumable_stream.observe.prometheus import serve
from resumable_stream.testing import write_parquet_dataset
from resumable_stream.transforms import TextProcessor, TransformConfig, collate

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
WEIGHTS = {"web": 0.6, "code": 0.3, "notes": 0.1}
SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("realized")
    for i, label in enumerate(WEIGHTS):
        write_parquet_dataset(str(root / label), rows=300, files=2, row_group_size=50, words=8 + 10 * i,
                              prefix=label)
    return root


def mixture(data, **shared):
    return StreamConfig.from_dict({"shuffle": True, "shuffle_seed": 7, "buffer_size": 64, **shared, "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": str(data / label / "*.parquet"),
         "weight": w} for label, w in WEIGHTS.items()]})


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


def packed_loader(stream, tok, **kw) -> StreamLoader:
    return StreamLoader(stream, BATCH, functools.partial(collate, pad_token_id=tok.pad_token_id),
                        functools.partial(TextProcessor, tok, TransformConfig(packing=True, max_seq_len=SEQ)), **kw)


def per_batch(loader, batches: int) -> list[dict[str, tuple[int, ...]]]:
    """The loader's per-source counters added by each of its next ``batches`` batches (and the batch)."""
    out, it = [], iter(loader)
    for _ in range(batches):
        before = loader.counters.per_source()
        batch = next(it)
        now = loader.counters.per_source()
        out.append({k: tuple(a - b for a, b in itertools.zip_longest(now[k], before[k], fillvalue=0))
                    for k in now} | {"batch": batch})
    return out


def test_realized_shares_follow_the_target_weights_within_binomial_tolerance(data):
    """Over windows of N = 500 draws, each source's share of the samples handed out is within 4 binomial
    standard deviations, 4 * sqrt(w (1 - w) / N) (0.088 for w = 0.6, 0.054 for 0.1), of the target weight at the
    window's start (``current_weights``); over all 4000 draws within 4 * sqrt(w (1 - w) / 4000). The counts are
    the loader's per-source counters; each batch's equal its samples' keys (``label/shard:row``) per source."""
    stream = MixtureStream(mixture(data), rank=0, world_size=1)
    loader = StreamLoader(stream, batch_size=50, keep_keys=True)
    window, windows = 500, 8
    labels = list(WEIGHTS)
    total = dict.fromkeys(labels, 0)
    it = iter(loader)
    for _ in range(windows):
        target = stream.current_weights()
        assert target == pytest.approx(WEIGHTS)
        before = loader.counters.per_source()["samples"] or (0,) * len(labels)
        for _ in range(window // 50):
            next(it)
        keys = loader.pop_consumed_keys()
        counts = [a - b for a, b in zip(loader.counters.per_source()["samples"], before)]
        assert counts == [sum(k.startswith(label + "/") for k in keys) for label in labels]
        assert sum(counts) == window
        for label, n in zip(labels, counts):
            w = target[label]
            assert abs(n / window - w) <= 4 * math.sqrt(w * (1 - w) / window), (label, n, counts)
            total[label] += n
    n_all = window * windows
    for label in labels:
        w = WEIGHTS[label]
        assert abs(total[label] / n_all - w) <= 4 * math.sqrt(w * (1 - w) / n_all), total


def test_realized_shares_follow_a_schedule_within_binomial_tolerance(data):
    """A ramp (issue 39 item 4 with item 1): ``web``'s weight rises linearly from 0.1 to 3.0 over the first 3000
    samples (``unit: samples``; the others fixed). Computed here from the documented rule alone (one partition:
    draw d reads the schedule at sample d; weights normalised over the sources at each draw), each window of
    N = 500 draws has an expected share of ``web`` equal to the mean of its draws' normalised weights, and a
    binomial variance of at most sum p (1 - p) / N^2; the realized share is within 4 of those standard
    deviations. The loader's ``current_weights()`` at each window's start equals the rule's weights there."""
    def share(d: int) -> dict[str, float]:
        raw = {"web": 0.1 + (3.0 - 0.1) * min(d, 3000) / 3000, "code": 0.3, "notes": 0.1}
        return {k: v / sum(raw.values()) for k, v in raw.items()}

    cfg = StreamConfig.from_dict({"shuffle": True, "shuffle_seed": 7, "buffer_size": 64, "stopping": "never",
                                  "sources": [
        {"label": label, "dataset_name_or_path": "parquet", "data_files": str(data / label / "*.parquet"),
         "weight": ({"schedule": "linear", "unit": "samples", "points": [[0, 0.1], [3000, 3.0]]} if label == "web"
                    else w)} for label, w in WEIGHTS.items()]})
    stream = MixtureStream(cfg, rank=0, world_size=1)
    loader = StreamLoader(stream, batch_size=50, keep_keys=True)
    window, it = 500, iter(loader)
    shares = []
    for start in range(0, 4000, window):
        assert loader.current_weights() == pytest.approx(share(start))
        for _ in range(window // 50):
            next(it)
        keys = loader.pop_consumed_keys()
        n = sum(k.startswith("web/") for k in keys)
        ps = [share(d)["web"] for d in range(start, start + window)]
        expected, sd = sum(ps) / window, math.sqrt(sum(p * (1 - p) for p in ps)) / window
        assert abs(n / window - expected) <= 4 * sd, (start, n, expected)
        shares.append(n / window)
    assert shares[-1] - shares[0] > 0.3      # the ramp is seen: ~0.44 in the first window, ~0.88 in the last
    stream.close()


def _expected_token_sources(data, tok, samples: int) -> list[int]:
    """The source of every token of the packed token stream: the mixture's samples in stream order (a bare
    MixtureStream, its keys' labels), each tokenized as ``format: text`` does (no special tokens, EOS appended)."""
    stream = MixtureStream(mixture(data), rank=0, world_size=1)
    labels = list(WEIGHTS)
    out: list[int] = []
    for sample, where in itertools.islice(stream.iter_partition(0), samples):
        ids = tok(sample["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out += [labels.index(stream.source_label(where))] * len(ids)
    stream.close()
    return out


def test_per_source_tokens_with_packing_match_the_blocks_cut_by_hand_across_resume_and_workers(data, tok, tmp_path):
    """Packed blocks of 16 tokens, 8 per batch: the tokens each source put into each batch (and ``source_ids``,
    the source of every token) equal those of the blocks cut by hand from the tokenized samples; a loader
    resumed from a sidecar after the first batch, when a finished block waits in the transform, continues them,
    and one DataLoader worker gives the same figures."""
    batches = 7
    tokens = _expected_token_sources(data, tok, 2000)
    blocks = [tokens[i * SEQ:(i + 1) * SEQ] for i in range(batches * BATCH)]
    expected = [tuple(sum(b.count(s) for b in blocks[k * BATCH:(k + 1) * BATCH]) for s in range(len(WEIGHTS)))
                for k in range(batches)]

    stream = MixtureStream(mixture(data), rank=0, world_size=1)
    loader = packed_loader(stream, tok, source_ids=True)
    got = per_batch(loader, batches)
    assert [g["tokens"] for g in got] == expected
    assert [g["batch"]["source_ids"].tolist() for g in got[:2]] == [blocks[:BATCH], blocks[BATCH:2 * BATCH]]
    samples = [sum(g["samples"]) for g in got]
    assert sum(samples) == sum(loader.counters.per_source()["samples"]) > 0

    stream = MixtureStream(mixture(data), rank=0, world_size=1)
    first = packed_loader(stream, tok)
    head = per_batch(first, 1)
    (waiting,) = first.transform_states().values()
    assert waiting["meta"]["pending_keys"], "no block waits in the transform: the cut tests nothing"
    first.save_sidecar(str(tmp_path / "state"))
    resumed_stream = MixtureStream(mixture(data), rank=0, world_size=1)
    resumed = packed_loader(resumed_stream, tok)
    resumed.load_sidecar(str(tmp_path / "state"))
    tail = per_batch(resumed, batches - 1)
    assert [g["tokens"] for g in head + tail] == expected
    assert [g["samples"] for g in head + tail] == [g["samples"] for g in got]

    worker_stream = MixtureStream(mixture(data), rank=0, world_size=1, num_workers=1)
    assert [g["tokens"] for g in per_batch(packed_loader(worker_stream, tok), batches)] == expected


def test_the_transform_state_keeps_each_waiting_blocks_per_sample_tokens(tok):
    """Blocks not yet taken are in the transform's state with the tokens each sample put into them: restored,
    ``take(with_key_tokens=True)`` gives the same split (a block of two samples included); a state without them
    (written before they were kept) still loads, its blocks' splits unknown (None)."""
    cfg = TransformConfig(packing=True, max_seq_len=SEQ)
    proc = TextProcessor(tok, cfg)
    for i, words in enumerate((5, 30, 3, 12)):
        proc.feed({"text": " ".join(["word"] * words)}, f"{'ab'[i % 2]}/0:{i}")
    state = json.loads(json.dumps(proc.state(), default=lambda a: a.tolist()))
    taken = [proc.take(with_key_tokens=True) for _ in range(proc.ready())]
    assert any(len(ex["keys"]) > 1 for ex in taken)
    assert all(sum(ex["key_tokens"]) == len(ex["input_ids"]) == SEQ for ex in taken)
    again = TextProcessor(tok, cfg)
    again.load_state(state)
    assert [again.take(with_key_tokens=True) for _ in range(again.ready())] == taken
    del state["meta"]["pending_key_tokens"]
    old = TextProcessor(tok, cfg)
    old.load_state(state)
    assert [old.take(with_key_tokens=True)["key_tokens"] for _ in range(old.ready())] == [None] * len(taken)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_serves_per_source_series_and_scrapes_change_no_sample(data, tok):
    """``source_samples_total`` / ``source_tokens_total`` (labels rank, source) equal the loader's counts and
    ``source_target_weight`` the target; a loader scraped before every batch hands out the same samples and
    state as one never scraped."""
    from prometheus_client.parser import text_string_to_metric_families

    quiet = packed_loader(MixtureStream(mixture(data), rank=0, world_size=1), tok, keep_keys=True)
    list(itertools.islice(quiet, 4))
    stream = MixtureStream(mixture(data), rank=0, world_size=1)
    loader = packed_loader(stream, tok, keep_keys=True)
    port = _free_port()
    server = serve(loader, port, rank=3, addr="127.0.0.1")
    try:
        def scrape():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return {f.name: f for f in text_string_to_metric_families(r.read().decode())}

        it = iter(loader)
        for _ in range(4):
            scrape()
            next(it)
        families = scrape()
    finally:
        server.shutdown()
        server.server_close()
    assert loader.pop_consumed_keys() == quiet.pop_consumed_keys()
    assert json.dumps(loader.state_dict(), default=str) == json.dumps(quiet.state_dict(), default=str)
    counts = loader.counters.per_source()
    for name, values in (("resumable_stream_source_samples", counts["samples"]),
                         ("resumable_stream_source_tokens", counts["tokens"])):
        got = {s.labels["source"]: s.value for s in families[name].samples if s.name.endswith("_total")}
        assert got == dict(zip(WEIGHTS, map(float, values))), name
        assert all(s.labels["rank"] == "3" for s in families[name].samples)
    assert sum(counts["tokens"]) == 4 * BATCH * SEQ
    weights = {s.labels["source"]: s.value for s in families["resumable_stream_source_target_weight"].samples}
    assert weights == pytest.approx(WEIGHTS)


def test_source_loss_equals_the_models_own_loss_on_each_sources_rows(tok):
    """``SourceLoss`` over a batch whose rows come from two sources (and a row split between them) gives, per
    source, the model's own causal-LM loss on that source's tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from resumable_stream.integrations.transformers.source_loss import SourceLoss, source_means

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, len(tok), (4, 12))
    labels = ids.clone()
    labels[3, :2] = -100
    sources = torch.tensor([[0] * 12, [0] * 12, [1] * 12, [1] * 12])
    acc = SourceLoss(2)
    with torch.no_grad():
        acc.add(sources, model(input_ids=ids).logits, labels)
        ref = [model(input_ids=ids[rows], labels=labels[rows]).loss.item() for rows in ([0, 1], [2, 3])]
    sums, counts = acc.take()
    assert counts == [2 * 11, 11 + 10]      # row 3: its second label is -100 (the first is never predicted)
    assert list(source_means(sums, counts, ("a", "b")).values()) == pytest.approx(ref, abs=1e-5)
    assert acc.take() == ([0.0, 0.0], [0, 0])      # a new interval

    split = torch.tensor([[0] * 5 + [1] * 7])      # one packed row: the label of token t+1 counts for its source
    with torch.no_grad():
        logits = model(input_ids=ids[:1]).logits
        acc.add(split, logits, labels[:1])
        each = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")
    sums, counts = acc.take()
    assert counts == [4, 7]
    assert sums == pytest.approx([each[:4].sum().item(), each[4:].sum().item()], abs=1e-4)


def test_log_source_loss_is_validated(tmp_path):
    from resumable_stream.config.trainer import TrainerConfig
    from resumable_stream.integrations.llamafactory.settings import split
    from resumable_stream.observe.monitoring import MonitorSettings

    with pytest.raises(ConfigError, match=r"data\.log_source_loss: got 'yes'; allowed: true or false"):
        MonitorSettings(log_source_loss="yes")
    doc = {"model": {"name_or_path": "x"}, "train": {"output_dir": str(tmp_path / "o")},
           "data": {"dataset_name_or_path": "parquet", "data_files": str(tmp_path / "*.parquet"),
                    "log_source_loss": True}}
    with pytest.raises(ConfigError, match=r"data\.log_source_loss: got true without data\.sources"):
        TrainerConfig.from_dict(doc)
    with pytest.raises(ConfigError, match=r"resumable_stream\.log_source_loss: got True; not supported with "
                                          "LLaMA-Factory"):
        split({"stage": "pt", "resumable_stream": {"log_source_loss": True}})


def _mixture_log(directory, steps=range(2, 42, 2)) -> list[dict]:
    recs = []
    for step in steps:
        target = {"a": 0.8, "b": 0.2} if step <= 20 else {"a": 0.5, "b": 0.5}
        n_a = 13 if step <= 20 else 8
        recs.append({"step": step, "loss": 3.0, "source_interval_samples": {"a": n_a, "b": 16 - n_a},
                     "source_target_weights": target,
                     "source_realized_weights": {"a": n_a / 16, "b": (16 - n_a) / 16}})
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "train_log.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def test_report_draws_target_and_realized_weights_per_source(tmp_path, capsys):
    """A mixture's log gets a seventh panel: per source its realized share (solid) and target (dashed) at every
    logged step, one colour per source; the summary gives the realized share over all intervals' samples."""
    from PIL import Image

    from resumable_stream.app.report import MIXTURE_SIZE_PX, figure, read_log, report

    recs = _mixture_log(tmp_path / "run")
    fig = figure(read_log(str(tmp_path / "run")))
    axes = fig.axes
    assert len(axes) == 7 and axes[6].get_ylabel() == "mixture weight"
    lines = {line.get_label(): line for line in axes[6].get_lines()}
    assert set(lines) == {"a realized", "a target", "b realized", "b target"}
    for label in ("a", "b"):
        assert list(lines[f"{label} realized"].get_xdata()) == [r["step"] for r in recs]
        assert list(lines[f"{label} realized"].get_ydata()) == [r["source_realized_weights"][label] for r in recs]
        assert list(lines[f"{label} target"].get_ydata()) == [r["source_target_weights"][label] for r in recs]
        assert lines[f"{label} target"].get_linestyle() == "--"
        assert lines[f"{label} target"].get_color() == lines[f"{label} realized"].get_color()
    assert lines["a realized"].get_color() != lines["b realized"].get_color()

    summary = report(str(tmp_path / "run"))
    total_a = sum(r["source_interval_samples"]["a"] for r in recs)
    assert summary["source_realized_weights"] == pytest.approx({"a": total_a / (16 * len(recs)),
                                                                "b": 1 - total_a / (16 * len(recs))})
    assert "realized mixture:" in capsys.readouterr().out
    with Image.open(tmp_path / "run" / "report.png") as png:
        assert png.size == MIXTURE_SIZE_PX


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_logs_the_realized_mixture_and_the_loss_per_source(tmp_path):
    """examples/tiny/train_mix.yaml with packing, a DataLoader worker, a log every 2 steps and
    ``data.log_source_loss``: each line's interval samples are the differences of the cumulative
    ``source_samples``, its tokens fill exactly its 2 steps' blocks (2 x 8 x 64), the targets are the yaml's
    weights, the realized weights the interval's shares, and the per-source losses, weighted by their labelled
    tokens, give the Trainer's own logged loss."""
    from training_helpers import Procs, write_config

    procs = Procs(str(tmp_path))
    try:
        config, out = write_config(str(tmp_path), "mix", max_steps=8, save_steps=8, template="train_mix.yaml",
                                   packing=True, workers=1, logging_steps=2, data={"log_source_loss": True})
        procs.start(config, "mix").wait_ok()
    finally:
        procs.cleanup()
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        lines = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in lines] == [2, 4, 6, 8]
    previous = {"lm": 0, "notes": 0}
    for r in lines:
        samples = r["source_interval_samples"]
        assert samples == {k: r["source_samples"][k] - previous[k] for k in previous}, r
        previous = r["source_samples"]
        assert sum(r["source_interval_tokens"].values()) == 2 * 8 * 64 and min(r["source_interval_tokens"].values()) > 0
        assert r["source_target_weights"] == {"lm": 0.7, "notes": 0.3}
        assert r["source_realized_weights"] == {k: round(n / sum(samples.values()), 6) for k, n in samples.items()}
        losses, tokens = r["source_loss"], r["source_loss_tokens"]
        assert sum(tokens.values()) == 2 * 8 * 63             # every token but each row's first is predicted
        weighted = sum(losses[k] * tokens[k] for k in tokens) / sum(tokens.values())
        assert weighted == pytest.approx(r["loss"], abs=1e-3), r
