"""The batches of our LLaMA-Factory stream against those of LLaMA-Factory's own ``get_dataset`` (its streaming
``IterableDataset``, one epoch per ``set_epoch``, batched as the Trainer's DataLoader batches it), in process:
across the end of the data (a processing chunk and a batch never span it), several datasets concatenated (in
the order llamafactory-cli reads them), and a resume from the state after every batch, also between the
batches of an epoch's end. No training: the examples themselves are compared, so this runs in seconds."""

from __future__ import annotations

import copy
import os

import pytest
from lf_helpers import BASE

LF_STREAMING = {"streaming": True, "buffer_size": 1, "dataloader_num_workers": 1, "report_to": "none"}


def _args(assets, tmp_path, **keys):
    from llamafactory.hparams import get_train_args

    model, data = assets
    args = {**BASE, **LF_STREAMING, "model_name_or_path": model, "dataset_dir": data,
            "output_dir": str(tmp_path / "out"), **keys}
    model_args, data_args, training_args, _, _ = get_train_args(args)
    return model_args, data_args, training_args


def _template(model_args, data_args):
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.model import load_tokenizer

    tokenizer = load_tokenizer(model_args)["tokenizer"]
    return get_template_and_fix_tokenizer(tokenizer, data_args), tokenizer


def _llamafactory_batches(assets, tmp_path, batches: int, **keys) -> tuple[list[list[dict]], list[int]]:
    """(the examples of each batch, the examples of each epoch they reach into) of llamafactory-cli's training
    data: its get_dataset, epoch after epoch (set_epoch, as the Trainer's DataLoader calls it), each batched by
    per_device_train_batch_size."""
    from llamafactory.data import get_dataset

    model_args, data_args, training_args = _args(assets, tmp_path, **keys)
    template, tokenizer = _template(model_args, data_args)
    dataset = get_dataset(template, model_args, data_args, training_args, stage=keys.get("stage", "sft"),
                          tokenizer=tokenizer)["train_dataset"]
    size, out, sizes = training_args.per_device_train_batch_size, [], []
    while len(out) < batches:
        dataset.set_epoch(len(sizes))
        ids = [_fields(ex) for ex in dataset]
        out += [ids[i:i + size] for i in range(0, len(ids), size)]
        sizes.append(len(ids))
    return out[:batches], sizes


def _our_loaders(assets, tmp_path, **keys):
    """A function making fresh loaders of our stream (LLaMA-Factory's arguments and template made once)."""
    from resumable_stream.integrations.llamafactory.data import train_stream
    from resumable_stream.loader import StreamLoader

    model_args, data_args, training_args = _args(assets, tmp_path, **keys)
    template, tokenizer = _template(model_args, data_args)

    def loader():
        train = train_stream(template, data_args, training_args, tokenizer, keys.get("stage", "sft"), {})
        return StreamLoader(train.stream, batch_size=training_args.per_device_train_batch_size, collate_fn=list,
                            processor_factory=train.processor_factory)
    return loader


def _fields(example: dict) -> dict[str, list[int]]:
    """What the collator makes a batch of: input_ids, labels, attention_mask (neat packing: sequence ids)."""
    return {k: list(example[k]) for k in ("input_ids", "labels", "attention_mask") if k in example}


def _ids(batch) -> list[dict[str, list[int]]]:
    return [_fields(ex) for ex in batch]


CASES = {   # each runs past the end of its data at least twice within 40 batches (other.jsonl: 80 rows)
    "pt": {"stage": "pt", "dataset": "other", "cutoff_len": 32, "per_device_train_batch_size": 3},
    "neat_packing-chunks-of-1000": {"dataset": "other", "per_device_train_batch_size": 3, "packing": True, "neat_packing": True, "cutoff_len": 128,
                                    "preprocessing_batch_size": 1000},
    "concat-packing-chunks-of-33": {"dataset": "alpaca,other", "packing": True, "cutoff_len": 64,
                                    "preprocessing_batch_size": 33},
}
FIRST_EPOCH_ONLY = ("concat",)     # llamafactory-cli permutes the datasets again every epoch; ours keep the first order
# interleaved (datasets.interleave_datasets' draws and epochs): few.jsonl 14 rows, fewer.jsonl 9. Each mixture
# epoch ends right after the last row of the first dataset to run out (under) or of the last one (over), and the
# next restarts both from their first rows with new draws; at least 3 epochs within the batches compared
UNDER_PROBS = {"dataset": "few,fewer", "mix_strategy": "interleave_under", "interleave_probs": "0.5,0.5"}
OVER = {"dataset": "few,fewer", "mix_strategy": "interleave_over"}
OVER_PROBS = {**OVER, "interleave_probs": "0.6,0.4"}
PACKED = {"packing": True, "cutoff_len": 128, "preprocessing_batch_size": 10, "per_device_train_batch_size": 2}
CASES.update({
    "interleave_under-probs": {**UNDER_PROBS, "per_device_train_batch_size": 4},
    "interleave_under-probs-packing": {**UNDER_PROBS, **PACKED},
    "interleave_over-in-turn": {**OVER, "per_device_train_batch_size": 4},
    "interleave_over-in-turn-packing": {**OVER, **PACKED},
    "interleave_over-probs": {**OVER_PROBS, "per_device_train_batch_size": 4},
    "interleave_over-probs-packing": {**OVER_PROBS, **PACKED},
})


@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_equal_llamafactorys_across_epochs_and_resume_after_every_batch(assets, tmp_path, case):
    keys = CASES[case]
    first_epoch = case.startswith(FIRST_EPOCH_ONLY)
    n = 24 if first_epoch else 30 if case.startswith("interleave") else 40
    reference, sizes = _llamafactory_batches(assets, tmp_path, n, **keys)
    examples = sum(map(len, reference))
    full_epochs = sum(1 for k in range(len(sizes)) if sum(sizes[:k + 1]) <= examples)
    wanted = 0 if first_epoch else 3 if case.startswith("interleave") else 2
    assert full_epochs >= wanted and (not first_epoch or sizes[0] > examples), (sizes, examples)
    make_loader = _our_loaders(assets, tmp_path, **keys)
    loader = make_loader()
    items = loader.items()
    got, states = [], []
    for _ in range(n):
        item = next(items)
        loader.hand_out(item)
        got.append(_ids(item["batch"]))
        states.append(copy.deepcopy(loader.state_dict()))
    assert got == reference
    for k in range(n - 1):           # resumed from the state after batch k: batches k+1.. as before
        resumed = make_loader()
        resumed.load_state_dict(copy.deepcopy(states[k]))
        it = resumed.items()
        assert [_ids(next(it)["batch"]) for _ in range(min(4, n - 1 - k))] == got[k + 1:k + 5], f"resumed at {k}"


def test_concatenated_datasets_are_read_in_llamafactorys_order(assets, tmp_path):
    """llamafactory-cli shuffles the concatenation even with buffer_size 1: its datasets come in the order
    numpy.random.default_rng(seed) permutes them (seed 42: other, then alpaca)."""
    from resumable_stream.integrations.llamafactory.data import stream_section

    _, data_args, training_args = _args(assets, tmp_path, dataset="alpaca,other")
    section, _ = stream_section(data_args, training_args, {})
    assert [os.path.basename(f) for f in section["data_files"]] == ["other.jsonl", "alpaca.jsonl"]
    _, data_args, training_args = _args(assets, tmp_path, dataset="alpaca,other", seed=0)
    section, _ = stream_section(data_args, training_args, {})
    assert [os.path.basename(f) for f in section["data_files"]] == ["alpaca.jsonl", "other.jsonl"]


def test_our_llamafactory_processor_satisfies_the_processor_protocol(assets, tmp_path):
    """LlamaFactoryProcessor is a resumable_stream.transforms.Processor with the hooks the loader drives it by
    (takes_source, epoch_bound); its flush processes the unfinished chunk; with val_size's cut the stream's
    fingerprint names it while the carry's own fingerprint stays that of the processor without it."""
    import functools

    from resumable_stream.integrations.llamafactory.data import train_stream
    from resumable_stream.integrations.llamafactory.processor import LlamaFactoryProcessor
    from resumable_stream.transforms import Processor
    from resumable_stream.transforms.protocol import as_processor

    model_args, data_args, training_args = _args(assets, tmp_path, dataset="other", packing=True, cutoff_len=128,
                                                  preprocessing_batch_size=5)
    template, tokenizer = _template(model_args, data_args)
    factory = train_stream(template, data_args, training_args, tokenizer, "sft", {}).processor_factory
    proc = factory()
    assert isinstance(proc, LlamaFactoryProcessor) and isinstance(proc, Processor) and as_processor(proc) is proc
    for name in ("feed", "ready", "take", "state", "load_state", "fingerprint", "stats", "flush", "end_epoch",
                 "epoch_tail"):
        assert getattr(LlamaFactoryProcessor, name) is not getattr(Processor, name), name
    assert (proc.takes_source, proc.counts_key_tokens, proc.epoch_bound) == (True, False, True)
    row = {"instruction": "say hi", "input": "", "output": "hi there"}
    for i in range(3):                       # under a chunk of 5: nothing processed yet
        proc.feed(row, f"0:{i}")
    assert proc.ready() == 0 and proc.stats()["examples"] == 0
    proc.flush()                             # the chunk's blocks; the first carries its rows' keys
    assert proc.ready() >= 1 and [k for _ in range(proc.ready()) for k in proc.take()["keys"]] == ["0:0", "0:1", "0:2"]

    held = functools.partial(factory, held_out=(2, (0, 2)))()
    assert held.fingerprint() == {**proc.fingerprint(), "held_out": {"val_size": 2, "cut": [0, 2]}}
    assert held.state()["meta"]["fingerprint"] == proc.fingerprint()
    for i in range(4):                       # rows 0:0 and 0:1 are held out: never fed
        held.feed(row, f"0:{i}")
    held.flush()
    assert held.stats()["rows"] == 2 and [k for _ in range(held.ready()) for k in held.take()["keys"]] == ["0:2", "0:3"]
