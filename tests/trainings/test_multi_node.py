"""Two nodes on loopback: two torchrun launchers (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
127.0.0.1), 4 gloo ranks training one model with ``examples/train_lm.py`` (the yaml training app), each node
with its own ``data.cache_dir`` and ``data.metrics_port``, one shared ``output_dir``.

- kill and restart: the launcher holding ranks 2 and 3 is SIGKILLed (every process of it) after a checkpoint,
  the other node is left to fail on its own (it is killed too if it has not exited within a minute), both
  restart, and every step's loss and every rank's consumed samples equal an uninterrupted 2 x 2 run's;
- per job: the dataset is resolved once per launch of the job, by global rank 0 (the restart: not at all,
  the index comes from the checkpoint);
- per node: ``resumable-stream warmup --world-size 4 --ranks 2,3`` fills node 1's cache with what ranks 2 and 3
  read and nothing else (they miss no block; node 0's ranks, cold, fill their own cache with other blocks);
  each rank's Prometheus endpoint is on its node's ``metrics_port`` + its LOCAL rank, labelled with its global
  rank (two nodes on one machine are given ports 10 apart);
- elastic: a 2 x 2 checkpoint resumed by one node of 3 ranks (``data.elastic``) reads every row of the epoch
  exactly once across the change.

c10d ignores ``--node-rank`` (it is for the static rendezvous): it numbers the launchers by their
(host, pid), so on one machine the launcher started first gets ranks 0 and 1. The launchers record which
ranks they got (``RS_TEST_RECORD``, tests/_support/data_parallel_train.py) and the test checks it.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections import Counter

import pytest
import yaml
from kill_resume_harness import first_difference
from training_helpers import (
    DATA_PARALLEL_TRAIN,
    TRAIN_LM,
    Procs,
    assert_data_parallel,
    complete_checkpoints,
    consumed,
    count_lines,
    free_port,
    train_log_records,
    train_losses,
    write_config,
)

from resumable_stream.app.cli import main as cli_main
from resumable_stream.testing import write_parquet_dataset

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hub_offline")]

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
MAX_STEPS, SAVE_STEPS, KILL_AFTER = 24, 8, 11
BATCH = 8                                   # per_device_train_batch_size of the tiny yaml
LOSS_TOL = 1e-6


def _port_pair() -> int:
    """A port P with P + 1 free too (a node's two metrics endpoints)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free consecutive loopback ports")


def _node_configs(base: str, tmp_path, name: str, node_data: list[dict]) -> list[str]:
    """One yaml per node: ``base`` with the node's own ``data`` keys (its cache_dir, metrics_port)."""
    with open(base, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    paths = []
    for node, data in enumerate(node_data):
        node_doc = {**doc, "data": {**doc["data"], **data}}
        path = tmp_path / f"{name}-node{node}.yaml"
        path.write_text(yaml.safe_dump(node_doc))
        paths.append(str(path))
    return paths


class Job:
    """The launchers of one multi-node job (one ``torchrun`` per node, one rendezvous), started in node order."""

    def __init__(self, procs: Procs, configs: list[str], label: str, record: str, nproc: int = PER_NODE):
        self.record = record
        endpoint, rdzv_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:12]
        self.nodes = []
        for node, config in enumerate(configs):
            # Node 0's launcher hosts the rendezvous store, named (on one machine each launcher would guess it is the
            # host, and the one that binds first wins); a store call waits up to 300 s on 2 busy cores, not 60 (a CI
            # run lost a job to torch's launcher failing a store call in its monitoring loop).
            conf = f"is_host={int(node == 0)},read_timeout=300"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(configs)), "--node-rank",
                   str(node), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", rdzv_id, "--rdzv-conf", conf, DATA_PARALLEL_TRAIN, TRAIN_LM, config]
            self.nodes.append(procs.start(config, f"{label}-node{node}", command=cmd, env={"RS_TEST_RECORD": record}))

    def describe(self) -> str:
        return "\n".join(f"=== node {n} ===\n{run.describe(6000)}" for n, run in enumerate(self.nodes))

    def wait_ok(self, timeout: float = 300) -> Job:
        for run in self.nodes:
            assert run.wait(timeout) == 0, f"a launcher failed\n{self.describe()}"
        return self

    def events(self, event: str) -> list[dict]:
        tags = {run.tag: n for n, run in enumerate(self.nodes)}
        with open(self.record, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        return [{**e, "node": tags[e["run"]]} for e in lines if e["event"] == event and e["run"] in tags]

    def ranks_of_nodes(self) -> list[dict[int, int]]:
        """Per launcher: local rank -> global rank, as the processes it started saw them."""
        out: list[dict[int, int]] = [{} for _ in self.nodes]
        for e in self.events("start"):
            out[e["node"]][e["local_rank"]] = e["rank"]
        return out


def _scrape_rank(port: int) -> str | None:
    """The ``rank`` label of the data-path metrics served on ``port`` (None: nothing serves it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except urllib.error.URLError:
        return None
    for line in text.splitlines():
        if line.startswith("resumable_stream_batches_total{"):
            return line.split('rank="', 1)[1].split('"', 1)[0]
    raise AssertionError(f"port {port}: no resumable_stream_batches_total in\n{text[:500]}")


def _cache_blocks(cache_dir: str) -> set[str]:
    """The block keys (namespace/shard/block) a node's block cache holds."""
    with sqlite3.connect(f"file:{cache_dir}/cache.db?mode=ro", uri=True) as con:
        return {k for (k,) in con.execute("SELECT key FROM Cache")}


def _misses_by_rank(out: str) -> dict[int, int]:
    """Block cache misses of every rank over a run (summed over its logged intervals)."""
    misses: Counter = Counter()
    for line in train_log_records(out):
        for r in line.get("data_ranks", []):
            misses[r["rank"]] += r["cache_misses"]
    return dict(misses)


@pytest.mark.timeout(900)
def test_two_nodes_killed_on_one_node_resume_like_an_uninterrupted_run(procs, tmp_path):
    ports = [_port_pair(), _port_pair()]
    caches = [str(tmp_path / f"cache-node{n}") for n in range(NODES)]
    node_data = [{"cache_dir": caches[n], "metrics_port": ports[n], "metrics_addr": "127.0.0.1"}
                 for n in range(NODES)]
    _, ref_out = write_config(str(tmp_path), "ref", max_steps=MAX_STEPS, save_steps=SAVE_STEPS, packing=False)
    ref = _node_configs(str(tmp_path / "ref.yaml"), tmp_path, "ref", node_data)

    # node 1 warms its cache for its own ranks (2, 3) of the 4 (all its ranks read in the run, plus a window)
    assert cli_main(["warmup", ref[1], "--samples", str(MAX_STEPS * BATCH), "--world-size", str(WORLD),
                     "--ranks", "2,3", "--no-progress"]) == 0
    warmed = _cache_blocks(caches[1])
    assert warmed

    record = str(tmp_path / "record.jsonl")
    reference = Job(procs, ref, "ref", record).wait_ok()
    assert reference.ranks_of_nodes() == [{0: 0, 1: 1}, {0: 2, 1: 3}], \
        f"c10d should number the launchers in start order on one host\n{reference.describe()}"
    assert [(e["rank"], e["node"]) for e in reference.events("resolve")] == [(0, 0)], \
        "the dataset is resolved once per job, by global rank 0"
    assert_data_parallel(ref_out, WORLD, "[reference]")
    misses = _misses_by_rank(ref_out)
    assert misses[2] == misses[3] == 0, f"node 1's warmed ranks missed blocks: {misses}"
    assert misses[0] > 0 and misses[1] > 0, f"node 0's cache was cold: {misses}"
    assert _cache_blocks(caches[1]) == warmed, "node 1's ranks read a block its warmup did not fetch"
    assert not warmed & _cache_blocks(caches[0]), "node 1's warmup fetched blocks node 0's ranks read"

    _, out = write_config(str(tmp_path), "run", max_steps=MAX_STEPS, save_steps=SAVE_STEPS, packing=False)
    run = _node_configs(str(tmp_path / "run.yaml"), tmp_path, "run", node_data)
    killed = Job(procs, run, "killed", record)
    log = os.path.join(out, "train_log.jsonl")
    node1 = killed.nodes[1]
    node1.wait_until(lambda: count_lines(log) >= 2, "the first steps")
    # each node's endpoints: its metrics_port + local rank, labelled with the global rank
    served = {port + local: _scrape_rank(port + local) for port in ports for local in range(PER_NODE)}
    ranks = killed.ranks_of_nodes()
    expected = {ports[n] + local: str(ranks[n][local]) for n in range(NODES) for local in range(PER_NODE)}
    assert served == expected, f"port -> rank served (None: nothing) {served}, expected {expected}"

    node1.wait_until(lambda: count_lines(log) >= KILL_AFTER and complete_checkpoints(out), "a checkpoint")
    node1.kill()                                        # a lost node: its launcher, ranks and workers at once
    logged = count_lines(log)
    assert logged < MAX_STEPS, "the run ended before the kill"
    node0 = killed.nodes[0]
    try:
        node0.proc.wait(timeout=60)                     # its peers are gone: it fails on its own ...
    except subprocess.TimeoutExpired:
        pass
    node0.kill()                                        # ... or is stopped, as a scheduler stops a job that lost a node
    assert node0.proc.returncode != 0, "node 0 finished training without its peers"
    resume_step = complete_checkpoints(out)[-1]

    restarted = Job(procs, run, "restarted", record).wait_ok()
    assert restarted.events("resolve") == [], "the restart takes the dataset index from the checkpoint"
    assert any(f"resuming from {out}/checkpoint-{resume_step}" in r.stderr for r in restarted.nodes), \
        restarted.describe()
    note = f"[killed after step {logged}, resumed from checkpoint-{resume_step}]"
    ref_losses, losses = train_losses(ref_out), train_losses(out)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, MAX_STEPS + 1)), note
    bad = [(s, ref_losses[s], losses[s]) for s in ref_losses if abs(ref_losses[s] - losses[s]) > LOSS_TOL]
    assert not bad, f"step losses differ (step, reference, resumed): {bad[:5]} {note}"
    for rank in range(WORLD):
        ref_keys, keys = consumed(ref_out, rank), consumed(out, rank)
        assert sorted(ref_keys) == list(range(1, MAX_STEPS + 1)) and all(ref_keys.values()), note
        assert keys == ref_keys, f"rank {rank}: {first_difference(ref_keys, keys)} {note}"
    assert_data_parallel(out, WORLD, note)


# -------------------------------------------------------------------------------------- elastic 2 x 2 -> 1 x 3
FILES, ROWS_PER_FILE, PARTITIONS = 12, 48, 12      # a shard per partition; 6 batches of 8 per partition
# a step takes one micro-batch of every partition (data.elastic_determinism): gradient accumulation 3 on 2 x 2
# ranks (3 partitions each), 4 on 1 x 3
CKPT = 2                                           # 2 x 2: 2 batches of each partition consumed
AFTER = ROWS_PER_FILE // BATCH - CKPT              # 1 x 3: the rest of the epoch, a batch of each partition a step


@pytest.mark.timeout(600)
def test_two_nodes_resumed_on_one_node_of_three_ranks_read_every_row_once(procs, tmp_path):
    data_dir = tmp_path / "data"
    write_parquet_dataset(str(data_dir), rows=FILES * ROWS_PER_FILE, files=FILES, row_group_size=ROWS_PER_FILE)
    data = {"data_files": str(data_dir / "*.parquet"), "num_partitions": PARTITIONS, "elastic": True,
            "buffer_size": 256}
    first, out = write_config(str(tmp_path), "run", max_steps=CKPT, save_steps=CKPT, data=data,
                              gradient_accumulation_steps=PARTITIONS // WORLD)
    nodes = _node_configs(first, tmp_path, "first", [{"cache_dir": str(tmp_path / f"cache-node{n}")}
                                                     for n in range(NODES)])
    record = str(tmp_path / "record.jsonl")
    Job(procs, nodes, "first", record).wait_ok()
    assert complete_checkpoints(out) == [CKPT]

    second, _ = write_config(str(tmp_path), "run", max_steps=CKPT + AFTER, save_steps=CKPT, data=data,
                             gradient_accumulation_steps=PARTITIONS // 3)
    one = _node_configs(second, tmp_path, "second", [{"cache_dir": str(tmp_path / "cache-node0")}])
    resumed = Job(procs, one, "second", record, nproc=3).wait_ok()
    assert f"resuming from {out}/checkpoint-{CKPT}" in resumed.nodes[0].stderr, resumed.describe()
    assert resumed.events("resolve") == []

    keys = []
    for rank in range(WORLD):
        steps = consumed(out, rank)
        expected = list(range(1, CKPT + 1)) + (list(range(CKPT + 1, CKPT + AFTER + 1)) if rank < 3 else [])
        assert sorted(steps) == expected, f"rank {rank} logged steps {sorted(steps)}"
        keys += [k for v in steps.values() for k in v]
    counts = Counter(int(k) for k in keys)
    twice = sorted(k for k, c in counts.items() if c > 1)
    missing = sorted(set(range(FILES * ROWS_PER_FILE)) - set(counts))
    assert not twice and not missing, f"read twice {twice[:10]}, never read {missing[:10]}"


# ------------------------------------------------------------------------------- the ranks agree on the order
_RANK_SCRIPT = """
import sys
import torch.distributed as dist
from resumable_stream import ConfigError, ResumableStream, StreamConfig
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
seed = 7 if rank == 1 else 42            # node 1's yaml says another shuffle_seed
cfg = StreamConfig(dataset_name_or_path="parquet", data_files=sys.argv[1], shuffle=True, shuffle_seed=seed)
try:
    ResumableStream(cfg, rank=rank, world_size=world)
except ConfigError as e:
    print(f"rank {rank}: ConfigError: {e}", flush=True)
    sys.exit(3)
print(f"rank {rank}: opened", flush=True)
"""


@pytest.mark.timeout(300)
def test_ranks_with_other_order_settings_are_refused_on_every_rank(tmp_path):
    """One yaml per node makes it easy for nodes to disagree; a rank reading another shuffle order would
    read rows twice and skip others, silently. Every rank raises instead, the differing one naming the key."""
    write_parquet_dataset(str(tmp_path / "d"), rows=200, files=4, row_group_size=50)
    (tmp_path / "rank.py").write_text(_RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(tmp_path / "rank.py"),
                           str(tmp_path / "d" / "*.parquet")], env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "opened" not in proc.stdout, out[-3000:]
    assert "rank 1: ConfigError: the ranks of this job read the data with different settings: " \
           "data.shuffle_seed: rank 0 42, rank 1 7;" in proc.stdout, out[-3000:]
    assert "rank 0: ConfigError: the ranks of this job read the data with different settings" in proc.stdout, \
        out[-3000:]
