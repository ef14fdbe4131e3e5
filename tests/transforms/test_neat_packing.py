"""Neat packing (``data.packing_mode: neat``): blocks whose documents do not see each other.

Config validation, the blocks and their position ids / labels, exact resume of the processor state and of
a loader through its sidecar, collate, and the point of it all: with a tiny random-init Llama and Qwen2
(eager and sdpa), a packed block's logits equal those of each document run alone and the loss of a packed
batch equals the token-weighted loss of its documents, which concat packing does not give."""

from __future__ import annotations

import copy
import functools
import glob
import itertools
import json
import os

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from resumable_stream.errors import ConfigError, SidecarError, StreamMismatchError
from resumable_stream.transforms import IGNORE_INDEX, TextProcessor, TransformConfig, collate

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
NEAT = dict(packing=True, packing_mode="neat")
# the state layout of concat packing, as sidecars written before packing_mode existed hold it
CONCAT_TENSORS = {"carry_input_ids", "carry_labels", "carry_key_tokens", "pending_input_ids", "pending_labels",
                  "pending_lengths", "pending_key_counts"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


@pytest.fixture(scope="module")
def texts():
    rows = []
    for f in sorted(glob.glob(os.path.join(TINY, "data", "*.parquet"))):
        rows += pq.read_table(f, columns=["text"]).column("text").to_pylist()
    # documents of 1..9 rows: several per block, and some longer than a block
    return [" ".join(rows[i * 5:i * 5 + 1 + (i * 5) % 9]) for i in range(80)]


@pytest.fixture(scope="module")
def convs():
    rows = []
    for f in sorted(glob.glob(os.path.join(TINY, "data_sft", "*.parquet"))):
        rows += pq.read_table(f).to_pylist()
    return rows[:60]


def _drain(proc):
    out = []
    while proc.ready():
        out.append(proc.take())
    return out


def _run(tok, cfg, samples, flush=False):
    p = TextProcessor(tok, cfg)
    for key, s in samples:
        p.feed(s, key)
    if flush:
        p.flush()
    return p, _drain(p)


def _segments(position_ids):
    """(start, end) of each run of positions 0, 1, 2, ..."""
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return list(zip(starts, starts[1:]))


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("value", ["Neat", "flat", None, True, 1])
def test_bad_packing_mode_names_key_value_and_allowed(value):
    with pytest.raises(ConfigError) as ei:
        TransformConfig.from_dict({"packing": True, "packing_mode": value})
    assert "data.packing_mode" in str(ei.value) and repr(value) in str(ei.value)
    assert "one of concat, neat" in str(ei.value)


def test_packing_mode_neat_needs_packing():
    with pytest.raises(ConfigError, match=r"data.packing_mode: got 'neat' with data.packing false"):
        TransformConfig.from_dict({"packing_mode": "neat"})
    assert TransformConfig.from_dict({"packing_mode": "concat"}).packing_mode == "concat"   # the default: harmless
    assert TransformConfig().packing_mode == "concat"
    with pytest.raises(ConfigError, match="data.packing_mode"):
        TransformConfig.from_dict({"format": "vl", "packing_mode": "neat"})


def test_trainer_yaml_accepts_packing_mode(tmp_path):
    from resumable_stream.config.trainer import TrainerConfig

    doc = {"model": {"tokenizer": "t", "config": {"model_type": "qwen3"}},
           "data": {"dataset_name_or_path": "parquet", "data_files": "x/*.parquet", "packing": True,
                    "packing_mode": "neat"},
           "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1}}
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(doc))
    assert TrainerConfig.from_yaml(str(path)).transform.packing_mode == "neat"


# ---------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("max_seq_len", [8, 13, 64])
def test_neat_blocks_restart_positions_and_mask_labels_at_every_document(tok, texts, max_seq_len):
    samples = [(f"k{i}", {"text": t}) for i, t in enumerate(texts)]
    _, concat = _run(tok, TransformConfig(packing=True, max_seq_len=max_seq_len), samples, flush=True)
    p, neat = _run(tok, TransformConfig(max_seq_len=max_seq_len, **NEAT), samples, flush=True)
    # the same cut as concat packing: the same tokens and sample keys per block
    assert [e["input_ids"] for e in neat] == [e["input_ids"] for e in concat]
    assert [e["keys"] for e in neat] == [e["keys"] for e in concat]
    assert "position_ids" not in concat[0]
    # owner of every token of the stream, by sample index (documents get EOS appended)
    owner = [i for i, t in enumerate(texts) for _ in range(len(tok(t, add_special_tokens=False)["input_ids"]) + 1)]
    pos = 0
    for e in neat:
        n = len(e["input_ids"])
        mine = owner[pos:pos + n]
        # a document's part in this block counts 0, 1, 2, ... from where it starts in the block
        want = [0 if j == 0 or mine[j] != mine[j - 1] else None for j in range(n)]
        for j in range(1, n):
            if want[j] is None:
                want[j] = want[j - 1] + 1
        assert e["position_ids"] == want
        starts = {j for j in range(n) if want[j] == 0}
        assert e["labels"] == [IGNORE_INDEX if j in starts else t for j, t in enumerate(e["input_ids"])]
        pos += n
    assert pos == len(owner)
    assert p.stats()["examples"] == len(neat)


def test_a_document_longer_than_a_block_restarts_in_each_block(tok, texts):
    doc = " ".join(texts[:20])
    _, out = _run(tok, TransformConfig(max_seq_len=16, **NEAT), [("big", {"text": doc})])
    assert len(out) >= 3
    assert all(e["position_ids"] == list(range(16)) and e["keys"] == ["big"] for e in out)


# ---------------------------------------------------------------------------------------------- resume
def _roundtrip(state):
    """Through the sidecar formats: safetensors for tensors, JSON for meta."""
    b = st_save(state["tensors"], metadata={"meta": json.dumps(state["meta"])})
    return {"tensors": st_load(b), "meta": json.loads(json.dumps(state["meta"]))}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(0, 60), max_seq_len=st.sampled_from([8, 9, 31, 200]), take_frac=st.floats(0, 1),
       fmt=st.sampled_from(["text", "messages"]))
def test_neat_resume_is_exact(tok, texts, convs, k, max_seq_len, take_frac, fmt):
    if fmt == "text":
        samples = [(f"t{i}", {"text": t}) for i, t in enumerate(texts[:60])]
    else:
        samples = [(f"c{r['id']}", r) for r in convs]
    cfg = TransformConfig(format=fmt, max_seq_len=max_seq_len, **NEAT)
    ref, ref_out = _run(tok, cfg, samples, flush=True)

    a = TextProcessor(tok, cfg)
    for key, s in samples[:k]:
        a.feed(s, key)
    taken = [a.take() for _ in range(int(a.ready() * take_frac))]
    state = _roundtrip(a.state())
    b = TextProcessor(tok, cfg)
    b.load_state(state)
    for key, s in samples[k:]:
        b.feed(s, key)
    b.flush()
    assert taken + _drain(b) == ref_out      # position_ids and labels included
    assert b.stats() == ref.stats()


def _neat_state(tok, texts, max_seq_len=47):
    p = TextProcessor(tok, TransformConfig(max_seq_len=max_seq_len, **NEAT))
    for i, t in enumerate(texts[:12]):
        p.feed({"text": t}, f"k{i}")
    s = p.state()
    assert s["tensors"]["carry_input_ids"].size > 0 and s["tensors"]["pending_lengths"].size > 1
    return s


def test_neat_state_holds_the_boundaries_and_is_checked(tok, texts):
    cfg = TransformConfig(max_seq_len=47, **NEAT)
    s = _neat_state(tok, texts)
    assert set(s["tensors"]) == CONCAT_TENSORS | {"pending_segment_lengths", "pending_segment_counts"}
    assert s["meta"]["fingerprint"]["packing_mode"] == "neat"
    TextProcessor(tok, cfg).load_state(copy.deepcopy(s))
    for name in ("pending_segment_lengths", "pending_segment_counts"):
        bad = copy.deepcopy(s)
        bad["tensors"][name] = bad["tensors"][name][:-1]
        with pytest.raises(SidecarError, match="inconsistent segment lengths"):
            TextProcessor(tok, cfg).load_state(bad)
    bad = copy.deepcopy(s)   # same total, other boundaries: one segment made 0 long, the next 1 longer
    bad["tensors"]["pending_segment_lengths"][0] -= bad["tensors"]["pending_segment_lengths"][0]
    bad["tensors"]["pending_segment_lengths"][1] += s["tensors"]["pending_segment_lengths"][0]
    with pytest.raises(SidecarError, match="inconsistent segment lengths"):
        TextProcessor(tok, cfg).load_state(bad)
    bad = copy.deepcopy(s)
    del bad["tensors"]["pending_segment_counts"]
    with pytest.raises(SidecarError, match="missing or malformed"):
        TextProcessor(tok, cfg).load_state(bad)


def test_concat_and_neat_states_do_not_mix_and_concat_keeps_its_layout(tok, texts):
    neat = _neat_state(tok, texts)
    concat_cfg = TransformConfig(packing=True, max_seq_len=47)
    concat = TextProcessor(tok, concat_cfg)
    for i, t in enumerate(texts[:12]):
        concat.feed({"text": t}, f"k{i}")
    cs = concat.state()
    # concat packing writes (and so reads) exactly what it wrote before packing_mode existed
    assert set(cs["tensors"]) == CONCAT_TENSORS and "packing_mode" not in cs["meta"]["fingerprint"]
    with pytest.raises(StreamMismatchError) as ei:
        TextProcessor(tok, TransformConfig(max_seq_len=47, **NEAT)).load_state(cs)
    assert ("transform.packing_mode", None, "neat") in ei.value.differences
    with pytest.raises(StreamMismatchError) as ei:
        TextProcessor(tok, concat_cfg).load_state(neat)
    assert ("transform.packing_mode", "neat", None) in ei.value.differences


# ---------------------------------------------------------------------------------------------- collate
def test_collate_neat_pads_positions_as_a_segment_of_their_own():
    exs = [{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "position_ids": [0, 1, 0, 1], "keys": ["a"]},
           {"input_ids": [9, 4], "labels": [-100, 4], "position_ids": [0, 1], "keys": ["b"]}]
    b = collate(exs, pad_token_id=0)
    assert set(b) == {"input_ids", "labels", "position_ids", "use_cache"}   # no attention_mask: see collate
    assert b["use_cache"] is False
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 4, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, -100, 8], [-100, 4, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    f = collate(exs, pad_token_id=0, flash_attn_kwargs=True)
    assert f["cu_seq_lens_q"].tolist() == f["cu_seq_lens_k"].tolist() == [0, 2, 4, 6, 8]
    assert f["cu_seq_lens_q"].dtype == torch.int32 and f["max_length_q"] == f["max_length_k"] == 2
    with pytest.raises(ValueError, match="mixed packing modes"):
        collate([exs[0], {"input_ids": [1], "labels": [1], "keys": ["c"]}], 0)
    with pytest.raises(ValueError, match="position_ids"):
        collate([{**exs[0], "position_ids": [0, 1]}], 0)


# ---------------------------------------------------------------------------------------------- the model
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
MODELS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def _model(tok, family, attn):
    torch.manual_seed(0)
    cfg = MODELS[family](vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         **TINY_MODEL)
    assert cfg.use_cache   # the model's default: collate must turn the cache off for the masks to apply
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _solo(model, ids, labels):
    """Logits of one document run alone, and its summed loss and number of predicted tokens."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
    n = sum(x != IGNORE_INDEX for x in labels[1:])
    return out.logits[0], (out.loss * n if n else torch.tensor(0.0)), n


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_block_equals_its_documents_run_alone(tok, texts, family, attn):
    model = _model(tok, family, attn)
    samples = [(f"k{i}", {"text": t}) for i, t in enumerate(texts[:12])]
    _, neat = _run(tok, TransformConfig(max_seq_len=64, **NEAT), samples, flush=True)
    _, concat = _run(tok, TransformConfig(max_seq_len=64, packing=True), samples, flush=True)
    # a full block and the shorter last one: a padded batch of 2 rows
    picked = [1, len(neat) - 1]
    assert len(neat[picked[1]]["input_ids"]) < 64 and len(_segments(neat[picked[0]]["position_ids"])) >= 3
    batch = collate([neat[i] for i in picked], tok.pad_token_id)
    with torch.no_grad():
        packed = model(**batch)
    total, count = 0.0, 0
    for row, i in enumerate(picked):
        ex = neat[i]
        for s, e in _segments(ex["position_ids"]):
            logits, loss_sum, n = _solo(model, ex["input_ids"][s:e], ex["labels"][s:e])
            torch.testing.assert_close(packed.logits[row, s:e], logits, rtol=1e-4, atol=1e-5)
            total, count = total + loss_sum, count + n
    torch.testing.assert_close(packed.loss, total / count, rtol=1e-5, atol=1e-6)

    # concat packing, same tokens: the later documents see the earlier ones, and are predicted from them
    cbatch = collate([concat[i] for i in picked], tok.pad_token_id)
    assert torch.equal(cbatch["input_ids"], batch["input_ids"])
    with torch.no_grad():
        cpacked = model(**cbatch)
    s, e = _segments(neat[picked[0]]["position_ids"])[1]
    assert not torch.allclose(cpacked.logits[0, s:e], packed.logits[0, s:e], rtol=1e-4, atol=1e-3)
    assert abs(cpacked.loss.item() - packed.loss.item()) > 1e-4


def test_sft_conversations_packed_neat_equal_alone(tok, convs):
    model = _model(tok, "qwen2", "sdpa")
    samples = [(f"c{r['id']}", r) for r in convs[:10]]
    _, neat = _run(tok, TransformConfig(format="messages", max_seq_len=200, **NEAT), samples)
    ex = neat[0]
    assert len(_segments(ex["position_ids"])) >= 2
    with torch.no_grad():
        packed = model(**collate([ex], tok.pad_token_id))
    total, count = 0.0, 0
    for s, e in _segments(ex["position_ids"]):
        logits, loss_sum, n = _solo(model, ex["input_ids"][s:e], ex["labels"][s:e])
        torch.testing.assert_close(packed.logits[0, s:e], logits, rtol=1e-4, atol=1e-5)
        total, count = total + loss_sum, count + n
    torch.testing.assert_close(packed.loss, total / count, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- loader resume
def _keep_examples(examples, pad_token_id):
    return examples, collate(examples, pad_token_id)


def _loader(directory, tok, workers):
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.loader import StreamLoader

    cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(directory, "*.parquet"),
                       shuffle=True, buffer_size=16, num_partitions=2)
    return StreamLoader(ResumableStream(cfg, 0, 1, workers), batch_size=2, num_workers=workers,
                        collate_fn=functools.partial(_keep_examples, pad_token_id=tok.pad_token_id),
                        processor_factory=functools.partial(TextProcessor, tok,
                                                            TransformConfig(max_seq_len=24, **NEAT)))


@pytest.fixture(scope="module")
def dataset_600(tmp_path_factory):
    from resumable_stream.testing import write_parquet_dataset

    d = tmp_path_factory.mktemp("d600")
    write_parquet_dataset(str(d), rows=600, files=12, row_group_size=25)
    return str(d)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_neat_blocks_exactly_through_its_sidecar(tok, dataset_600, tmp_path, workers):
    """Blocks, position ids and labels after the resume equal the uninterrupted run's, including the
    blocks that span the save point: they start with the documents carried in the sidecar."""
    ref = [examples for examples, _ in itertools.islice(iter(_loader(dataset_600, tok, workers)), 16)]
    first = _loader(dataset_600, tok, workers)
    it = iter(first)
    head = [examples for examples, _ in itertools.islice(it, 7)]
    path = first.save_sidecar(str(tmp_path / "stream_state"))
    carries = [carry["tensors"] for carry in first.rank_state()["transform"].values()]
    del it
    resumed = _loader(dataset_600, tok, workers)
    resumed.load_sidecar(path)
    tail = list(itertools.islice(iter(resumed), 9))
    assert head + [examples for examples, _ in tail] == ref
    assert all("position_ids" in batch and "attention_mask" not in batch for _, batch in tail)
    # a partition carried documents over the save point; its next block starts with them, each a segment of
    # its own with positions from 0, and goes on with the documents read after the resume
    carries = [c for c in carries if c["carry_key_tokens"].size]
    assert carries
    for carry in carries:
        ids, sizes = carry["carry_input_ids"].tolist(), carry["carry_key_tokens"].tolist()
        spanning = [ex for examples, _ in tail for ex in examples if ex["input_ids"][:len(ids)] == ids]
        assert len(spanning) == 1 and len(spanning[0]["input_ids"]) > len(ids)
        assert spanning[0]["position_ids"][:len(ids) + 1] == [p for n in sizes for p in range(n)] + [0]


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.slow
@pytest.mark.parametrize("template", ["train_lm.yaml", "train_sft.yaml"])
def test_cli_train_with_neat_packing_learns_from_each_document_alone(tmp_path, template):
    """``resumable-stream train`` with neat packing: the loss it logs for step 1 is the token-weighted loss
    of the documents of the first batch, each run alone through the initial model (concat packing gives
    another one, see test_packed_block_equals_its_documents_run_alone)."""
    import subprocess
    import sys

    from training_helpers import train_losses, write_config

    from resumable_stream.app.train import build_trainer
    from resumable_stream.config.trainer import TrainerConfig

    data = {"packing_mode": "neat", "max_seq_len": 64}
    if template == "train_sft.yaml":
        data.update(data_files=os.path.join(TINY, "data_sft", "*.parquet"), max_seq_len=128)
    runs = {name: write_config(str(tmp_path), name, max_steps=2, save_steps=2, packing=True, data=data,
                               template=template, per_device_train_batch_size=4) for name in ("cli", "in-process")}
    config, out = runs["cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "resumable_stream", "train", config], capture_output=True,
                       text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    logged = train_losses(out)[1]

    trainer = build_trainer(TrainerConfig.from_yaml(runs["in-process"][0]))   # the same model and data
    batch = next(iter(trainer.get_train_dataloader()))
    assert "position_ids" in batch and "attention_mask" not in batch
    model = trainer.model.eval()
    total, count = 0.0, 0
    for row in range(batch["input_ids"].shape[0]):
        positions = batch["position_ids"][row].tolist()
        real = int((batch["labels"][row] != IGNORE_INDEX).nonzero().max()) + 1   # past it: padding
        for s, e in _segments(positions):
            if s >= real:
                break
            _, loss_sum, n = _solo(model, batch["input_ids"][row, s:e].tolist(), batch["labels"][row, s:e].tolist())
            total, count = total + loss_sum, count + n
    assert len(_segments(batch["position_ids"][0].tolist())) >= 2, "a block of several documents"
    assert logged == pytest.approx(float(total / count), rel=1e-5)



def test_a_sample_without_tokens_is_no_segment(tok, texts, monkeypatch):
    """A sample that tokenizes to nothing (possible with add_eos false and a normalizer that drops its
    characters) adds no empty segment, and the state with it still loads."""
    cfg = TransformConfig(max_seq_len=16, add_eos=False, **NEAT)
    p = TextProcessor(tok, cfg)
    encode = p._encode_text
    monkeypatch.setattr(p, "_encode_text", lambda sample, key, *rest: ([], []) if key == "nothing" else encode(sample, key, *rest))
    for key in ("a", "nothing", "b"):
        p.feed({"text": texts[0] + " " + texts[1]}, key)
    TextProcessor(tok, cfg).load_state(_roundtrip(p.state()))
    p.flush()
    out = _drain(p)
    with_nothing = [ex for ex in out if "nothing" in ex["keys"]]
    assert with_nothing and all(len(_segments(ex["position_ids"])) == len(ex["keys"]) - 1 for ex in with_nothing)
