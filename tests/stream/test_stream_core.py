"""One stream core: both streams implement the ``Stream`` protocol, the loader needs nothing else of them, and
no module of the package reads another's private attributes."""

import ast
import pathlib

import pytest
from repo_paths import REPO_ROOT
from small_mixture import TripleProcessor, collate, copy_data, mixture_config, stream_config

from resumable_stream import MixtureStream, ResumableStream, Stream
from resumable_stream.loader import StreamLoader
from resumable_stream.stream.base import round_robin

PACKAGE = pathlib.Path(REPO_ROOT) / "resumable_stream"
PROTOCOL_MEMBERS = {name for name in dir(Stream) if not name.startswith("_")} | set(Stream.__annotations__)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("core")))


class ProtocolOnly:
    """A stream seen only through the ``Stream`` protocol: any other attribute is an AttributeError."""

    def __init__(self, stream):
        object.__setattr__(self, "_stream", stream)

    def __getattr__(self, name):
        if name not in PROTOCOL_MEMBERS:
            raise AttributeError(f"{name!r} is not part of the Stream protocol")
        return getattr(self._stream, name)

    def __setattr__(self, name, value):
        if name not in PROTOCOL_MEMBERS:
            raise AttributeError(f"{name!r} is not part of the Stream protocol")
        setattr(self._stream, name, value)


def test_both_streams_implement_the_protocol(data):
    assert {"iter_partition", "partition_state", "state_dict", "load_state_dict", "check_saved_identity",
            "adopt_topology", "lanes", "partitions", "source_label"} <= PROTOCOL_MEMBERS
    assert isinstance(ResumableStream(stream_config(data), rank=0, world_size=1), Stream)
    assert isinstance(MixtureStream(mixture_config(data), rank=0, world_size=1), Stream)


@pytest.mark.parametrize("make", [stream_config, mixture_config], ids=["stream", "mixture"])
def test_the_loader_trains_and_resumes_through_the_protocol_alone(data, tmp_path, make):
    def loader(stream):
        return StreamLoader(ProtocolOnly(stream), 3, collate_fn=collate, processor_factory=TripleProcessor)

    def open_one():
        cfg = make(data)
        return (MixtureStream if hasattr(cfg, "sources") else ResumableStream)(cfg, rank=1, world_size=2)

    whole = iter(loader(open_one()))
    reference = [next(whole) for _ in range(12)]
    first = loader(open_one())
    batches = iter(first)
    assert [next(batches) for _ in range(5)] == reference[:5]
    first.save_sidecar(str(tmp_path / "rank1.safetensors"))
    second = loader(open_one())
    second.load_sidecar(str(tmp_path / "rank1.safetensors"))
    assert [b for _, b in zip(range(7), second)] == reference[5:]


def test_round_robin_rotates_skips_ended_iterators_and_reports_its_turn():
    turns = []
    out = list(round_robin({0: iter("ab"), 1: iter(""), 2: iter("xyz")}, [0, 1, 2], turn=2, on_turn=turns.append))
    assert out == ["x", "a", "y", "b", "z"]
    assert turns[:4] == [0, 1, 2, 0]


# Reads of a third-party object's private members that we must override or call: (module, attribute).
THIRD_PARTY_PRIVATES = {
    ("integrations/transformers/patch.py", "_save_checkpoint"),      # transformers.Trainer: where checkpoints are written
    ("integrations/transformers/patch.py", "_rotate_checkpoints"),   # transformers 4.x: rotation, deferred until complete
    ("integrations/transformers/patch.py", "_get_output_dir"),       # transformers.Trainer: where the checkpoint went
    ("integrations/transformers/patch.py", "_load_optimizer_and_scheduler"),   # transformers.Trainer: optimizer to cpu
    ("runtime/devices.py", "_prepare_backend"),                  # accelerate.PartialState: the gloo backend on CPU
    ("app/train.py", "_exit"),                 # os._exit when the launcher is gone
    ("app/train.py", "_attn_implementation"),  # transformers config: the attention kernel in use
    ("app/train.py", "_load_from_checkpoint"),   # transformers.Trainer: a finished run's final model
    ("integrations/llamafactory/weights.py", "_load_from_checkpoint"),   # transformers.Trainer: renamed weights, a LoRA reward model
    ("sources/webdataset.py", "_get_pipeline_from_tar"),   # datasets' webdataset builder: grouping + decoders
    ("loader.py", "_getframe"),          # sys._getframe: is Lightning's fit loop saving the state?
    ("loader.py", "_data_fetcher"),      # Lightning's fit loop: the batches its fetcher took ahead
    ("sources/jsonl_rows.py", "_cast_table"),   # datasets' json builder: its cast of a parsed block to the features
}


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every ``x._name`` whose ``x`` is not self / cls / super(), and every
    ``getattr(x, "_name")`` / ``hasattr`` / ``setattr`` on such an ``x``."""
    def own(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and not own(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value) and not own(node.args[0])):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("resumable_stream")):
            found += [(node.lineno, a.name) for a in node.names if private(a.name)]
    return found


def test_no_module_reads_another_modules_private_attributes():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for line, attr in _private_reads(ast.parse(path.read_text(), str(path))):
            if (module, attr) not in THIRD_PARTY_PRIVATES:
                offenders.append(f"resumable_stream/{module}:{line}: {attr}")
    assert not offenders, "private attributes read across modules:\n" + "\n".join(offenders)


def test_the_private_read_check_catches_each_form():
    code = ("import x\nfrom .stream import _secret\nloader._consumed\ngetattr(trainer, '_rs_loader', None)\n"
            "self._fine\nsuper()._fine\ncls._fine\nobj.__dict__\n")
    assert sorted(a for _, a in _private_reads(ast.parse(code))) == ["_consumed", "_rs_loader", "_secret"]
