"""VeOmni's text training (``veomni.trainer.text_trainer.TextTrainer``, as VeOmni's ``tasks/train_text.py`` runs
it) on CPU, with our dataset registered: ``torchrun --nproc_per_node N veomni_launch.py VEOMNI.yaml LOG_DIR``.

VeOmni 0.1.12 is written for accelerators; the stand-ins below let its own trainer, FSDP2 wrapping, DCP
checkpointer and CheckpointerCallback run unchanged on a CPU machine. Each one is named and says why. None of
them touches the data path, the checkpoint's contents or the resume: the dataset, dataloader, transform,
collators, callbacks and checkpoint files are VeOmni's and ours as a GPU run has them. No veomni file is
changed; everything below patches the running process only.

After every step each rank appends ``{"step", "loss", "keys"}`` to ``LOG_DIR/rank-R.jsonl``: the sample keys
of that step's rows (our loader's ``pop_consumed_keys``) and VeOmni's loss, which the tests compare between a
killed-and-resumed run and an uninterrupted one. With ``VEOMNI_TEST_HOLD_AFTER=N`` every rank stops after
logging step N (after VeOmni's own callbacks, its checkpoint of that step included) and waits there to be
SIGKILLed: a kill point the test does not have to race for. Both are the test's, not part of the integration.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

# --- stand-in 1: a gloo process group made before the trainer. VeOmni's BaseTrainer._setup calls
# dist.init_process_group(backend=get_dist_comm_backend()) unless one exists, and get_dist_comm_backend()
# raises on a machine without CUDA / NPU / MLU ("No available distributed communication backend").
dist.init_process_group(backend="gloo")

# --- stand-in 2: torch.cpu's device figures. VeOmni's EnvironMeter.step and print_device_mem_info read
# get_torch_device().max_memory_allocated() / max_memory_reserved() / memory_stats() / mem_get_info() and, for
# the MFU, get_device_name(), which torch.cpu does not have: zeros (what an idle accelerator reports) and the
# name "cpu" (an unknown device: VeOmni's FLOPS table gives it inf, so an MFU of 0) are logged instead.
for _name, _value in (("max_memory_allocated", 0), ("max_memory_reserved", 0), ("memory_allocated", 0),
                      ("memory_reserved", 0), ("reset_peak_memory_stats", None)):
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda *a, _v=_value, **k: _v)
if not hasattr(torch.cpu, "memory_stats"):
    torch.cpu.memory_stats = lambda *a, **k: {"num_alloc_retries": 0}
if not hasattr(torch.cpu, "mem_get_info"):
    torch.cpu.mem_get_info = lambda *a, **k: (0, 0)
if not hasattr(torch.cpu, "get_device_name"):
    torch.cpu.get_device_name = lambda *a, **k: "cpu"
if not hasattr(torch.cpu, "empty_cache"):
    torch.cpu.empty_cache = lambda: None

from veomni.arguments import VeOmniArguments, parse_args  # noqa: E402
from veomni.distributed.parallel_state import ParallelState  # noqa: E402
from veomni.trainer.text_trainer import TextTrainer  # noqa: E402

import resumable_stream.integrations.veomni  # noqa: E402,F401  (the integration: registers resumable_stream)

# --- stand-in 3 (one process only): VeOmni's FSDP2 path. The only model build VeOmni allows without an
# accelerator is FSDP2 over a meta-device model (its arguments refuse init_device: cpu for fsdp2 and for DDP);
# ParallelState.fsdp_enabled is `fsdp_size > 1`, so with one process build_parallelize_model takes the
# non-FSDP branch, which demands init_device cuda / npu / mlu. Here one process takes the FSDP2 path over a
# mesh of one, as two processes do over a mesh of two.
if int(os.environ.get("WORLD_SIZE", "1")) == 1:
    ParallelState.fsdp_enabled = property(lambda self: self.fsdp_size >= 1)


class _StepLog:
    """A callback appended to VeOmni's own list: after each step, this rank's consumed keys and the loss."""

    def __init__(self, trainer, path: str):
        self.trainer, self.path = trainer, path
        self.hold_after = int(os.environ.get("VEOMNI_TEST_HOLD_AFTER", "0"))
        trainer.base.train_dataloader.loader.keep_keys = True

    def on_step_end(self, state, loss=None, **kwargs):
        keys = self.trainer.base.train_dataloader.pop_consumed_keys()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, "loss": loss, "keys": keys}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if state.global_step == self.hold_after:
            while True:           # the test SIGKILLs this process here
                time.sleep(1)

    def __getattr__(self, name):      # the other hooks: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def main() -> None:
    config, log_dir = sys.argv[1], sys.argv[2]
    sys.argv = [sys.argv[0], config]          # VeOmni's parse_args reads the yaml from argv
    args = parse_args(VeOmniArguments)
    trainer = TextTrainer(args)
    os.makedirs(log_dir, exist_ok=True)
    trainer.base._callbacks.append(_StepLog(trainer, os.path.join(log_dir, f"rank-{dist.get_rank()}.jsonl")))
    trainer.train()


if __name__ == "__main__":
    main()
