"""Scripts and worker functions for tests/observe/test_shared_counters.py.

As a script (``python counter_probe.py DATA_GLOB WORKERS``): reads a few batches of a StreamLoader with
WORKERS forked DataLoader workers (they record into the rank's shared counters), prints ``ready`` and waits
to be killed."""

import itertools
import sys
import time


def add_many(counters, times: int) -> None:
    """A worker process's additions (module level: a spawned process imports it)."""
    for _ in range(times):
        counters.add(requests=1, bytes_read=2)


def main(data: str, workers: int) -> None:
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.loader import StreamLoader
    from resumable_stream.observe import metrics

    stream = ResumableStream(StreamConfig(dataset_name_or_path="parquet", data_files=data), num_workers=workers)
    loader = StreamLoader(stream, batch_size=4, num_workers=workers)
    for _ in itertools.islice(loader, 3):
        pass
    metrics.source_counters().add(requests=1)
    print("ready", metrics.source_counters().snapshot()["row_groups"], flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
