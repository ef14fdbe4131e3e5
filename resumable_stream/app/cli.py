"""``resumable-stream`` command line (docs/cli.md). At module level only the config, the state's names and the
figures, which import no heavy library; each command imports its readers, the checkpoint code (pyarrow, numpy) and
trainers itself, so ``--help`` and a mistyped argument answer at once (tests/app/test_cli_startup.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from typing import Any

from .. import __version__
from ..config import formats as registry
from ..config.stream_config import StreamConfig
from ..config.trainer import TrainerConfig, data_config_from_yaml
from ..errors import ConfigError, ResumableStreamError, SidecarError
from ..observe import metrics
from ..observe.progress import partition_progress, progress_summary
from ..state.names import MANIFEST, rank_file_name, rank_of_file_name
from .preflight import check_training_data


def _show(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return repr(value)


def _positive(name: str, minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: got {text!r}; allowed: an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name}: got {value}; allowed: an integer >= {minimum}")
        return value
    return parse


def _print_stats(before: dict[str, float], samples: int | None, cache: dict | None, **more: Any) -> None:
    """``--stats``: the data path's figures of this command, as one JSON line on stderr."""

    d = metrics.delta(before, metrics.reading(cache=cache))
    d["loader_samples"] = samples or 0
    f = metrics.figures(d)
    shown = {"seconds": f["step_s"], **({"samples": samples, "samples_per_s": f["samples_per_s"]}
                                        if samples is not None else {}),
             **{k: f[k] for k in ("requests", "request_errors", "bytes_read", "retries", "retry_causes",
                                  "response_ms_mean", "response_ms_p50", "response_ms_p90", "response_ms_p99",
                                  "row_groups", "rows_decoded", "prefetch_depth")}}
    if cache is not None:
        shown.update(cache_hits=f["cache_hits"], cache_misses=f["cache_misses"], cache_hit_rate=f["cache_hit_rate"])
    shown.update(more)
    print(json.dumps({"stats": shown}), file=sys.stderr)


def _data_config(args: argparse.Namespace):
    """The data of peek / warmup / index, with every key of the yaml checked as train checks it."""

    return data_config_from_yaml(args.config, args.overrides)


def cmd_peek(args: argparse.Namespace) -> int:
    cfg = _data_config(args)
    from ..stream.mixture import open_stream  # torch, pyarrow, datasets: after the config passed

    before = metrics.reading()
    if args.resume_from:
        resume = args.resume_from
        # a directory written by `peek --save-state DIR` for one rank of several has no manifest: take the file
        own = os.path.join(resume, rank_file_name(args.rank))
        if os.path.isdir(resume) and not os.path.exists(os.path.join(resume, MANIFEST)) and os.path.isfile(own):
            resume = own
        cfg = cfg.replace(resume_state_path=resume)
    if args.world_size is None or args.num_workers is None:     # the state's own topology, else one rank
        from .warmup import checkpoint_topology

        world, workers = checkpoint_topology(cfg.resume_state_path)[:2] if cfg.resume_state_path else (1, 0)
        args.world_size = args.world_size or world
        args.num_workers = workers if args.num_workers is None else args.num_workers
    if args.rank >= args.world_size:
        raise ConfigError(f"--rank: got {args.rank}; allowed: 0 .. {args.world_size - 1} for --world-size "
                          f"{args.world_size}")
    if (args.save_state and args.world_size > 1 and not args.save_state.endswith(".safetensors")
            and os.path.exists(os.path.join(args.save_state, MANIFEST))):
        # one rank's new file next to a complete state would leave the old manifest naming the old files
        raise ConfigError(f"--save-state: got {args.save_state!r}, which already holds a complete state; allowed "
                          "with --world-size > 1: a new directory (then checkpoint.finish once every rank "
                          "saved) or a .safetensors file")
    stream = open_stream(cfg, rank=args.rank, world_size=args.world_size, num_workers=args.num_workers)
    fields = None
    if args.fields:
        fields = [f.strip() for f in args.fields.split(",") if f.strip()]
        columns = stream.source.column_names
        unknown = [f for f in fields if columns is not None and f not in columns]
        if unknown:
            raise ConfigError(f"--fields: unknown column(s) {', '.join(unknown)}; columns: {', '.join(columns)}")
    out = sys.stdout
    try:
        printed = 0
        for sample in itertools.islice(stream, args.num):
            if fields is not None:
                sample = {k: sample.get(k) for k in fields}
            out.write(json.dumps(sample, default=_show, ensure_ascii=False) + "\n")
            printed += 1
        out.flush()
        if args.stats:
            _print_stats(before, printed, metrics.cache_stats(stream.source))
        if args.save_state:
            target = args.save_state
            if args.world_size > 1 and not target.endswith(".safetensors"):
                # one rank of several: its file whole (fingerprint included), so that it resumes on its own
                # before any manifest exists; checkpoint.finish makes the directory a complete state later
                target = os.path.join(target, rank_file_name(args.rank))
            path = stream.save_sidecar(target)
            print(f"saved stream state after {args.num} samples to {path}", file=sys.stderr)
    finally:
        stream.close()   # readers stop here, not at interpreter teardown
    return 0


def _summarize_state(nested: dict[str, Any], full: bool) -> dict[str, Any]:
    """A saved state for ``inspect``: the stream's part (per partition), and what the transform carries and
    the loader's rotation when they are there."""
    summary = _summarize_stream(nested["stream"], full)
    if nested.get("transform"):
        summary["transform_carries"] = {str(p): {"meta": c.get("meta", {}),
                                                 "tensors": {k: list(v.shape) for k, v in c.get("tensors", {}).items()}}
                                        for p, c in sorted(nested["transform"].items())}
    if nested.get("loader"):
        summary["loader"] = {k: {str(r): v for r, v in sorted(by_rank.items())}
                             for k, by_rank in nested["loader"].items()}
    return summary


def _summarize_stream(state: dict[str, Any], full: bool) -> dict[str, Any]:
    from ..state.relocation import describe_files

    fp = state["fingerprint"]
    if state["kind"] == "mixture":   # data.sources: per-partition and per-source progress
        from ..stream.mixture import describe_state

        return describe_state(state, full)
    ds = fp.get("dataset", {})
    summary = {
        "format_version": state["format_version"],
        "topology": state["topology"],
        "dataset": {k: v for k, v in ds.items() if k != "files"},
        "files": describe_files(ds.get("files", []), full),
        "order": fp.get("order"),
        "partitions": {},
    }
    for p, ps in sorted(state["partitions"].items()):
        summary["partitions"][str(p)] = {
            "epoch": ps["epoch"], "window": ps["window"], "offset_in_window": ps["offset"],
            "consumed_samples": ps["consumed"], "open_shards": [list(s) for s in ps["slots"]],
            "next_shard_position": ps["next_shard"],
            "next_sample_digest": ps["next_sample_digest"], "consumed_digest": ps["consumed_digest"],
            **partition_progress(ps),
        }
    return summary


def _progress(states: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Progress over every partition of these states (one file, or every rank of a checkpoint)."""

    streams = [st["stream"] for st in states]
    if any(st["kind"] == "mixture" for st in streams):   # data.sources: per source
        from ..stream.mixture import mixture_progress

        return mixture_progress(streams)
    return progress_summary([partition_progress(ps) for st in streams for ps in st["partitions"].values()])


def _check_rank_file(state: dict[str, Any], file: str) -> None:
    """A rank file holds the state of the rank its name says, checked as a resume checks it
    (:func:`resumable_stream.state.checks.check_rank`): one copied or renamed over another rank's is refused."""
    from ..state.checks import check_rank

    named = rank_of_file_name(os.path.basename(file))
    if named is not None:
        check_rank(state["stream"]["topology"].get("rank"), named, f"sidecar {file!r}", whose="its file name says",
                   cure="a rank file copied or renamed over another rank's, which a resume refuses too: put that "
                        "rank's own file back, or use another checkpoint", listed=False)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..state.checkpoint import saved_identities, state_dir_of
    from ..state.output_dir import checkpoint_dirs, latest_complete_checkpoint

    path, picked = args.path, None
    if os.path.isdir(path) and state_dir_of(path) is None and checkpoint_dirs(path):   # a run's output_dir
        picked = latest_complete_checkpoint(path)
        if picked is None:
            raise SidecarError(f"run directory {path!r}: none of its checkpoints "
                               f"({', '.join(os.path.basename(p) for _, p in checkpoint_dirs(path))}) is complete "
                               "(trainer_state.json and stream_state/manifest.json)")
        path = picked
    with saved_identities(path):     # the files a compact fingerprint stands for: the saved index's
        result = _inspected(args, path, picked)
    print(json.dumps(result, indent=2, default=_show))
    return 0


def _inspected(args: argparse.Namespace, path: str, picked: str | None) -> dict[str, Any]:
    from ..state.checkpoint import (
        SavedIndexes,
        read_manifest,
        read_rank_state,
        read_state_file,
        read_state_fingerprint,
        state_dir_of,
    )

    if os.path.isdir(path):
        state_dir = state_dir_of(path)
        if state_dir is None:
            raise SidecarError(f"stream state {path!r}: no sidecar files or stream_state/ directory here")
        manifest = read_manifest(state_dir)
        ranks, states = {}, []
        fingerprint = read_state_fingerprint(state_dir, manifest)    # once for every rank file
        for r in range(manifest["world_size"]):   # each file confined to state_dir and checked against its digest
            state, file = read_rank_state(state_dir, manifest, r, fingerprint)
            _check_rank_file(state, file)     # the rank its name says, as a resume checks it
            states.append(state)
            ranks[rank_file_name(r)] = _summarize_state(states[-1], args.full)
        saved = SavedIndexes(state_dir).index()      # checked as a resume checks it before using it
        index = None if saved is None else {"file": manifest["index"]["file"], **_saved_index_brief(saved)}
        result = {"stream_state": state_dir, "world_size": manifest["world_size"], "ranks": ranks, "index": index,
                  "progress": _progress(states)}
        if "indexes" in manifest:     # a mixture's, one per source: checked as a resume checks them
            result["indexes"] = {}
            for label, entry in manifest["indexes"].items():
                saved = SavedIndexes(state_dir).index(label)
                result["indexes"][label] = {"file": entry["file"], **_saved_index_brief(saved)}
        if picked is not None:   # say which one: the newest complete checkpoint of the run
            result = {"run_dir": args.path, "checkpoint": picked, **result}
    elif os.path.lexists(path):
        state = read_state_file(path)   # verified by its own digest; a FIFO or device is refused unread
        _check_rank_file(state, path)
        result = {"file": path, **_summarize_state(state, args.full), "progress": _progress([state])}
    else:
        raise SidecarError(f"stream state {path!r}: not found")
    return result


def _saved_index_brief(saved: dict) -> dict:
    """A saved index in ``inspect``: its files, and row groups for parquet (another format: its name)."""
    from ..dataset.growth import describe
    from ..sources.index_table import FileTable

    name = registry.format_of_index(saved).name
    if name == "parquet":
        files = saved["files"]
        groups = files.num_row_groups if isinstance(files, FileTable) else sum(len(f["row_groups"]) for f in files)
        brief = {"files": len(files), "row_groups": groups}
    else:
        brief = {"files": len(saved["files"]), "format": name}
    generations = describe(saved)    # a growing dataset (data.growth): the file set of each epoch
    if generations is not None:
        brief["generations"] = generations
    return brief


def _parse_ranks(text: str) -> list[int] | None:
    if text.strip().lower() == "all":
        return None
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks: got {text!r}; allowed: all, or ranks like 0,3") from None
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"--ranks: got {text!r}; allowed: all, or ranks >= 0 like 0,3")
    return ranks


def cmd_warmup(args: argparse.Namespace) -> int:
    cfg = _data_config(args)     # a mixture: every source's blocks
    from .warmup import run_warmup  # the readers: after the config passed
    before = metrics.reading()
    result = run_warmup(cfg, args.samples, world_size=args.world_size, ranks=args.ranks,
                        num_workers=args.num_workers, state_path=args.resume_from, jobs=args.jobs,
                        progress=not args.no_progress)
    print(f"warmup: {result.summary()}; cache {cfg.cache_dir}: {result.stats.get('cache_bytes') or 0:,} bytes",
          file=sys.stderr)
    if args.stats:
        _print_stats(before, None, None, blocks_fetched=result.fetched_blocks, blocks_already_cached=result.already_cached)
    if result.not_cached:
        print(f"resumable-stream: error: warmup incomplete: {result.not_cached} of {result.planned_blocks} planned "
              f"blocks are not in the cache ({result.why or 'unknown reason'})", file=sys.stderr)
        return 1
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    cfg = _data_config(args)
    from ..sources.index import save_index  # the readers: after the config passed
    if isinstance(cfg, StreamConfig):
        source = _build_index(cfg, args, "data.")
        save_index(args.output, source.index)
        print(json.dumps(_index_summary(args.output, source)))
        return 0
    # a mixture: one index per source, OUTPUT/<label>.json (for data.sources[i].index_path); all built, then written
    keys = [f"data.sources[{i}]." for i in range(len(cfg.sources))]
    for scfg, key in zip(cfg.sources, keys):
        _check_indexable(scfg, args, key)
    built = [_build_index(scfg, args, key, label) for scfg, key, label in zip(cfg.sources, keys, cfg.labels)]
    summary = {}
    for label, source in zip(cfg.labels, built):
        path = os.path.join(args.output, f"{label}.json")
        save_index(path, source.index)
        summary[label] = _index_summary(path, source)
    print(json.dumps({"directory": os.path.abspath(args.output), "sources": summary}))
    return 0


def _check_indexable(cfg: StreamConfig, args: argparse.Namespace, key: str) -> None:
    if cfg.backend != "hf" or not cfg.streaming:
        raise ConfigError(f"{args.config}: {key}backend {cfg.backend!r} / {key}streaming {cfg.streaming!r}: a dataset "
                          "index is for streamed parquet data (backend hf, streaming true)")


def _not_indexed(cfg: StreamConfig, args: argparse.Namespace, key: str, builder: str | None) -> ConfigError:
    return ConfigError(f"{args.config}: {key}dataset_name_or_path {cfg.dataset_name_or_path!r} is read by datasets' "
                       f"{builder!r} builder, which has no dataset index; allowed: data of an indexed format "
                       f"({', '.join(registry.names())}; docs/formats.md). Data of other formats needs no index: "
                       "leave data.index_path null and train or peek from the yaml as it is")


def _build_index(cfg: StreamConfig, args: argparse.Namespace, key: str, label: str | None = None):
    """The indexed source of ``cfg`` (``key``: its keys' prefix in errors, ``label``: its source's name)."""
    from tqdm.auto import tqdm

    from ..sources.open import open_source

    _check_indexable(cfg, args, key)
    if cfg.dataset_name_or_path in registry.DATASETS_BUILDERS and \
            cfg.dataset_name_or_path not in registry.indexed_builders():     # known now: no resolution needed
        raise _not_indexed(cfg, args, key, cfg.dataset_name_or_path)
    desc = "indexing" if label is None else f"indexing {label}"
    with tqdm(desc=desc, unit="file", disable=args.no_progress, file=sys.stderr) as bar:
        def file_done(total: int) -> None:
            bar.total = total       # known once datasets resolved the files
            bar.update(1)

        source = open_source(cfg.source_spec, progress=file_done)
    index = source.index
    if index is None:
        raise _not_indexed(cfg, args, key, source.fingerprint.get("builder"))
    return source


def _index_summary(path: str, source) -> dict:
    """What ``index`` prints of a source's index: its format, files, shards, rows (parquet: row_groups too)."""

    index = source.index
    summary = {"index": os.path.abspath(path), "format": registry.format_of_index(index).name,
               "files": len(index["files"]), "shards": len(source.shards),
               "rows": sum(s.num_rows or 0 for s in source.shards), "bytes": sum(f["size"] for f in index["files"]),
               "columns": list(index["features"])}
    if summary["format"] == "parquet":
        summary["row_groups"] = summary["shards"]       # one shard per row group
    return summary


def cmd_train(args: argparse.Namespace) -> int:
    # the data files, split, resume state and checkpoint, then every key (the model's before the train: section's
    # check imports transformers), before the trainer's imports; run_training checks them again, as any caller
    # of it gets them
    check_training_data(args.config, args.overrides)
    TrainerConfig.from_yaml(args.config, args.overrides)
    from .train import run_training

    run_training(args.config, args.overrides)
    return 0


def cmd_llamafactory(args: argparse.Namespace) -> int:
    import importlib.util

    from .llamafactory import check_command, train

    check_command(args.lf_command)
    if importlib.util.find_spec("llamafactory") is None:
        raise ConfigError("resumable-stream llamafactory needs LLaMA-Factory: pip install "
                          "'resumable-stream[llamafactory]' (see docs/llamafactory.md)")
    return train(args.config, args.overrides)


def cmd_report(args: argparse.Namespace) -> int:
    from .report import report

    comparison = None
    if args.compare is not None:
        from .compare_runs import compare

        comparison = compare(args.run_dir, args.compare)
    report(args.run_dir, args.output, comparison=comparison)
    return 0


def _add_overrides(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"{what} (a value is read as yaml: 5, true, [a, b], null); a relative path is taken "
                             "from the current directory")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resumable-stream",
                                description="Exactly resumable HuggingFace streaming datasets for training.",
                                epilog="`resumable-stream COMMAND --help` for a command's options; examples and "
                                       "their output: docs/cli.md")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the package version and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    peek = sub.add_parser("peek", help="print the next samples a rank will read, as JSON lines")
    peek.add_argument("config", metavar="CONFIG", help="yaml file with a data: section (or only data keys)")
    _add_overrides(peek, "data keys to override")
    peek.add_argument("--rank", type=_positive("--rank", 0), default=0, metavar="R",
                      help="the rank whose samples to print, 0 .. W-1 (default 0)")
    peek.add_argument("--world-size", type=_positive("--world-size", 1), default=None, metavar="W",
                      help="ranks W of the run the state is for (default: the resumed state's, else 1)")
    peek.add_argument("--num-workers", type=_positive("--num-workers", 0), default=None, metavar="K",
                      help="DataLoader workers per rank the state is for (default: the resumed state's, else 0)")
    peek.add_argument("--num", type=_positive("--num", 0), default=10, metavar="N", help="how many samples (default 10)")
    peek.add_argument("--resume-from", metavar="PATH", help="a sidecar file, stream_state dir or checkpoint dir to start from")
    peek.add_argument("--save-state", metavar="PATH", help="write the state after the printed samples (file.safetensors or dir)")
    peek.add_argument("--fields", metavar="a,b", help="comma-separated columns to print (default: all)")
    peek.add_argument("--stats", action="store_true", help="print the data path's figures (requests, bytes, "
                                                             "response times, retries, cache) as JSON on stderr")
    peek.set_defaults(func=cmd_peek)

    train = sub.add_parser("train", help="train a model from one yaml (model/data/train; text, or vision-language "
                                         "with data.format vl); torchrun-compatible")
    train.add_argument("config", metavar="CONFIG", help="trainer yaml with model:, data: and train: sections")
    _add_overrides(train, "keys of the yaml to override, e.g. train.max_steps=5 data.shuffle_seed=7")
    train.set_defaults(func=cmd_train)

    lf = sub.add_parser("llamafactory", help="train with LLaMA-Factory (its yaml, template, callbacks and saves) "
                                             "from a resumable stream: llamafactory train CONFIG [key=value ...]")
    lf.add_argument("lf_command", metavar="train", help="train (as llamafactory-cli train)")
    lf.add_argument("config", metavar="CONFIG", help="the yaml llamafactory-cli train takes, plus an optional resumable_stream: "
                                   "section")
    lf.add_argument("overrides", nargs=argparse.REMAINDER, metavar="key=value",
                    help="overrides, as llamafactory-cli takes them (OmegaConf dotlist)")
    lf.set_defaults(func=cmd_llamafactory)

    warm = sub.add_parser("warmup", help="fill the local block cache with what ranks read in their next samples")
    warm.add_argument("config", metavar="CONFIG", help="yaml file with a data: section that sets cache_dir")
    _add_overrides(warm, "data keys to override")
    warm.add_argument("--resume-from", metavar="CHECKPOINT",
                      help="start from these cursors (checkpoint dir, stream_state dir or sidecar file); "
                           "default data.resume_state_path, else a fresh start")
    warm.add_argument("--samples", type=_positive("--samples", 0), default=100_000, metavar="N",
                      help="samples per rank to warm (default 100000)")
    warm.add_argument("--world-size", type=_positive("--world-size", 1), default=None, metavar="W",
                      help="ranks of the run (default: the checkpoint's, else 1)")
    warm.add_argument("--ranks", type=_parse_ranks, default=None, metavar="RANKS",
                      help="all (default) or a comma-separated list, e.g. 0,3 (the ranks of this node)")
    warm.add_argument("--num-workers", type=_positive("--num-workers", 0), default=None, metavar="K",
                      help="DataLoader workers per rank (default: the checkpoint's, else 0)")
    warm.add_argument("--jobs", type=_positive("--jobs", 1), default=8, metavar="J", help="parallel fetches (default 8)")
    warm.add_argument("--no-progress", action="store_true", help="no progress bar")
    warm.add_argument("--stats", action="store_true", help="print the data path's figures (requests, bytes, "
                                                             "response times, retries, cache) as JSON on stderr")
    warm.set_defaults(func=cmd_warmup)

    idx = sub.add_parser("index", help="resolve a parquet dataset (or each source of a mixture) once and write its "
                                       "dataset index (files, identities, row-group layout) for data.index_path")
    idx.add_argument("config", metavar="CONFIG", help="yaml file with a data: section")
    _add_overrides(idx, "data keys to override")
    idx.add_argument("-o", "--output", required=True, metavar="PATH", help="where to write the index (JSON); for a mixture a "
                                                            "directory, one LABEL.json per source")
    idx.add_argument("--no-progress", action="store_true", help="no progress bar")
    idx.set_defaults(func=cmd_index)

    insp = sub.add_parser("inspect", help="show a sidecar or a checkpoint's stream state as JSON, with each "
                                          "partition's epoch and fraction of it consumed")
    insp.add_argument("path", metavar="PATH", help="a rank-NNNNN.safetensors file, a stream_state dir, a checkpoint dir or a run's output_dir")
    insp.add_argument("--full", action="store_true", help="list every data file of the fingerprint")
    insp.set_defaults(func=cmd_inspect)

    rep = sub.add_parser("report", help="draw a run's train_log.jsonl as a PNG (loss, data wait, throughput, "
                                        "requests and response time, cache hit rate; resumes marked) and "
                                        "print a short summary")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run's train.output_dir (holding train_log.jsonl)")
    rep.add_argument("-o", "--output", metavar="OUT.png", help="where to write the PNG (default RUN_DIR/report.png)")
    rep.add_argument("--compare", metavar="OTHER_DIR", help="another run's output_dir, drawn beside it: its loss, "
                                                            "the loss difference and whether each step consumed "
                                                            "the same samples (their consumed/ logs)")
    rep.set_defaults(func=cmd_report)
    return p


def _drop_stdout() -> None:
    """The reader of stdout went away (``| head``): what is still buffered goes nowhere, so that the
    interpreter's flush at exit does not report a BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # no file descriptor behind sys.stdout (captured in tests)
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # overrides after options (`peek CONFIG --num 3 data.shuffle_seed=7`) come back unparsed
        if not hasattr(args, "overrides") or args.command == "llamafactory" or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    debug = args.debug or os.environ.get("RESUMABLE_STREAM_DEBUG") == "1"
    try:
        code = args.func(args)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except ResumableStreamError as e:
        if debug:
            traceback.print_exc()
        print(f"resumable-stream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # unexpected: still one readable line unless --debug
        if debug:
            traceback.print_exc()
        print(f"resumable-stream: unexpected error: {type(e).__name__}: {e} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
