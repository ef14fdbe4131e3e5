"""tests/against_mindspore/ runs in the venv .ci/mindspore builds: the real mindspore==2.10.0 CPU wheel and no
torch at all (tests/conftest.py leaves this folder out where mindspore is not installed; .ci/mindspore and
test_without_torch.py check that torch is not importable)."""

import os

import pytest
from training_helpers import Procs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path), script=os.path.join(ROOT, "examples", "train_lm_mindspore.py"))
    yield p
    p.cleanup()


@pytest.fixture(scope="session")
def torch_python():
    """The interpreter of a venv with torch (the main .venv that `make test` builds, or $RS_TORCH_PYTHON): the
    PyTorch side of the cross-framework resumes."""
    path = os.environ.get("RS_TORCH_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    if not os.path.exists(path):
        pytest.fail(f"no PyTorch venv at {path}: run `make test` first (it builds .venv) or set RS_TORCH_PYTHON",
                    pytrace=False)
    return path
