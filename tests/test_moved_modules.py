"""The module names of 0.x, before the sub-packages, still import: each is the new module itself
(resumable_stream/runtime/moved_modules.py), so code written against them, a patch of one of them, and
``python -m`` of an old name keep working."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import resumable_stream
from resumable_stream.runtime.moved_modules import MOVED


def test_every_old_name_maps_to_a_module_that_exists():
    assert len(MOVED) >= 50
    missing = [new for new in MOVED.values() if importlib.util.find_spec(new) is None]
    assert not missing


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_module_name_is_the_new_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_module_keeps_its_own_name_and_spec():
    old = importlib.import_module("resumable_stream.sidecar")
    assert old.__name__ == old.__spec__.name == "resumable_stream.state.sidecar"
    from resumable_stream.checkpoint import finish

    from resumable_stream.state.checkpoint import finish as finish_now
    assert finish is finish_now
    import resumable_stream.trainer_patch.callbacks as callbacks  # a module of an old package
    assert callbacks.__name__ == "resumable_stream.integrations.transformers.callbacks"


def test_patching_an_old_name_patches_the_new_module(monkeypatch):
    marker = object()
    monkeypatch.setattr("resumable_stream.progress.partition_progress", marker)
    from resumable_stream.observe import progress
    assert progress.partition_progress is marker


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("resumable_stream.no_such_module")


@pytest.mark.parametrize("module, argv, expect", [
    ("resumable_stream.cli", ["--version"], resumable_stream.__version__),     # a moved module
    ("resumable_stream.llamafactory", ["--help"], "llamafactory"),             # a moved package: its __main__
])
def test_an_old_name_runs_with_python_m(module, argv, expect):
    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout
    assert "RuntimeWarning" not in r.stderr        # the module ran once, as __main__
