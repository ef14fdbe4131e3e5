"""The test lanes themselves: a test not marked slow cannot start a training, tests using ``procs`` are slow
and never in the fast lane, and the fast lane's CPU budget is enforced (tests/lanes.py, conftest.py)."""

import subprocess
import sys

import lanes
import pytest
from training_helpers import DATA_PARALLEL_TRAIN, PAUSED_TRAIN, SLOW_MANIFEST_TRAIN, TRAIN_LM, TRAIN_VL


@pytest.mark.parametrize("argv", [
    [sys.executable, TRAIN_LM, "run.yaml"],
    [sys.executable, TRAIN_VL, "run.yaml"],
    [sys.executable, SLOW_MANIFEST_TRAIN, "run.yaml"],
    [sys.executable, PAUSED_TRAIN, "run.yaml"],
    [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", DATA_PARALLEL_TRAIN, TRAIN_LM, "x"],
    ["torchrun", "--nproc_per_node=2", "x.py"],
    [sys.executable, "-m", "resumable_stream.cli", "train", "run.yaml"],
    f"{sys.executable} examples/demo.py --steps 40",
], ids=["train_lm", "train_vl", "slow_manifest_train", "paused_train", "torch.distributed.run", "torchrun", "cli-train", "shell-demo"])
def test_a_test_not_marked_slow_cannot_start_a_training(argv):
    with pytest.raises(pytest.fail.Exception, match="not marked slow"):
        subprocess.run(argv, capture_output=True, timeout=60)


def test_other_subprocesses_run_in_the_fast_lane():
    for argv in ([sys.executable, "-m", "resumable_stream.cli", "peek", "--help"],
                 [sys.executable, "-c", "print('train_lm.py')"]):
        assert lanes.training_command(argv) is None, argv
    r = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=60)
    assert r.stdout == "42\n"


@pytest.mark.slow
def test_a_slow_test_may_start_a_training():
    """The guard lets it start (it stops at its usage text: ``--help`` is not a yaml, nothing trains)."""
    argv = [sys.executable, TRAIN_LM, "--help"]
    assert lanes.training_command(argv) is not None
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "python examples/train_lm.py" in r.stderr, r.stderr


def test_tests_using_procs_are_slow_and_not_in_the_fast_lane(request):
    items = request.session.items
    procs_users = [i for i in items if "procs" in i.fixturenames]
    assert all(i.get_closest_marker("slow") for i in procs_users), [i.nodeid for i in procs_users]
    if request.config.getoption("fast"):
        assert not [i.nodeid for i in items if i.get_closest_marker("slow")]


def test_the_budget_names_the_costliest_tests():
    costs = {f"tests/test_x.py::test_{i}": {"cpu": float(i), "wall": 2.0 * i} for i in range(1, 14)}  # 91 s
    assert lanes.over_budget(costs, budget_s=91.0) is None
    message = lanes.over_budget(costs, budget_s=90.0)
    assert message is not None and "91.0 s" in message and "budget of 90 s" in message
    listed = [line.split()[-1] for line in message.splitlines()[1:]]
    assert listed == [f"tests/test_x.py::test_{i}" for i in range(13, 5, -1)]


def test_no_test_module_imports_another():
    """Shared code lives in helper modules (helpers.py, training_helpers.py, kill_resume_harness.py) and shared
    fixtures in conftest.py: importing a test module would run its module-level setup and fixtures twice."""
    import ast
    import pathlib

    offenders = []
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders
