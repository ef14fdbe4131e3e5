#!/usr/bin/env python
"""Requests per epoch against row groups and files: ours (with and without the request budget, whose paced
fetches coalesce adjacent row groups) and HF streaming on the same loopback Hub, and the Hub tier each makes the
limit at corpus scale.

A loopback Hub (``tests/_support/hub_server.HubServer``) serves ``--files`` parquet files of ``--groups`` row
groups of ``--rows`` rows. Each line reads one whole epoch and counts the resolver requests (``/resolve/`` URLs:
what the Hub's rate limit counts) the server saw:

* ``ours``: a job of ``--consumers`` processes (ranks x DataLoader workers, one partition each) or fewer processes
  holding several partitions (an elastic run on fewer ranks): rank 0 opens the dataset (datasets' resolution,
  one footer read per file), every process reads its partitions' row groups from that index and footers (as the
  index broadcast gives them), each with its own prefetcher. Simulated in this process, one process after
  another (the counts do not depend on the timing; the rates are the tests' business:
  tests/io/test_rate_limited_jobs.py);
* ``HF``: ``load_dataset(repo, streaming=True)`` + ``split_dataset_by_node`` per consumer, one epoch each;
* the format's own bound: one request per row group, plus one footer per file.

Then the formula (docs/scale.md) at the size of a corpus (``--corpus-files``, ``--corpus-groups``,
``--tokens-per-group``): requests per epoch, and the tokens per second at which each Hub tier becomes the limit.

    .venv/bin/python benchmarks/requests_per_epoch.py [--files 16] [--groups 32] [--rows 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for extra in (REPO_ROOT, os.path.join(REPO_ROOT, "tests", "_support")):
    if extra not in sys.path:
        sys.path.insert(0, extra)

REPO = "bench/epoch"


def resolver_requests(hub) -> int:
    return sum(1 for r in list(hub.requests) if "/resolve/" in r.path)


def cdn_requests(hub) -> int:
    return len(hub.cdn_requests())


def ours(hub, processes: int, partitions: int, shuffle: bool, budget: float | str) -> dict:
    """One epoch of a job of ``processes`` processes holding ``partitions`` partitions in all."""
    from resumable_stream import ResumableStream, StreamConfig
    from resumable_stream.io import budget as request_budget
    from resumable_stream.io import hub as hub_io
    from resumable_stream.sources import open_source

    cfg = StreamConfig(dataset_name_or_path=REPO, data_files="data/*.parquet", shuffle=shuffle, shuffle_seed=5,
                       buffer_size=160, num_partitions=partitions, max_requests_per_s=budget)
    request_budget._state = request_budget._Process()          # each job starts afresh
    hub_io._cdn = hub_io._SignedUrls()
    hub.reset_stats()
    opened = open_source(cfg.source_spec)                      # rank 0: resolution, identities, footers
    rows = coalesced = 0
    t0 = time.perf_counter()
    for rank in range(processes):
        request_budget._state = request_budget._Process()      # another process: its own buckets, its own
        if rank:                                               # signed URLs (rank 0 keeps those of its index)
            hub_io._cdn = hub_io._SignedUrls()
        source = open_source(cfg.source_spec, index=opened.index, footers=opened.footers)   # as broadcast
        stream = ResumableStream(cfg, rank=rank, world_size=processes, source=source)
        stream.set_epoch(0)
        rows += sum(1 for _ in stream)
        coalesced += source.prefetch_stats().get("coalesced", 0)
        source.close()
    opened.close()
    return {"requests": resolver_requests(hub), "cdn": cdn_requests(hub), "rows": rows, "coalesced": coalesced,
            "wall_s": round(time.perf_counter() - t0, 2)}


def hf(hub, consumers: int) -> dict:
    import datasets
    from datasets.distributed import split_dataset_by_node

    hub.reset_stats()
    rows = 0
    t0 = time.perf_counter()
    for rank in range(consumers):
        ds = datasets.load_dataset(REPO, data_files="data/*.parquet", split="train", streaming=True)
        rows += sum(1 for _ in split_dataset_by_node(ds, rank=rank, world_size=consumers))
    return {"requests": resolver_requests(hub), "cdn": cdn_requests(hub), "rows": rows, "coalesced": 0,
            "wall_s": round(time.perf_counter() - t0, 2)}


def corpus_lines(files: int, groups: int, tokens_per_group: float, per_group: float) -> list[str]:
    """The formula at corpus scale: ``per_group`` requests per row group (measured), one footer per file."""
    from resumable_stream.io.budget import HUB_TIERS, hub_tier_rate

    requests = groups * per_group + files
    out = [f"corpus: {files:,} files, {groups:,} row groups of ~{tokens_per_group:,.0f} tokens: "
           f"~{requests:,.0f} resolver requests per epoch ({per_group:.2f} per row group + one footer per file, "
           "the footers once per job)"]
    for tier in HUB_TIERS:
        rate = hub_tier_rate(tier)
        out.append(f"  {tier:20s} {rate:8.1f} requests/s for the job: the limit at "
                   f"{rate * tokens_per_group / per_group / 1e6:8.1f} M tokens/s; an epoch's requests take "
                   f"{requests / rate / 86400:6.1f} days at that rate")
    return out


def main() -> None:
    import _common  # noqa: F401  (a private HF cache for this run)

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--groups", type=int, default=32, help="row groups per file")
    ap.add_argument("--rows", type=int, default=40, help="rows per row group")
    ap.add_argument("--consumers", type=int, default=16, help="ranks x DataLoader workers of the job")
    ap.add_argument("--corpus-files", type=int, default=25_000)
    ap.add_argument("--corpus-groups", type=int, default=21_000_000)
    ap.add_argument("--tokens-per-group", type=float, default=700_000)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from hub_server import HubServer, use_hub

    from resumable_stream.testing import write_parquet_dataset

    work = tempfile.mkdtemp(prefix="rs-bench-epoch-")
    write_parquet_dataset(os.path.join(work, "repo", "data"), rows=args.files * args.groups * args.rows,
                          files=args.files, row_group_size=args.rows)
    groups = args.files * args.groups
    n = args.consumers
    results = []
    with HubServer(os.path.join(work, "store")) as hub, use_hub(hub, os.path.join(work, "home")):
        hub.commit(REPO, directory=os.path.join(work, "repo"))
        print(f"{args.files} files x {args.groups} row groups of {args.rows} rows ({groups} row groups) on a loopback "
              f"Hub; resolver requests for one epoch (the format's bound: {groups} row groups + {args.files} "
              "footers)")
        print(f"{'reader':<58} {'resolve':>7} {'per row group':>13} {'CDN':>5} {'coalesced':>9} {'rows':>7}")
        lines = [
            (f"ours, {n} processes x 1 partition, shuffled, no budget", ours, (n, n, True, "unlimited")),
            (f"ours, {n} x 1, shuffled, budget (paced: coalesced)", ours, (n, n, True, 1000.0)),
            (f"ours, {n} x 1, in order, budget", ours, (n, n, False, 1000.0)),
            (f"ours, 2 processes x {n // 2} partitions, in order, budget", ours, (2, n, False, 1000.0)),
            (f"ours, 2 x {n // 2}, shuffled, budget", ours, (2, n, True, 1000.0)),
            ("ours, 1 process x 1 partition, in order, budget", ours, (1, 1, False, 1000.0)),
            (f"HF streaming, {n} consumers (split_dataset_by_node)", hf, (n,)),
            (f"Hub redirects to its CDN: ours, {n} x 1, shuffled, budget", ours, (n, n, True, 1000.0), True),
            (f"Hub redirects to its CDN: ours, 2 x {n // 2}, shuffled, budget", ours, (2, n, True, 1000.0), True),
            (f"Hub redirects to its CDN: HF streaming, {n} consumers", hf, (n,), True),
        ]
        for label, fn, fn_args, *cdn in lines:
            hub.redirect_lfs = bool(cdn)
            r = fn(hub, *fn_args)
            r.update(label=label, row_groups=groups, files=args.files,
                     per_row_group=round((r["requests"] - args.files) / groups, 4))
            print(f"{label:<58} {r['requests']:>7} {r['requests'] / groups:>13.3f} {r['cdn']:>5} "
                  f"{r['coalesced']:>9} {r['rows']:>7}", flush=True)
            results.append(r)
    shuffled = results[1]["per_row_group"]
    print()
    for line in corpus_lines(args.corpus_files, args.corpus_groups, args.tokens_per_group, max(shuffled, 1e-9)):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": args.files, "groups": args.groups, "rows": args.rows, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
