"""One rank of a many-rank reading job (tests/io/test_rate_limited_jobs.py), started by torchrun.

    python -m torch.distributed.run --nproc-per-node 8 rate_limited_job.py SPEC.json

``SPEC.json``: ``{"data": {StreamConfig keys}, "workers": 2, "batch": 32, "out": DIR}``. The rank opens the stream
(rank 0 resolves and indexes, the others get the index over gloo), reads one epoch (``set_epoch(0)``) through a
``StreamLoader`` with ``workers`` DataLoader workers (every rank waits for the others after its first batch, as a
training step would), and writes ``DIR/rank-R.json``: every batch it was handed
(its partition, sample keys and ids, when it came), the data-path figures of the rank (its workers' requests,
budget waits, rate-limit answers and waits included) and when reading began and ended. Any error fails the
rank, and torchrun the job: a "failed step".
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from resumable_stream import ResumableStream, StreamConfig
from resumable_stream.loader import StreamLoader


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    started = time.monotonic()          # the machine's monotonic clock: the loopback servers' too
    cfg = StreamConfig(**spec["data"])
    stream = ResumableStream(cfg, rank=rank, world_size=world, num_workers=spec["workers"])
    stream.set_epoch(0)
    loader = StreamLoader(stream, spec["batch"], num_workers=spec["workers"], keep_keys=True)
    opened = time.monotonic()
    batches = []
    for i, item in enumerate(loader.items()):
        loader.hand_out(item)
        batches.append({"partition": item["partition"], "keys": item["keys"],
                        "ids": [sample["id"] for sample in item["batch"]], "at": time.monotonic()})
        if i == 0:
            # as a training job's first step does: no rank goes on before every rank has its first batch (on 2
            # busy cores the last rank's workers may start seconds after the first's; the test measures the rate
            # from the last rank's first batch on)
            dist.barrier()
    ended = time.monotonic()
    figures = loader.data_metrics()
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "started": started, "opened": opened, "ended": ended, "batches": batches,
                   "figures": figures}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
