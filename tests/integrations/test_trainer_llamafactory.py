"""The LLaMA-Factory recipe (README "With LLaMA-Factory"): a Trainer subclass with the overrides of
LLaMA-Factory's ``CustomSeq2SeqTrainer`` (src/llamafactory/train/sft/trainer.py; LLaMA-Factory itself is
not installed here), patched with ``patch_trainer``, its collator (``DataCollatorForSeq2Seq`` padding
labels with -100 to a multiple of 8), SFT data from a ResumableStream. A restart with
``resume_from_checkpoint=True`` after a kill skips and removes the checkpoints the kill cut short, exactly
as ``resumable-stream train`` does, and continues with the same losses as an uninterrupted run."""

import functools
import os
import types

import pytest
import torch
from lock_probe import REFUSED, try_lock
from repo_paths import REPO_ROOT
from training_helpers import StopAt
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
)

from resumable_stream import StreamConfig, open_stream
from resumable_stream.config.transforms import TransformConfig
from resumable_stream.integrations.transformers import TrainingStream, patch_trainer
from resumable_stream.transforms.text import TextProcessor

pytestmark = pytest.mark.slow

TINY = os.path.join(REPO_ROOT, "examples", "tiny")
SFT_YAML = os.path.join(TINY, "train_sft.yaml")


class LlamaFactoryLikeTrainer(Seq2SeqTrainer):
    """The overrides of LLaMA-Factory's CustomSeq2SeqTrainer that touch training (optimizer / scheduler
    creation, sampler, loss, the tokenizer -> processing_class renaming)."""

    def __init__(self, finetuning_args, processor, gen_kwargs=None, **kwargs):
        kwargs["processing_class"] = kwargs.pop("tokenizer")
        super().__init__(**kwargs)
        if processor is not None:
            self.model_accepts_loss_kwargs = False
        self.finetuning_args = finetuning_args
        if gen_kwargs is not None:
            self._gen_kwargs = gen_kwargs

    def create_optimizer(self):
        return super().create_optimizer()

    def create_scheduler(self, num_training_steps, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer)

    def _get_train_sampler(self, *args, **kwargs):
        if self.finetuning_args.disable_shuffling:
            return torch.utils.data.SequentialSampler(self.train_dataset)
        return super()._get_train_sampler(*args, **kwargs)

    def compute_loss(self, model, inputs, *args, **kwargs):
        return super().compute_loss(model, inputs, *args, **kwargs)




def make_trainer(output_dir, callbacks=()):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    data = StreamConfig.from_yaml(SFT_YAML)
    transform = TransformConfig.from_dict({**data.__dict__, "format": "messages", "max_seq_len": 128})
    args = Seq2SeqTrainingArguments(output_dir=str(output_dir), max_steps=6, save_steps=2, logging_steps=1,
                                    per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
                                    remove_unused_columns=False, use_cpu=True, disable_tqdm=True, seed=42)
    stream = open_stream(data, rank=args.process_index, world_size=args.world_size, num_workers=0)
    collator = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, label_pad_token_id=-100)
    patch_trainer(LlamaFactoryLikeTrainer)
    trainer = LlamaFactoryLikeTrainer(
        finetuning_args=types.SimpleNamespace(disable_shuffling=False), processor=None, model=model, args=args,
        tokenizer=tokenizer, data_collator=collator,
        train_dataset=TrainingStream(stream, collator, functools.partial(TextProcessor, tokenizer, transform)))
    for cb in callbacks:
        trainer.add_callback(cb)
    return trainer


def losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_llamafactory_trainer_restart_skips_and_removes_checkpoints_cut_short(tmp_path):
    reference = make_trainer(tmp_path / "ref")
    reference.train()
    expected = losses(reference)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    out = tmp_path / "run"
    make_trainer(out, [StopAt(4)]).train()
    # the kill: checkpoint-4 lost its stream manifest (killed between the sidecars and the manifest),
    # checkpoint-6 was cut short while the model was being written (no trainer_state.json)
    os.unlink(out / "checkpoint-4" / "stream_state" / "manifest.json")
    (out / "checkpoint-4" / "cut-short.bin").write_bytes(b"\0" * 10)
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6" / "cut-short.bin").write_bytes(b"\0" * 10)

    restarted = make_trainer(out)
    restarted.train(resume_from_checkpoint=True)
    got = losses(restarted)
    assert restarted.state.global_step == 6
    assert sorted(got) == [1, 2, 3, 4, 5, 6]   # 1, 2 from checkpoint-2's trainer state
    assert all(abs(got[s] - expected[s]) <= 1e-6 for s in got), (got, expected)
    for step in (4, 6):
        assert not (out / f"checkpoint-{step}" / "cut-short.bin").exists(), f"checkpoint-{step} was not removed"
    assert (out / "checkpoint-4" / "stream_state" / "manifest.json").is_file()
    assert (out / "checkpoint-6" / "stream_state" / "manifest.json").is_file()


def test_llamafactory_trainer_holds_its_output_dir_while_it_trains(tmp_path):
    """The patched train() of a user's own Trainer subclass takes the output_dir lock: another job trying it
    meanwhile is refused naming this process; once train() returns it is free again."""
    out = str(tmp_path / "run")
    tries = []

    class TryLock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            tries.append(try_lock(out))

    make_trainer(out, [TryLock(), StopAt(2)]).train()
    assert [t.returncode for t in tries] == [REFUSED, REFUSED], [t.stderr for t in tries]
    assert f"output_dir {out!r} is in use by another training job: pid {os.getpid()} on host" in tries[0].stderr
    assert try_lock(out).returncode == 0, "still held after train() returned"
