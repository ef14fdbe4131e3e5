"""Resuming a full fine-tune whose checkpoint holds weights under their saved (legacy) names: transformers 5's
Trainer loads them as they are, matches nothing and only warns (transformers 5.6), so such a checkpoint is
loaded here under the model's names; any other is left to the Trainer."""

from __future__ import annotations

import functools
import json
import os

SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"


def saved_names(model) -> dict[str, list[str]]:
    """name in a saved checkpoint -> the model's names of that weight (``save_pretrained``'s renaming)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    ours: dict[int, list[str]] = {}
    for name, tensor in state.items():
        ours.setdefault(id(tensor), []).append(name)
    return {saved: ours[id(tensor)] for saved, tensor in revert_weight_conversion(model, dict(state)).items()
            if id(tensor) in ours}


def _weight_files(checkpoint: str) -> list[str]:
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        return [os.path.join(checkpoint, os.path.basename(s)) for s in shards]
    single = os.path.join(checkpoint, SAFE_WEIGHTS)
    return [single] if os.path.isfile(single) else []


def load_renamed_checkpoint(model, checkpoint: str) -> bool:
    """Load ``checkpoint``'s weights into ``model`` when they are stored under names ``save_pretrained`` reverted;
    False (nothing loaded) when the names already match or are not those, or there are no safetensors weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    files = _weight_files(checkpoint)
    if not files:
        return False
    keys: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys.update(f.keys())
    state = model.state_dict()
    names = saved_names(model)
    if keys <= set(state) or not keys <= set(names):
        return False
    loaded = {}
    for path in files:
        loaded.update({ours: tensor for saved, tensor in load_file(path).items() for ours in names[saved]})
    result = model.load_state_dict(loaded, strict=False)
    kept = {state[k].data_ptr() for k in loaded}       # a tied weight (lm_head) is not saved: it shares one
    missing = [k for k in result.missing_keys if state[k].data_ptr() not in kept]
    if result.unexpected_keys or missing:
        raise ValueError(f"checkpoint {checkpoint!r}: weights that do not fit the model (missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    return True


_LOADERS: dict = {}     # the _load_from_checkpoint wrappers made here -> the loader each tries first


def patch_checkpoint_loader(trainer_cls, load) -> None:
    """``trainer_cls._load_from_checkpoint`` trying ``load(model, checkpoint)`` first (True: it loaded the
    checkpoint), the class's own loader otherwise; a class patched twice with one loader tries it once."""
    original = trainer_cls._load_from_checkpoint
    wrapper = original
    while wrapper in _LOADERS:
        if _LOADERS[wrapper] is load:
            return
        wrapper = wrapper.__wrapped__

    @functools.wraps(original)
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if not load(target, resume_from_checkpoint):
            original(self, resume_from_checkpoint, model)

    _LOADERS[_load_from_checkpoint] = load
    trainer_cls._load_from_checkpoint = _load_from_checkpoint
