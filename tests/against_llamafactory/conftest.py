import pytest
from lf_helpers import make_data, make_model
from training_helpers import Procs


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """(model dir, dataset_dir) shared by the session's runs."""
    root = tmp_path_factory.mktemp("lf_assets")
    return make_model(str(root / "tiny-qwen3")), make_data(str(root / "data"))


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path))
    yield p
    p.cleanup()
