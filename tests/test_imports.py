"""The package has no import circle, and each of its modules imports alone in a fresh interpreter.

The graph is read from the source (AST), not from ``sys.modules``: imports inside functions count too, since a
circle closed at call time breaks as soon as someone imports the modules in another order.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

import resumable_stream

PACKAGE = "resumable_stream"
PACKAGE_DIR = Path(resumable_stream.__file__).parent
REPO_ROOT = PACKAGE_DIR.parent


def module_files(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules of ``known`` that one import statement of ``module`` loads itself (not the parent
    packages Python imports on the way: every submodule import does that, it is no edge)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:                                  # relative: from the module's package, up level - 1
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if base not in known:
        if base == PACKAGE or base.startswith(PACKAGE + ".") or node.level:
            raise AssertionError(f"{module}: line {node.lineno} imports {base!r}, which is not a module here")
        return set()                                # third-party
    # `from pkg import sub` loads pkg.sub; `from pkg import name` (or `*`) loads pkg itself
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}


def import_graph(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its code (module level or in functions)."""
    files = module_files(package_dir, package)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(module, path.name == "__init__.py", node, known)
        graph[module] = edges - {module}
    return graph


@functools.cache
def package_graph() -> dict[str, set[str]]:
    """The package's graph, read once per session (do not modify it)."""
    return import_graph()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: for every module on one, the shortest circle through it (each circle once, starting
    at its smallest name, e.g. ``[a, b, c, a]``)."""
    found = set()
    for start in graph:
        parent: dict[str, str] = {}
        queue = deque([start])
        while queue:                                # breadth first: the first way back is a shortest one
            node = queue.popleft()
            if start in graph[node]:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                ring = path[::-1]                   # start ... node (then back to start)
                i = ring.index(min(ring))
                found.add(tuple(ring[i:] + ring[:i]))
                break
            for nxt in sorted(graph[node]):
                if nxt not in parent and nxt != start:
                    parent[nxt] = node
                    queue.append(nxt)
    return [[*ring, ring[0]] for ring in sorted(found)]


# ------------------------------------------------------------------------------------------ the graph reader
def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_graph_reads_every_import_form(tmp_path):
    pkg = _write(tmp_path / PACKAGE, {
        "__init__.py": "from .a import f\n__version__ = '1'\n",
        "a.py": "import os\nfrom . import __version__\n\ndef f():\n    from .sub import helper\n",
        "b.py": f"import {PACKAGE}.sub.c\nfrom .sub import c as c2\n",
        "sub/__init__.py": "def helper():\n    from . import c\n",
        "sub/c.py": "from ..b import x\nfrom .. import a\nfrom .d import *\n",
        "sub/d.py": "import json\n",
    })
    p = PACKAGE
    assert import_graph(pkg) == {
        p: {f"{p}.a"},
        f"{p}.a": {p, f"{p}.sub"},                  # `from . import __version__`: the package's __init__
        f"{p}.b": {f"{p}.sub.c"},                   # not the parent packages imported on the way
        f"{p}.sub": {f"{p}.sub.c"},                 # `from . import c` in a function: the submodule
        f"{p}.sub.c": {f"{p}.b", f"{p}.a", f"{p}.sub.d"},
        f"{p}.sub.d": set(),
    }


def test_graph_rejects_an_import_of_a_missing_module(tmp_path):
    pkg = _write(tmp_path / PACKAGE, {"__init__.py": "", "a.py": "from .gone import x\n"})
    with pytest.raises(AssertionError, match=r"resumable_stream.a: line 1 imports 'resumable_stream.gone'"):
        import_graph(pkg)


def test_cycles_lists_each_circle_once():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"d2"}, "d2": {"b"}, "e": {"a"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c", "a"], ["b", "d", "d2", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_of_the_package_sees_the_imports_in_functions():
    graph = package_graph()
    assert f"{PACKAGE}.stream.follow" in graph[f"{PACKAGE}.stream.single"]         # at module level
    assert f"{PACKAGE}.stream.mixture" in graph[f"{PACKAGE}.app.cli"]               # only in functions
    assert f"{PACKAGE}.cache" not in graph[f"{PACKAGE}.cache.store"]               # its parent package: no edge


# ------------------------------------------------------------------------------------------------ the package
def test_no_import_circle():
    found = cycles(package_graph())
    assert not found, "import circles in the package:\n" + "\n".join("  " + " -> ".join(c) for c in found)


# The layers of the house, lowest first (docs/architecture.md says what each owns): a module imports its own
# layer and those below, never one above, at module level or in a function. The package's ``__init__`` (the
# public names) and ``__main__`` modules (entry points: they run, nothing imports them) stand above them all; only
# the commands (app) may import the package's public names.
LAYERS = (("errors", "limits", "plan", "testing"), ("runtime",), ("observe",), ("config",), ("io",), ("sources",),
          ("state",), ("dataset",), ("cache",), ("transforms",), ("stream",), ("loader",), ("integrations",),
          ("app",))
TOP_MODULES_AT_MOST = 8


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module's layer (by its first name under the package); None for the entry points."""
    if module == PACKAGE or module.endswith(".__main__"):
        return None
    head = module[len(PACKAGE) + 1:].split(".")[0]
    for i, names in enumerate(LAYERS):
        if head in names:
            return i
    raise AssertionError(f"{module}: in no layer of LAYERS (tests/test_imports.py); add its package there")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        here = layer_of(module)
        if here is None:
            continue
        for dep in sorted(deps):
            there = layer_of(dep)
            if there is None and dep == PACKAGE and LAYERS[here] == ("app",):
                continue            # the commands may use the public names (and __version__) of the package
            if there is None or there > here:
                found.append(f"{module} ({'/'.join(LAYERS[here])}) imports {dep} "
                             f"({'the package itself' if there is None else '/'.join(LAYERS[there])})")
    return found


def test_layers_reads_an_upward_import(tmp_path):
    pkg = _write(tmp_path / PACKAGE, {
        "__init__.py": "from .app import run\n", "__main__.py": "from .app import run\n",
        "errors.py": "", "app/__init__.py": "from ..stream import s\nrun = 1\n",
        "stream/__init__.py": "s = 1\ndef late():\n    from ..app import run\n",
    })
    assert upward_imports(import_graph(pkg)) == [
        f"{PACKAGE}.stream (stream) imports {PACKAGE}.app (app)"]


def test_no_import_from_a_lower_layer_to_a_higher_one():
    found = upward_imports(package_graph())
    assert not found, "imports that climb the layers:\n" + "\n".join("  " + f for f in found)


# Below config/ each stage takes the small spec it needs (config/specs.py: DataSpec, NetPolicy, ReadSpec, GrowthSpec,
# IndexSpec, SourceSpec, CacheSpec), never the whole StreamConfig: the streams' public constructors
# (ResumableStream(cfg), MixtureStream(cfg), open_stream(cfg)) take it and build the specs once; the loader, the
# integrations and the app sit above and hand it to them (docs/architecture.md, "Specs, not the whole config").
WHOLE_CONFIG = (f"{PACKAGE}.config", f"{PACKAGE}.config.stream_config")
PUBLIC_CONSTRUCTORS = (f"{PACKAGE}.stream.single", f"{PACKAGE}.stream.mixture")


def whole_config_takers(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> list[str]:
    """Modules of the stages between config/ and the streams' constructors that import the whole config, and
    their functions with a parameter annotated StreamConfig / MixtureConfig or an untyped ``cfg`` / ``config``."""
    graph, files = import_graph(package_dir, package), module_files(package_dir, package)
    lo, hi = LAYERS.index(("config",)), LAYERS.index(("loader",))
    found = []
    for module, path in sorted(files.items()):
        layer = layer_of(module) if module in graph else None
        if layer is None or not lo < layer < hi:
            continue
        if module not in PUBLIC_CONSTRUCTORS:
            found += [f"{module} imports {dep}" for dep in sorted(graph[module]) if dep.startswith(WHOLE_CONFIG)
                      and dep in WHOLE_CONFIG]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name == "__init__" and \
                    module in PUBLIC_CONSTRUCTORS or node.name == "open_stream":
                continue
            for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                ann = ast.unparse(a.annotation) if a.annotation else ""
                if "StreamConfig" in ann or "MixtureConfig" in ann or (not ann and a.arg in ("cfg", "config")):
                    found.append(f"{module}.{node.name}({a.arg}{': ' + ann if ann else ''})")
    return found


def test_whole_config_takers_reads_an_import_and_a_parameter(tmp_path):
    pkg = _write(tmp_path / PACKAGE, {
        "__init__.py": "", "errors.py": "", "config/__init__.py": "", "config/stream_config.py": "S = 1\n",
        "sources/__init__.py": "", "sources/a.py": "from ..config.stream_config import S\ndef f(x: int): pass\n",
        "dataset/__init__.py": "", "dataset/b.py": "def g(spec, cfg): pass\n",
    })
    assert whole_config_takers(pkg) == [f"{PACKAGE}.dataset.b.g(cfg)", f"{PACKAGE}.sources.a imports "
                                        f"{PACKAGE}.config.stream_config"]


def test_no_stage_below_config_takes_the_whole_config():
    found = whole_config_takers()
    assert not found, "the whole StreamConfig below config/ (take a spec of config/specs.py):\n" + "\n".join(
        "  " + f for f in found)


# The one module-level __getattr__ allowed: the package's own, for its public names (PEP 562), which load torch,
# pyarrow and datasets; it is about startup time (`resumable-stream --help` answers at once,
# tests/app/test_cli_startup.py), not about a circle: the graph above reads its imports all the same.
LAZY_NAMES_ALLOWED = ["resumable_stream/__init__.py"]


def test_the_top_of_the_package_holds_a_handful_of_modules_and_no_lazy_names():
    top = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(top) <= TOP_MODULES_AT_MOST, top
    lazy = [path.relative_to(REPO_ROOT).as_posix() for path in module_files(PACKAGE_DIR, PACKAGE).values()
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(path.read_text()).body)]
    assert lazy == LAZY_NAMES_ALLOWED, f"module-level __getattr__ (names imported lazily to dodge a circle): {lazy}"


_PUBLIC_NAMES = """
import sys
import resumable_stream as rs
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "datasets", "pyarrow", "numpy", "yaml"})
listed = sorted(set(rs.__all__) - set(dir(rs)))
ns = {}
exec("from resumable_stream import *", ns)
star = sorted(set(rs.__all__) - set(ns))
from resumable_stream.config.stream_config import MixtureConfig, StreamConfig
from resumable_stream.stream.base import Stream
from resumable_stream.stream.mixture import MixtureStream, open_stream
from resumable_stream.stream.single import ResumableStream
same = all(getattr(rs, n) is globals()[n] for n in
           ("StreamConfig", "MixtureConfig", "Stream", "MixtureStream", "open_stream", "ResumableStream"))
try:
    rs.no_such_name
    missing = "no error"
except AttributeError as e:
    missing = str(e)
print(repr((heavy, listed, star, same, missing)))
"""


def test_the_public_names_load_on_first_use_and_are_the_modules_own():
    result = subprocess.run([sys.executable, "-c", _PUBLIC_NAMES], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                             os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr
    heavy, listed, star, same, missing = ast.literal_eval(result.stdout.strip())
    assert heavy == [], f"`import resumable_stream` imports {heavy}"
    assert listed == [] and star == [], f"names of __all__ missing from dir(): {listed}, from `import *`: {star}"
    assert same
    assert missing == "module 'resumable_stream' has no attribute 'no_such_name'"


# Optional extras: an import of the package must not need them (blocked in the subprocess below).
OPTIONAL_EXTRAS = ("torch_npu", "s3fs", "PIL", "moto", "torchdata", "matplotlib", "mindspore")
# Each module is imported alone: in a process forked from one that loaded the heavy third-party packages and none
# of ours (what an import circle of ours needs to show is that no module of ours came first; paying torch's and
# datasets' import once instead of once per module takes the test from ~100 s to seconds), two at a time
_IMPORT_EACH_ALONE = """
import json, os, sys, traceback
sys.modules.update(dict.fromkeys({extras!r}))      # a None entry: ImportError on import
for heavy in ("numpy", "pyarrow", "pyarrow.parquet", "torch", "datasets", "transformers", "safetensors", "yaml",
              "fsspec", "huggingface_hub", "tokenizers", "accelerate", "aiohttp"):
    __import__(heavy)
assert not [m for m in sys.modules if m.split(".")[0] == "resumable_stream"], "a module of ours loaded early"
failed = {{}}
running = {{}}                 # pid -> (module, pipe): two children at a time, one per core
modules = list({modules!r})
while modules or running:
    while modules and len(running) < 2:
        module = modules.pop(0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                __import__(module)
                code = 0
            except BaseException:
                os.write(write, traceback.format_exc().encode()[-4000:])   # < a pipe's buffer: never blocks
                code = 1
            os._exit(code)
        os.close(write)
        running[pid] = (module, read)
    pid, status = os.wait()
    module, read = running.pop(pid)
    with os.fdopen(read, "rb") as f:
        error = f.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        failed[module] = error or f"exit status {{status}}"
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_each_module_imports_alone_in_a_fresh_interpreter():
    modules = sorted(module_files(PACKAGE_DIR, PACKAGE))
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE.format(extras=OPTIONAL_EXTRAS, modules=modules)],
                            env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"import {m} failed alone:\n{e}" for m, e in failed.items())


# Without torch: the stream core (config, plan, partitions, sources, sidecars, cache, checkpoint, the loader
# in this process, the transforms' processors, the MindSpore adapter) imports with torch blocked; only the
# PyTorch training paths need it. tests/against_mindspore runs the core in a venv that has no torch at all.
NEEDS_TORCH = (f"{PACKAGE}.runtime.devices", f"{PACKAGE}.integrations.transformers", f"{PACKAGE}.app.train",
               f"{PACKAGE}.integrations.llamafactory.callbacks", f"{PACKAGE}.app.llamafactory")
_WITHOUT_TORCH = """
import importlib, sys
sys.modules.update(dict.fromkeys({blocked!r}))
failed = []
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed.append(f"{{name}}: {{e}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _needs_torch(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in NEEDS_TORCH)


def _import_without(blocked: tuple[str, ...], modules: list[str]) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    code = _WITHOUT_TORCH.format(blocked=blocked, modules=modules)
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=240)


def test_the_core_imports_without_torch():
    core = [m for m in sorted(module_files(PACKAGE_DIR, PACKAGE)) if not _needs_torch(m)]
    assert {PACKAGE, f"{PACKAGE}.stream", f"{PACKAGE}.state.checkpoint", f"{PACKAGE}.loader",
            f"{PACKAGE}.transforms.text", f"{PACKAGE}.integrations.mindspore"} <= set(core)
    result = _import_without(("torch", *OPTIONAL_EXTRAS), core)
    assert result.returncode == 0, f"modules that need torch but are not listed in NEEDS_TORCH:\n{result.stdout}" \
                                   f"{result.stderr[-2000:]}"


def test_the_torch_check_sees_a_module_that_needs_torch():
    # the listed modules do need it: the check above would catch the core importing one of them
    result = _import_without(("torch",), [f"{PACKAGE}.devices", PACKAGE])
    assert result.returncode == 1 and result.stdout.startswith(f"{PACKAGE}.devices: ")
    assert f"{PACKAGE}: " not in result.stdout


# Module-level state (docs/architecture.md, "Module-level state only for process-wide caches"): a global bound to a
# lock, a thread-local, a weak or bounded collection or a random generator, or a container the module's functions
# change (item assignment, a mutating method, `global`), must be named in that table's row for its module.
_STATEFUL_CALLS = {"Lock", "RLock", "local", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Random", "deque"}
_MUTATORS = {"append", "add", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault",
             "update", "appendleft", "popleft"}


def module_level_state(source: str) -> list[str]:
    """The names of ``source``'s module-level mutable state (see above), in order."""
    tree = ast.parse(source)
    bound: dict[str, bool] = {}                       # name -> stateful by its kind alone
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        call = value.func if isinstance(value, ast.Call) else None
        called = getattr(call, "attr", None) or getattr(call, "id", None)
        container = isinstance(value, (ast.Dict, ast.List, ast.Set)) or called in {"dict", "list", "set", "OrderedDict",
                                                                                   "defaultdict", "Counter"}
        if called in _STATEFUL_CALLS or container:
            for t in targets:
                if isinstance(t, ast.Name) and t.id != "__all__":
                    bound[t.id] = called in _STATEFUL_CALLS
    changed = set()                                  # changed by code that runs after the import
    bodies = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in (inner for body in bodies for inner in ast.walk(body)):
        if isinstance(node, ast.Global):
            changed.update(node.names)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name):
            changed.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
    return [name for name, stateful in bound.items() if stateful or name in changed]


def test_module_level_state_is_found_by_its_kind_or_its_changes():
    source = ("import threading\nA = {}\nB = {'k': 1}\nC = []\nL = threading.Lock()\n__all__ = ['x']\n"
              "B['set at import'] = 2\ndef f():\n    A['x'] = 1\n    C.append(2)\n    return B['k']\n")
    assert module_level_state(source) == ["A", "C", "L"]


def test_every_module_level_state_is_named_in_the_architecture_table():
    rows = [line for line in (REPO_ROOT / "docs" / "architecture.md").read_text().splitlines()
            if line.startswith("| `")]
    missing = []
    for path in module_files(PACKAGE_DIR, PACKAGE).values():
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        for name in module_level_state(path.read_text()):
            if not any(f"`{rel}`" in row and f"`{name}`" in row for row in rows):
                missing.append(f"{rel}: {name}")
    assert not missing, "module-level state not named in docs/architecture.md's table:\n" + "\n".join(missing)
