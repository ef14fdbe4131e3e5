"""A stand-in for HyperParallel's trainer: the calls its BaseTrainer / TextTrainer, HyperIter and
CheckpointerCallback make on a dataset and dataloader built from yaml ``_target_`` entries, in that order and
with those arguments, around a tiny transformers model. HyperParallel (mindspore-ai/hyper-parallel) is not on the
package index and cannot be installed here, so this harness is what the tests run instead; it is written from
its public sources, not copied from them. What each step follows (paths in that repository, the stored versions
read for this harness):

- ``hyper_parallel/trainer/config/target.py`` (0e81ad83): a ``_target_`` node is built with the yaml's keys and
  the runtime keyword arguments, the latter filtered to the target's signature unless it takes ``**kwargs``
  (``Target.build``): :class:`Target`.
- ``hyper_parallel/trainer/base.py`` (0016d837), ``BaseTrainer._build_dataset``: ``config.dataset.build(
  transform=, tokenizer=, mesh_context=, training_config=)``; ``_compute_train_iters``: ``len(train_dataloader)``
  and a ``TypeError`` meaning an unsized loader whose run is ``train_iters`` steps in one epoch;
  ``BaseTrainer.train``: ``HyperIter(train_dataloader, use_background_prefetcher=...)`` made after
  ``on_train_begin`` (the restore), ``set_epoch`` before each later epoch, ``start_step = global_step - epoch *
  train_steps``.
- ``hyper_parallel/data/batching/build_dataloader.py`` (0a491a4e), ``build_dataloader``: an iterable dataset gets
  no batch sampler; ``dataloader_target.build(dataset=, collate_fn=, batch_sampler=None,
  batch_size=<micro_batch_size>, sampler_type=, dp_world_size=, max_seq_len=, seed=)``.
- ``hyper_parallel/trainer/text_trainer.py`` (0a491a4e), ``TextTrainer.train_step``: ``num_micro_batches`` items
  of the iterator per optimizer step (one per forward-backward micro step), ``global_step += 1`` after the
  optimizer, then ``on_step_end``; ``set_epoch(epoch)`` at the start of every epoch.
- ``hyper_parallel/trainer/runtime/data_iterator.py`` (0e81ad83), ``BackgroundPrefetcher`` / ``HyperIter``: with
  prefetching, a thread takes the next item and right after it calls ``dataloader.state_dict()``, queues (item,
  state) in a queue of one; handing an item to training makes its state the current one, and ``state_dict()``
  returns that (else the dataloader's): :class:`PrefetchIter`.
- ``hyper_parallel/trainer/callbacks/checkpoint_callback.py`` (0e81ad83), ``CheckpointerCallback``: saves on
  ``global_step % save_steps == 0``; ``_collect_extra_state`` takes ``data_iterator.state_dict()`` (else the
  dataloader's) into ``extra_state["train_dataloader"]``; with ``save_extra_state_per_rank`` (default true)
  one ``torch.save`` file per rank; ``restore_from: LATEST`` finds the newest checkpoint; ``_load_checkpoint``
  builds the extra-state skeleton by calling the dataloader's ``state_dict()`` before anything was iterated,
  then ``_apply_extra_state`` restores ``global_step``, ``start_epoch`` / ``start_step`` (steps per epoch:
  ``len(dataloader)``, an unsized one's the run total) and calls ``train_dataloader.load_state_dict``, all in
  ``on_train_begin``, before the first step.

The model is replicated on every rank and its gradients are averaged with an all-reduce (HyperParallel shards
it with FSDP: the data path does not see the difference). Each rank appends ``{"step", "loss", "ids",
"state_calls"}`` to ``LOG_DIR/rank-R.jsonl`` (the row ids of the micro-batches the step trained on, and how
many times the dataloader's ``state_dict()`` was called so far); ``HP_TEST_HOLD_AFTER=N``: every rank stops
after logging step N (its checkpoint, if any, written) until SIGKILLed.

    torchrun --nproc_per_node N hp_trainer.py TRAIN.yaml LOG_DIR
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import queue
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import yaml


class Target:
    """A yaml ``_target_`` node: the callable, the yaml's keys, built later with runtime keyword arguments."""

    def __init__(self, node: dict):
        module, _, name = node["_target_"].rpartition(".")
        self.fn = getattr(importlib.import_module(module), name)
        self.kwargs = {k: v for k, v in node.items() if k != "_target_"}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["kwargs"][name]
        except KeyError:
            raise AttributeError(name) from None

    def build(self, **runtime: Any) -> Any:
        params = inspect.signature(self.fn).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            runtime = {k: v for k, v in runtime.items() if k in names}
        return self.fn(**{**self.kwargs, **runtime})


class PlaintextTransform:
    """A text row -> a sample: the tokens of ``text`` (at most ``max_seq_len``), labels = inputs; the row's id
    travels with it (for the test's record)."""

    def __init__(self, tokenizer, max_seq_len: int):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len

    def __call__(self, row: dict) -> dict:
        ids = self.tokenizer.encode(row["text"], add_special_tokens=False)[:self.max_seq_len - 1]
        ids = ids + [self.tokenizer.eos_token_id]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids), "id": int(row["id"])}


class PadCollator:
    """A micro-batch's samples -> padded input_ids / labels / attention_mask, and their row ids."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict]) -> dict:
        n = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), n), self.pad_id)
        labels = torch.full((len(samples), n), -100)
        mask = torch.zeros((len(samples), n), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, :len(s["input_ids"])] = s["input_ids"]
            labels[i, :len(s["labels"])] = s["labels"]
            mask[i, :len(s["input_ids"])] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "ids": [s["id"] for s in samples]}


class CountingLoader:
    """Counts the calls of the dataloader's ``state_dict()`` (every other attribute is the dataloader's)."""

    def __init__(self, inner):
        self.inner, self.state_calls = inner, 0

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def state_dict(self):
        self.state_calls += 1
        return self.inner.state_dict()


class PrefetchIter:
    """HyperIter's contract (see the module docstring): direct iteration, or a prefetch thread that calls
    ``state_dict()`` after taking each item and hands (item, state) over through a queue of one."""

    def __init__(self, dataloader, prefetch: bool):
        self.dataloader, self.prefetch, self.current = dataloader, prefetch, None
        self.it = iter(dataloader)
        if prefetch:
            self.queue: queue.Queue = queue.Queue(maxsize=1)
            threading.Thread(target=self._fill, daemon=True).start()

    def _fill(self):
        try:
            while True:
                item = next(self.it)
                self.queue.put((item, self.dataloader.state_dict()))
        except StopIteration:
            self.queue.put((StopIteration, None))
        except Exception as e:  # handed to the training thread
            self.queue.put((e, None))

    def __next__(self):
        if not self.prefetch:
            return next(self.it)
        item, state = self.queue.get()
        if item is StopIteration:
            raise StopIteration
        if isinstance(item, Exception):
            raise item
        self.current = state
        return item

    def state_dict(self):
        if self.prefetch and self.current is not None:
            return self.current
        return self.dataloader.state_dict()


def _latest(checkpoint_dir: str) -> str | None:
    path = os.path.join(checkpoint_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return os.path.join(checkpoint_dir, f.read().strip())


def main() -> None:
    config_path, log_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(config_path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    training = SimpleNamespace(**cfg["training"])
    ckpt = SimpleNamespace(**cfg["checkpoint"])
    dataset_target, dataloader_target = Target(cfg["dataset"]), Target(cfg["dataloader"])
    mesh = SimpleNamespace(dp_rank=rank, dp_size=world)

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["tokenizer"])
    torch.manual_seed(training.seed)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # BaseTrainer._build_dataset / TextTrainer._build_collate_fn / data.batching.build_dataloader
    transform = PlaintextTransform(tokenizer, training.max_seq_len)
    dataset = dataset_target.build(transform=transform, tokenizer=tokenizer, mesh_context=mesh,
                                   training_config=training)
    assert isinstance(dataset, torch.utils.data.IterableDataset)     # -> no batch sampler
    num_micro = training.global_batch_size // (training.micro_batch_size * world)
    loader = CountingLoader(dataloader_target.build(
        dataset=dataset, collate_fn=PadCollator(tokenizer.pad_token_id), batch_sampler=None,
        batch_size=training.micro_batch_size, sampler_type=getattr(dataloader_target, "sampler_type", "single"),
        dp_world_size=world, max_seq_len=training.max_seq_len, seed=training.seed))

    # BaseTrainer._compute_train_iters: an unsized loader -> one epoch of train_iters steps
    try:
        len(loader)
        raise AssertionError("the stream's dataloader has a length")
    except TypeError:
        train_steps = training.train_iters
    train_epochs = 1

    state = SimpleNamespace(global_step=0, epoch=0)
    start_epoch = 0
    # CheckpointerCallback.on_train_begin -> _load_checkpoint (restore_from: LATEST)
    restore = _latest(ckpt.checkpoint_dir) if ckpt.restore_from == "LATEST" else None
    if restore is not None:
        skeleton = {"train_dataloader": loader.state_dict()}      # the skeleton, before any iteration
        assert isinstance(skeleton["train_dataloader"], dict)
        saved = torch.load(os.path.join(restore, "model.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        extra = torch.load(os.path.join(restore, "extra_state", f"rank_{rank}.pt"), weights_only=True)
        state.global_step, state.epoch = extra["global_step"], extra["epoch"]
        start_epoch = state.global_step // train_steps
        if extra["train_dataloader"]:
            loader.load_state_dict(extra["train_dataloader"])
        torch.set_rng_state(extra["rng_state"])

    prefetch = bool(getattr(dataloader_target, "use_background_prefetcher", False))
    data_iterator = PrefetchIter(loader, prefetch)
    hold = int(os.environ.get("HP_TEST_HOLD_AFTER", "0"))
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rank-{rank}.jsonl")
    for epoch in range(start_epoch, train_epochs):
        loader.set_epoch(epoch)
        if epoch != start_epoch:
            data_iterator = PrefetchIter(loader, prefetch)
        start_step = state.global_step - epoch * train_steps
        for _ in range(start_step, train_steps):
            # TextTrainer.train_step: one item per micro step
            total, ids = 0.0, []
            for _micro in range(num_micro):
                batch = next(data_iterator)
                ids.append(batch.pop("ids"))
                loss = model(**batch).loss / num_micro
                loss.backward()
                total += loss.item()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            state.global_step += 1
            # CheckpointerCallback.on_step_end -> _save_checkpoint
            if ckpt.save_steps and state.global_step % ckpt.save_steps == 0:
                _save(ckpt.checkpoint_dir, state, rank, model, optimizer, data_iterator.state_dict())
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, "loss": total, "ids": ids,
                                    "state_calls": loader.state_calls}) + "\n")
            if state.global_step == hold:
                while True:
                    time.sleep(1)
    dist.barrier()
    dist.destroy_process_group()


def _save(checkpoint_dir: str, state, rank: int, model, optimizer, dataloader_state: dict) -> None:
    """The per-rank layout (save_extra_state_per_rank): each rank its extra_state file; the model once; the
    ``latest`` pointer after every rank's files are written."""
    step_dir = os.path.join(checkpoint_dir, f"global_step_{state.global_step}")
    os.makedirs(os.path.join(step_dir, "extra_state"), exist_ok=True)
    torch.save({"global_step": state.global_step, "epoch": state.epoch, "train_dataloader": dataloader_state,
                "rng_state": torch.get_rng_state()}, os.path.join(step_dir, "extra_state", f"rank_{rank}.pt"))
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(step_dir, "model.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(checkpoint_dir, "latest.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(os.path.basename(step_dir))
        os.replace(tmp, os.path.join(checkpoint_dir, "latest"))
    dist.barrier()


if __name__ == "__main__":
    main()
