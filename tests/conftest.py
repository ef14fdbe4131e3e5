import os
import tempfile

import pytest

# Keep datasets' caches inside a temp dir and never reach the hub from tests.
_CACHE = tempfile.mkdtemp(prefix="rs-hf-cache-")
os.environ.setdefault("HF_HOME", _CACHE)
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_CACHE, "datasets"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from resumable_stream.synthetic import write_parquet_dataset  # noqa: E402


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
