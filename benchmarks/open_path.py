#!/usr/bin/env python
"""The way down from ``open_stream(cfg)`` to an open source, traced: which of our modules it enters, how often it
comes back into one it left, and how many calls go up a layer (docs/architecture.md, "One way down").

Each case runs in a fresh process over a tiny dataset written to a temporary directory: local parquet, parquet
over HTTP (explicit URLs, ``tests/_support/http_server.py``), a Hub repo (``tests/_support/hub_server.py``, both
on loopback), local JSON lines, and local parquet opened again from its ``data.index_path``. A profile hook
(``sys.setprofile`` and ``threading.setprofile``) sees every call of a function of the package, from
``open_stream`` until the stream starts its readers (``_start``, not traced). A call's caller is the nearest
frame of the package on the stack (a worker thread's: ``runtime/threads.map_files``' ``one``).

- **entered**: a call into a module from another one; the first one into a module is the way down, every
  later one a **return** to a room the path left;
- **back**: a call from a later stage of the way into an earlier one, the stages being the registry
  (``config/formats.py``), resolution (``sources/resolve.py``), the index (``sources/index*.py``,
  ``fingerprint_files.py``) and the reader (the other modules of ``sources/`` but ``open.py``, which leads the
  way); the floors (``io/``, ``runtime/``, ``plan/``, ...) and the specs are no stage;
- **up**: a call from a module of a lower layer (``tests/test_imports.py``'s ``LAYERS``) into a higher one: a
  callback (``map_files(fn)``, ``retry.call(fn)``) or a method of an object handed down;
- generator resumptions and module bodies (imports) are not calls.

    .venv/bin/python benchmarks/open_path.py [--json out.json] [--case NAME] [--detail]
"""

from __future__ import annotations

import argparse
import collections
import dis
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from test_imports import LAYERS  # noqa: E402  (the layers the import test enforces)

CASES = ("local_parquet", "http_parquet", "hub_parquet", "local_jsonl", "index_path_parquet")
_GENERATOR = 0x20 | 0x80 | 0x200       # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


def _stage(module: str | None) -> int | None:
    """The module's stage on the way (registry 0, resolution 1, index 2, reader 3); None: no stage."""
    if module == "config/formats.py":
        return 0
    if module == "sources/resolve.py":
        return 1
    if module in ("sources/index.py", "sources/index_table.py", "sources/fingerprint_files.py"):
        return 2
    return 3 if module and module.startswith("sources/") and module != "sources/open.py" else None


def _layer(module: str) -> int | None:
    head = module.split("/")[0].removesuffix(".py")
    return next((i for i, names in enumerate(LAYERS) if head in names), None)


@functools.cache
def _first_resume(code) -> int:
    """Where a generator's frame stands when it first runs (later: where it yielded)."""
    return next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)


def _name(code) -> str:
    return getattr(code, "co_qualname", code.co_name)      # (Python 3.11 on; the function's name before)


def _trace(open_it) -> list[tuple[str | None, str, str, str]]:
    """(caller module, callee module, caller function, callee function) for each call of a package function
    while ``open_it()`` runs, ``_start`` excluded."""
    import resumable_stream
    from resumable_stream.stream.base import StreamBase

    root = os.path.dirname(resumable_stream.__file__) + os.sep
    modules: dict[str, str | None] = {}
    calls: list = []
    on = [False]

    def module_of(filename: str) -> str | None:
        if filename not in modules:
            modules[filename] = filename[len(root):] if filename.startswith(root) else None
        return modules[filename]

    def hook(frame, event, arg):
        if event != "call" or not on[0]:
            return
        code = frame.f_code
        callee = module_of(code.co_filename)
        if callee is None or code.co_name == "<module>" or (code.co_flags & _GENERATOR and
                                                            frame.f_lasti > _first_resume(code)):
            return
        up = frame.f_back
        while up is not None and module_of(up.f_code.co_filename) is None:
            up = up.f_back
        calls.append((None if up is None else module_of(up.f_code.co_filename), callee,
                      None if up is None else _name(up.f_code), _name(code)))

    start = StreamBase._start

    def untraced_start(self, *a, **kw):
        on[0] = False
        return start(self, *a, **kw)

    StreamBase._start = untraced_start
    threading.setprofile(hook)
    sys.setprofile(hook)
    on[0] = True
    try:
        stream = open_it()
    finally:
        on[0] = False
        sys.setprofile(None)
        threading.setprofile(None)
    stream.close()
    return calls


def figures(calls) -> dict:
    entries = [(a, b) for a, b, _, _ in calls if a != b]
    order = list(dict.fromkeys(b for _, b, _, _ in calls))
    per = collections.Counter(b for _, b in entries)
    callers = collections.defaultdict(set)
    for a, b in entries:
        callers[b].add(a)
    up = [(a, b, f, g) for a, b, f, g in calls if a is not None and _layer(a) is not None and _layer(b) is not None
          and _layer(a) < _layer(b)]
    back = [(a, b, f, g) for a, b, f, g in calls if _stage(a) is not None and _stage(b) is not None
            and _stage(b) < _stage(a)]
    return {
        "modules": len(order), "calls": len(calls), "entries": len(entries), "back": len(back),
        "returns": sum(n - 1 for n in per.values()),
        "up": len(up),
        "order": order,
        "entered": {m: [per[m], sorted(map(str, callers[m]))] for m in order},
        "back_calls": collections.Counter(f"{a}:{f} -> {b}:{g}" for a, b, f, g in back).most_common(),
        "up_calls": collections.Counter(f"{a}:{f} -> {b}:{g}" for a, b, f, g in up).most_common(),
        "entry_calls": [f"{a}:{f} -> {b}:{g}" for a, b, f, g in calls if a != b],
    }


def _case(name: str, tmp: str) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests", "_support"))
    os.environ.update(HF_HUB_OFFLINE="0", HF_DATASETS_CACHE=os.path.join(tmp, "hf"), HF_HOME=os.path.join(tmp, "hf"))
    import contextlib

    import resumable_stream.sources.jsonl  # noqa: F401  (imports before the trace: module bodies are no calls)
    import resumable_stream.sources.parquet  # noqa: F401
    from resumable_stream import StreamConfig, open_stream
    from resumable_stream.testing import write_jsonl_dataset, write_parquet_dataset

    data = os.path.join(tmp, "data")
    if name == "local_jsonl":
        write_jsonl_dataset(data, rows=300, files=3)
        cfg = StreamConfig(dataset_name_or_path="json", data_files=os.path.join(data, "*.jsonl"))
        return figures(_trace(lambda: open_stream(cfg)))
    files = sorted(write_parquet_dataset(data, rows=300, files=3, row_group_size=50))
    if name == "local_parquet":
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"))
        return figures(_trace(lambda: open_stream(cfg)))
    if name == "index_path_parquet":
        cfg = StreamConfig(dataset_name_or_path="parquet", data_files=os.path.join(data, "*.parquet"),
                           index_path=os.path.join(tmp, "index.json"))
        open_stream(cfg).close()        # writes the index
        return figures(_trace(lambda: open_stream(cfg)))
    with contextlib.ExitStack() as stack:
        if name == "http_parquet":
            from http_server import FileServer

            srv = stack.enter_context(FileServer(data))
            cfg = StreamConfig(dataset_name_or_path="parquet", data_files=[srv.url(os.path.basename(f)) for f in files])
        else:
            from hub_server import HubServer, use_hub

            hub = stack.enter_context(HubServer(os.path.join(tmp, "hub")))
            hub.create_repo("org/data")
            os.makedirs(os.path.join(tmp, "repo"))
            os.rename(data, os.path.join(tmp, "repo", "data"))
            hub.commit("org/data", directory=os.path.join(tmp, "repo"))
            stack.enter_context(use_hub(hub, os.path.join(tmp, "home")))
            cfg = StreamConfig(dataset_name_or_path="org/data", data_files="data/*.parquet")
        return figures(_trace(lambda: open_stream(cfg)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--json")
    ap.add_argument("--detail", action="store_true", help="each module's entries and callers, each call up")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(_case(args.child, tmp)))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    out = {}
    for name in [args.case] if args.case else CASES:
        run = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{name}: failed\n{run.stderr[-3000:]}")
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
        f = out[name]
        e = f["entered"]
        print(f"{name:20s} modules {f['modules']:3d}  entries {f['entries']:4d}  returns {f['returns']:4d}  "
              f"back {f['back']:3d}  up {f['up']:3d}  calls {f['calls']:4d}  entries into "
              + ", ".join(f"{m} {e[m][0]} (from {len(e[m][1])})" for m in
                          ("sources/resolve.py", "io/net.py", "config/formats.py") if m in e))
        if args.detail:
            for m, (n, by) in f["entered"].items():
                print(f"    {m:32s} {n:3d}  from {', '.join(by)}")
            for kind in ("back", "up"):
                for call, n in f[f"{kind}_calls"]:
                    print(f"    {kind} {n:3d}  {call}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
