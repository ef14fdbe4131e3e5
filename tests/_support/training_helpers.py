"""Real training processes for the kill-and-resume tests: yaml files, subprocesses, SIGKILL, logs.

A kill must reach every process of a run at once: the launcher, torchrun's ranks and their DataLoader
workers. Killing torchrun's process group is not enough: torch elastic starts each rank with
``start_new_session=True``, so the ranks would survive their launcher and keep training (and checkpointing).
Each run's processes therefore carry a unique ``RS_TEST_RUN`` environment tag; ``Run.kill`` freezes
(SIGSTOP) every process with the tag, then SIGKILLs them all. ``Procs`` kills whatever is still running
when a test ends. Output goes to files, never pipes, so a chatty process can never block on a full pipe.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import psutil
import yaml
from repo_paths import REPO_ROOT
from transformers import TrainerCallback

ROOT = REPO_ROOT
TINY = os.path.join(ROOT, "examples", "tiny")
TRAIN_LM = os.path.join(ROOT, "examples", "train_lm.py")
TRAIN_VL = os.path.join(ROOT, "examples", "train_vl.py")
DATA_PARALLEL_TRAIN = os.path.join(ROOT, "tests", "_support", "data_parallel_train.py")
SLOW_MANIFEST_TRAIN = os.path.join(ROOT, "tests", "_support", "slow_manifest_train.py")   # train_lm.py, manifests late
PAUSED_TRAIN = os.path.join(ROOT, "tests", "_support", "paused_train.py")                 # train_lm.py, waits at a step
MANIFEST = "manifest.json"
STATE_DIR = "stream_state"

# one thread per process: two processes share the 2 cores, and the result cannot depend on the core count
_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def write_config(directory: str, name: str, *, max_steps: int, save_steps: int, packing: bool = False,
                 workers: int = 0, save_total_limit: int | None = 2, template: str = "train_lm.yaml",
                 data: dict | None = None, **train) -> tuple[str, str]:
    """``examples/tiny/<template>`` with absolute paths, outputs in ``directory/name``; every step logged.
    ``data``: keys of the ``data:`` section to override (e.g. data_files, num_partitions, elastic).

    Returns (yaml path, output_dir). The consumed log is ``output_dir/consumed``.
    """
    with open(os.path.join(TINY, template), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc = copy.deepcopy(doc)
    out = os.path.join(directory, name)
    doc["model"]["tokenizer"] = os.path.join(TINY, "tokenizer")
    if "sources" in doc["data"]:     # a mixture (train_mix.yaml): each source's files
        for source in doc["data"]["sources"]:
            source["data_files"] = os.path.join(TINY, source["data_files"])
    else:
        doc["data"]["data_files"] = os.path.join(TINY, "data", "*.parquet")
    doc["data"].update(consumed_log=os.path.join(out, "consumed"), packing=packing, id_column="id")
    doc["data"].update(data or {})
    doc["train"].update(output_dir=out, max_steps=max_steps, save_steps=save_steps, logging_steps=1,
                        dataloader_num_workers=workers, save_total_limit=save_total_limit, disable_tqdm=True)
    doc["train"].update(train)
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path, out


def write_vl_config(directory: str, name: str, *, max_steps: int, save_steps: int, workers: int = 0,
                    save_total_limit: int | None = 2, **train) -> tuple[str, str]:
    """``examples/tiny/train_vl.yaml`` (broken rows skipped: ``bad_sample: skip``) with absolute paths,
    outputs in ``directory/name``, every step logged. Returns (yaml path, output_dir)."""
    with open(os.path.join(TINY, "train_vl.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    out = os.path.join(directory, name)
    doc["model"]["processor"] = os.path.join(TINY, "vl")
    doc["data"].update(data_files=os.path.join(TINY, "data_vl", "*.parquet"), id_column="id",
                       consumed_log=os.path.join(out, "consumed"))
    doc["train"].update(output_dir=out, max_steps=max_steps, save_steps=save_steps, logging_steps=1,
                        dataloader_num_workers=workers, save_total_limit=save_total_limit, disable_tqdm=True)
    doc["train"].update(train)
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return path, out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One training process (or one torchrun with its ranks), output in ``log_base.{out,err}``."""

    def __init__(self, config: str, log_base: str, nproc: int = 1, env: dict | None = None, script: str = TRAIN_LM,
                 command: list[str] | None = None):
        """``command``: run it as it is (e.g. ``llamafactory-cli train CONFIG``) instead of ``script``."""
        self.config, self.nproc = config, nproc
        self.stdout_path, self.stderr_path = log_base + ".out", log_base + ".err"
        if command is not None:
            cmd = list(command)
        elif nproc == 1:
            cmd = [sys.executable, script, config]
        else:   # the script runs under data_parallel_train.py, which records what assert_data_parallel checks
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), DATA_PARALLEL_TRAIN,
                   script, config]
        self.tag = uuid.uuid4().hex
        full_env = {**os.environ, **_ENV, **(env or {}), "RS_TEST_RUN": self.tag}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full_env,
                                         cwd=os.path.dirname(config), start_new_session=True)
        self.cmd = cmd
        self.started = time.monotonic()

    @property
    def stdout(self) -> str:
        with open(self.stdout_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    @property
    def stderr(self) -> str:
        with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def describe(self, tail: int = 4000) -> str:
        return (f"command: {' '.join(self.cmd)}\nexit: {self.proc.returncode}\n"
                f"--- stderr (tail) ---\n{self.stderr[-tail:]}\n--- stdout (tail) ---\n{self.stdout[-1500:]}")

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"training process still running after {timeout}s; killed\n{self.describe()}") from None

    def wait_ok(self, timeout: float = 240) -> Run:
        rc = self.wait(timeout)
        assert rc == 0, f"training process failed\n{self.describe()}"
        return self

    def members(self) -> list[psutil.Process]:
        """Live processes of this run: everything carrying its tag (leader, ranks, workers, orphaned ranks)."""
        found = {}
        for p in psutil.process_iter():
            try:
                if p.environ().get("RS_TEST_RUN") == self.tag:   # the leader has the tag too; never match by pid
                    if p.status() != psutil.STATUS_ZOMBIE:
                        found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return list(found.values())

    def kill(self) -> None:
        """SIGKILL every process of the run at once (as a node failure would) and reap the leader.

        Everything is frozen with SIGSTOP first, so no rank sees another die and reacts (writes, exits,
        tears down) before it is killed itself."""
        frozen: dict[int, psutil.Process] = {}
        for _ in range(10):                 # until no new process appears (a worker forked meanwhile)
            new = [p for p in self.members() if p.pid not in frozen]
            if not new:
                break
            for p in new:
                try:
                    p.suspend()
                except psutil.NoSuchProcess:
                    pass
                frozen[p.pid] = p
        for p in frozen.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 180, interval: float = 0.01):
        """Poll ``condition`` until true; fail if the process exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return
            if self.proc.poll() is not None:
                if condition():
                    return
                raise AssertionError(f"process exited before {what}\n{self.describe()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.describe()}")
            time.sleep(interval)


def wait_until_each(waits: dict, timeout: float = 180, interval: float = 0.01):
    """``Run.wait_until`` for several runs at once: polls every ``key -> (run, condition, what)`` and yields
    ``(key, None)`` as soon as its condition holds, or ``(key, message)`` where ``wait_until`` would fail (its run
    exited first; or time ran out, and it is killed). The caller acts on a run (kills it, starts the next) while
    the others go on."""
    pending = dict(waits)
    deadline = time.monotonic() + timeout
    while pending:
        for key, (run, condition, what) in list(pending.items()):
            if condition():
                message = None
            elif run.proc.poll() is not None:
                message = None if condition() else f"process exited before {what}\n{run.describe()}"
            elif time.monotonic() > deadline:
                run.kill()
                message = f"timed out after {timeout}s waiting for {what}\n{run.describe()}"
            else:
                continue
            del pending[key]
            yield key, message
        time.sleep(interval)


class Procs:
    """Starts runs (of ``script``) and guarantees none outlives the test (or fixture) that started it."""

    def __init__(self, directory: str, script: str = TRAIN_LM):
        self.directory, self.script = directory, script
        self.runs: list[Run] = []

    def start(self, config: str, label: str, nproc: int = 1, env: dict | None = None,
              script: str | None = None, command: list[str] | None = None) -> Run:
        """``script``: another training script than this Procs' own (for this run only); ``command``: a whole
        command line instead."""
        run = Run(config, os.path.join(self.directory, label), nproc=nproc, env=env, script=script or self.script,
                  command=command)
        self.runs.append(run)
        return run

    def cleanup(self) -> None:
        for run in self.runs:
            try:
                run.kill()
            except Exception:   # noqa: BLE001 - best effort; never mask the test's own failure
                pass


# ---------------------------------------------------------------------------------------------- reading outputs
def count_lines(path: str) -> int:
    """Complete lines of a file that may be appended to right now (0 if it does not exist)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_log_records(out: str) -> list[dict]:
    """The lines of ``out/train_log.jsonl``."""
    return _jsonl(os.path.join(out, "train_log.jsonl"))


def train_losses(out: str) -> dict[int, float]:
    """step -> loss from ``train_log.jsonl``; a step logged twice is an error (the restart must truncate)."""
    losses: dict[int, float] = {}
    for rec in _jsonl(os.path.join(out, "train_log.jsonl")):
        if "loss" not in rec:   # an evaluation's line (eval_loss)
            continue
        assert rec["step"] not in losses, f"step {rec['step']} logged twice in {out}/train_log.jsonl"
        losses[rec["step"]] = rec["loss"]
    return losses


def train_epochs(out: str) -> dict[int, float]:
    """step -> the Trainer's epoch from ``train_log.jsonl`` (training lines)."""
    return {rec["step"]: rec["epoch"] for rec in _jsonl(os.path.join(out, "train_log.jsonl")) if "loss" in rec}


RUN_RESULTS = ("trainer_state.json", "train_results.json", "all_results.json")   # what a run ends with, as HF's


def run_results(out: str) -> dict[str, dict]:
    """The end-of-run files of ``out`` (``save_state``, ``save_metrics("train", ...)``), parsed; an absent one
    is an AssertionError naming it."""
    found = {}
    for name in RUN_RESULTS:
        path = os.path.join(out, name)
        assert os.path.isfile(path), f"{path}: missing; a run ends with {', '.join(RUN_RESULTS)} in output_dir"
        with open(path, encoding="utf-8") as f:
            found[name] = json.load(f)
    return found


def consumed(out: str, rank: int = 0) -> dict[int, list[str]]:
    """step -> sample keys from ``consumed/rank-NNNNN.jsonl``; a step logged twice is an error."""
    steps: dict[int, list[str]] = {}
    path = os.path.join(out, "consumed", f"rank-{rank:05d}.jsonl")
    for rec in _jsonl(path):
        assert rec["step"] not in steps, f"step {rec['step']} logged twice in {path}"
        steps[rec["step"]] = rec["samples"]
    return steps


def checkpoint_path(out: str, step: int) -> str:
    return os.path.join(out, f"checkpoint-{step}")


def checkpoint_steps(out: str) -> list[int]:
    if not os.path.isdir(out):
        return []
    return sorted(int(n.split("-", 1)[1]) for n in os.listdir(out)
                  if n.startswith("checkpoint-") and n.split("-", 1)[1].isdigit())


def is_complete(out: str, step: int) -> bool:
    ckpt = checkpoint_path(out, step)
    return (os.path.isfile(os.path.join(ckpt, "trainer_state.json"))
            and os.path.isfile(os.path.join(ckpt, STATE_DIR, MANIFEST)))


def complete_checkpoints(out: str) -> list[int]:
    return [s for s in checkpoint_steps(out) if is_complete(out, s)]


def printed_steps(run: Run) -> int:
    """How many optimizer steps a run logged on stdout (``{'loss': ...}`` lines, logging_steps 1, main rank)."""
    return sum(1 for line in run.stdout.splitlines() if line.startswith("{'loss'") or line.startswith('{"loss"'))


def assert_data_parallel(out: str, world_size: int, note: str = "") -> None:
    """The multi-rank runs writing ``out`` trained one model (DistributedDataParallel): at the end of the
    last run all ranks hold identical parameters, and every logged loss is the mean of the losses of
    the ranks' ``training_step`` (what the Trainer all-gathers and logs), not one rank's own loss."""
    with open(os.path.join(out, "data_parallel.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    losses = [r for r in records if "logged_loss" in r]
    assert any(len(r["rank_losses"]) == world_size for r in losses), \
        f"no loss was logged by {world_size} ranks in {out} {note}"
    for r in losses:   # also those of earlier runs into out (an elastic resume may change the world size)
        ranks = r["rank_losses"]
        mean = sum(ranks) / len(ranks)
        assert abs(r["logged_loss"] - mean) <= 1e-6 * max(1.0, abs(mean)), \
            f"step {r['step']}: logged loss {r['logged_loss']} is not the mean {mean} of the ranks' losses " \
            f"{ranks} {note}"
    sums = records[-1].get("parameter_sums")
    assert sums is not None, f"the last run writing {out} did not finish training {note}"
    assert len(sums) == world_size and max(sums) - min(sums) == 0, \
        f"the ranks ended with different parameters (sums {sums}): each trained its own copy {note}"


class StopAt(TrainerCallback):
    """Ends training after ``step`` (its checkpoint written): the run a kill would interrupt."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
