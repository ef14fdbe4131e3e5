import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_support"))   # servers, scripts, data builders

# Keep datasets' caches inside a temp dir and never reach the hub from tests.
_CACHE = tempfile.mkdtemp(prefix="rs-hf-cache-")
os.environ.setdefault("HF_HOME", _CACHE)
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_CACHE, "datasets"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.metadata  # noqa: E402

import lanes  # noqa: E402
from helpers import TEST_SEED, seeded_rng  # noqa: E402

from resumable_stream.testing import write_parquet_dataset  # noqa: E402

# tests/against_llamafactory/ runs against the real llamafactory package, in the venv .ci/llamafactory builds
# (with LLaMA-Factory's own pins); the main venv does not install it. The installed distribution decides (a
# directory named like the package on sys.path would pass for it as a namespace package).
# tests/against_mindspore/ likewise, in the torch-free venv .ci/mindspore builds, and tests/against_veomni/ in
# the venv .ci/veomni builds.
collect_ignore_glob = []
for _dist, _folder in (("llamafactory", "against_llamafactory"), ("mindspore", "against_mindspore"),
                       ("veomni", "against_veomni")):
    try:
        importlib.metadata.distribution(_dist)
    except importlib.metadata.PackageNotFoundError:
        collect_ignore_glob.append(f"{_folder}/*")


@pytest.fixture(scope="session")
def parquet_60(tmp_path_factory):
    """6000 rows in 6 files x 10 row groups of 100 rows: 60 shards."""
    d = tmp_path_factory.mktemp("parquet60")
    write_parquet_dataset(str(d), rows=6000, files=6, row_group_size=100)
    return str(d)


@pytest.fixture(scope="session")
def parquet_small(tmp_path_factory):
    """1000 rows in 4 files x 5 row groups of 50 rows: 20 shards."""
    d = tmp_path_factory.mktemp("parquet_small")
    write_parquet_dataset(str(d), rows=1000, files=4, row_group_size=50)
    return str(d)


@pytest.fixture(scope="session")
def parquet_two_shards(tmp_path_factory):
    """300 rows in one file with 2 row groups: fewer shards than most topologies -> row striding."""
    d = tmp_path_factory.mktemp("parquet_two")
    write_parquet_dataset(str(d), rows=300, files=1, row_group_size=150)
    return str(d)


@pytest.fixture(scope="module")
def hub_offline():
    """The Hub is unreachable: only local files and the loopback server may be used (also forced in
    the already-imported config modules, not only through the environment)."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def cfg(parquet_small):
    """The small dataset, shuffled through a 64-row window (modules may define their own ``cfg``)."""
    from helpers import parquet_config

    return parquet_config(parquet_small, shuffle=True, buffer_size=64)


@pytest.fixture(scope="module")
def source(cfg):
    """``cfg``'s source, opened once per module."""
    from resumable_stream.sources import open_source

    return open_source(cfg.source_spec)


@pytest.fixture
def procs(request, tmp_path):
    """Starts training processes (``TRAINING_SCRIPT`` of the test module, else examples/train_lm.py) and kills
    whatever still runs when the test ends. A test using it is a training test: marked slow (see below)."""
    from training_helpers import TRAIN_LM, Procs

    p = Procs(str(tmp_path), script=getattr(request.module, "TRAINING_SCRIPT", TRAIN_LM))
    try:
        yield p
    finally:
        p.cleanup()


# ------------------------------------------------------------------------------------------------ random seeds
# Every random choice of the tests comes from TEST_SEED (helpers.py; RS_TEST_SEED=<seed> reruns one), and so do
# Hypothesis' examples (one --hypothesis-seed for the session, no example database carried between runs).
@pytest.fixture
def rng(request):
    """A random.Random seeded from TEST_SEED and the test's id; the seed is printed when the test fails."""
    return seeded_rng(request.node.nodeid)


def pytest_report_header(config):
    return f"random seed: RS_TEST_SEED={TEST_SEED}"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from hypothesis import settings

    settings.register_profile("resumable-stream", database=None)
    settings.load_profile("resumable-stream")
    if config.getoption("hypothesis_seed", None) is None:    # hypothesis' own plugin applies the option
        config.option.hypothesis_seed = str(TEST_SEED)


_FIGURES: list[str] = []    # what tests measured and report (record_property("figure", text)): the summary says them


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "call":
        _FIGURES.extend(f"{item.name}: {value}" for name, value in item.user_properties if name == "figure")
    if report.failed:
        report.sections.append(("random seed", f"rerun with RS_TEST_SEED={TEST_SEED} (and --hypothesis-seed "
                                               f"{item.config.getoption('hypothesis_seed', None)})"))


# ------------------------------------------------------------------------------- the fast lane (make test-fast)
# tests/_support/lanes.py says what is slow and how the fast lane is kept fast.
def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help="the fast lane: leave out tests marked slow (training "
                     f"subprocesses, torchrun); report the costliest tests over {lanes.FAST_LANE_CPU_BUDGET_S:.0f} s "
                     f"of test CPU time (a failure only with {lanes.STRICT_ENV}=1)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "procs" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    if config.getoption("fast"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def _no_training_outside_slow_tests(request, monkeypatch):
    if request.node.get_closest_marker("slow"):
        yield
        return
    real_init = subprocess.Popen.__init__

    def guarded_init(self, args, *a, **kw):
        line = lanes.training_command(args)
        if line is not None:
            pytest.fail(f"{request.node.nodeid} starts a training / torchrun ({line}) but is not marked slow: "
                        "mark it @pytest.mark.slow (or use the procs fixture) so that make test-fast leaves it "
                        "out", pytrace=False)
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_init)
    yield


_COSTS: dict[str, dict[str, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = lanes.cpu_seconds(), time.perf_counter()
    yield
    _COSTS[item.nodeid] = {"cpu": lanes.cpu_seconds() - cpu, "wall": time.perf_counter() - wall}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for figure in _FIGURES:
        terminalreporter.write_line(f"figure: {figure}")
    if os.environ.get("RS_TEST_COSTS"):      # per-test CPU / wall seconds, to size the lanes
        with open(os.environ["RS_TEST_COSTS"], "w", encoding="utf-8") as f:
            json.dump(_COSTS, f, indent=0)
    if config.getoption("fast"):
        total = sum(c["cpu"] for c in _COSTS.values())
        terminalreporter.write_line(f"fast lane: {total:.1f} s of test CPU time (budget "
                                    f"{lanes.FAST_LANE_CPU_BUDGET_S:.0f} s); {lanes.cpu_seconds():.1f} s "
                                    "with collection and imports")
        note = lanes.budget_report(_COSTS)
        if note:
            terminalreporter.write_line(note, **({"red": True} if lanes.budget_is_strict() else {"yellow": True}))


def pytest_sessionfinish(session, exitstatus):
    # over budget fails the session only when a developer opts in: a busy machine makes a passing suite's CPU
    # time run high, and make test-fast must not fail on it
    if session.config.getoption("fast") and lanes.budget_fails(_COSTS):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
