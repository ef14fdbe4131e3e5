"""Resuming LLaMA-Factory's LoRA reward model (``stage: rm``): a checkpoint holds the adapter and the value head
(``value_head.safetensors``), which the Trainer's own loading cannot find ("Can't find a checkpoint index"),
so this loads both in place. LLaMA-Factory does not resume a full / freeze reward model at all."""

from __future__ import annotations

import os

ADAPTER = "adapter_model.safetensors"
VALUE_HEAD = "value_head.safetensors"


def load_value_head_checkpoint(model, checkpoint: str) -> bool:
    """Load the adapter and value head of ``checkpoint`` into ``model`` (copied into its parameters: their
    dtype and device stay); False when ``model`` is not a LoRA value-head model or the files are missing."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    pretrained, head = getattr(model, "pretrained_model", None), getattr(model, "v_head", None)
    files = [os.path.join(checkpoint, name) for name in (ADAPTER, VALUE_HEAD)]
    if not isinstance(pretrained, PeftModel) or head is None or not all(map(os.path.isfile, files)):
        return False
    result = set_peft_model_state_dict(pretrained, load_file(files[0]))
    if result.unexpected_keys:
        raise ValueError(f"{files[0]}: weights of another adapter ({result.unexpected_keys[:3]} ...)")
    head.load_state_dict({k.removeprefix("v_head."): v for k, v in load_file(files[1]).items()})
    return True
