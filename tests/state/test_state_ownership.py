"""Each layer owns its state (docs/architecture.md): the state layer gathers values and writes no field of the
stream's part (the stream's ``gathered_part`` makes it, handed in as a value), it leaves the states it is given as
they were, and the loader changes no stream state object itself (``MixtureStream.set_weights`` gives it back the
snapshots it holds, with the change). Real streams over ``tests/data/small_mixture``."""

from __future__ import annotations

import ast
import itertools
import pathlib

import numpy as np
import pytest
from repo_paths import REPO_ROOT
from small_mixture import NUM_PARTITIONS, copy_data, loader, mixture_config, stream_config

from resumable_stream import MixtureStream, ResumableStream
from resumable_stream.state import checkpoint
from resumable_stream.state.job_state import gather_job_state
from resumable_stream.stream.base import gathered_part

PACKAGE = pathlib.Path(REPO_ROOT) / "resumable_stream"
EVERY = set(range(NUM_PARTITIONS))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return copy_data(str(tmp_path_factory.mktemp("ownership")))


def _plain(value):
    """A nested state as comparable plain values (arrays by dtype, shape and bytes): to see that nothing changed."""
    if isinstance(value, dict):
        return tuple(sorted(((str(k), _plain(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    return value


class StreamPartSpy:
    """Stands for the stream layer's ``gathered_part``: records what it is given and returns its own object, so a
    test sees whether the state layer returns that part as it is (writing no field into it)."""

    def __init__(self):
        self.calls: list[tuple[dict, dict]] = []
        self.made = {"made by": "the stream layer"}

    def __call__(self, part, partitions):
        self.calls.append((part, partitions))
        return self.made


def _two_ranks(data, make, batches=(3, 5)):
    """Loaders of rank 0 and 1 of 2 (one process, no process group), each after some batches."""
    loaders = [loader(make(data), rank, 2) for rank in range(2)]
    for each, n in zip(loaders, batches):
        list(itertools.islice(iter(each), n))
    return loaders


@pytest.mark.parametrize("make", [stream_config, mixture_config], ids=["stream", "mixture"])
def test_merge_takes_the_streams_part_from_the_stream_and_leaves_the_ranks_states_as_they_were(data, make):
    states = [each.rank_state() for each in _two_ranks(data, make)]
    before = _plain(states)
    spy = StreamPartSpy()
    out = checkpoint.merge(states, EVERY, "the job's state", spy, every=True)
    assert _plain(states) == before, "merge changed a state it was given"
    assert out["stream"] is spy.made, "the stream's part of a gathered state is the stream layer's, as it made it"
    [(part, partitions)] = spy.calls
    assert part is states[0]["stream"]
    assert sorted(partitions) == sorted(EVERY)
    for rank, state in enumerate(states):     # each partition as the rank that held it saved it
        for p, ps in state["stream"]["partitions"].items():
            assert partitions[p] is ps, f"partition {p} of rank {rank}"
    assert out["loader"] == {"turns": {0: states[0]["loader"]["turns"][0], 1: states[1]["loader"]["turns"][1]},
                             "lane_turns": {0: states[0]["loader"]["lane_turns"][0],
                                            1: states[1]["loader"]["lane_turns"][1]}}
    assert set(out["transform"]) == set(states[0]["transform"]) | set(states[1]["transform"])


def test_the_job_state_of_one_rank_is_its_own_with_the_streams_part_of_a_job(data):
    one = loader(stream_config(data), 0, 1)
    list(itertools.islice(iter(one), 7))
    state = one.rank_state()
    before = _plain(state)
    spy = StreamPartSpy()
    out = gather_job_state(state, spy)
    assert _plain(state) == before, "gather_job_state changed the rank's state it was given"
    assert out["stream"] is spy.made
    assert spy.calls == [(state["stream"], state["stream"]["partitions"])]
    assert spy.calls[0][0] is state["stream"]
    assert out["transform"] is state["transform"] and out["loader"] is state["loader"]


def test_a_saved_directory_is_gathered_with_the_streams_part_made_by_the_stream(data, tmp_path):
    for each in _two_ranks(data, mixture_config):
        each.save_sidecar(str(tmp_path), manifest=False)
    checkpoint.finish(str(tmp_path), 2)
    saved = checkpoint.SavedState(str(tmp_path), 0)
    first = _plain(saved.first)
    spy = StreamPartSpy()
    state, _ = saved.gather(range(NUM_PARTITIONS), spy)
    assert state["stream"] is spy.made
    [(part, partitions)] = spy.calls
    assert part is saved.stream and part["topology"]["rank"] == 0
    assert sorted(partitions) == sorted(EVERY)
    assert _plain(saved.first) == first, "gathering changed the rank file's state it read"


def test_gathered_part_is_one_ranks_part_of_no_rank_with_the_rotation_afresh(data):
    stream = ResumableStream(stream_config(data), rank=1, world_size=2)
    list(itertools.islice(iter(stream), 3))       # rank 1 reads partitions 1 and 3 in turn: its turn is 1 now
    part = stream.state_dict()
    assert part["turn"] == 1 and part["topology"]["rank"] == 1
    before = _plain(part)
    partitions = {0: {"a partition": "state"}}
    got = gathered_part(part, partitions)
    assert _plain(part) == before, "gathered_part changed the part it was given"
    assert got["topology"] == {"rank": None, "world_size": 2, "num_workers": 0, "num_partitions": NUM_PARTITIONS}
    assert got["turn"] == 0 and got["partitions"] is partitions
    assert {k: got[k] for k in ("format_version", "kind", "fingerprint")} == \
        {k: part[k] for k in ("format_version", "kind", "fingerprint")}
    assert set(got) == set(part)


def test_set_weights_starts_where_training_is_and_gives_back_the_held_states_with_the_change(data):
    stream = MixtureStream(mixture_config(data), rank=0, world_size=1)
    it = iter(stream)
    list(itertools.islice(it, 4))
    held = {0: stream.partition_state(0)}        # as a loader holds it: partition 0 after what training consumed
    list(itertools.islice(it, 8))                 # the readers moved on (prefetched, not consumed)
    held_before = (held[0].consumed, list(held[0].changes))
    assert stream.partition_state(0).consumed > held[0].consumed and held[0].changes == []
    now = {p: stream.partition_state(p).consumed for p in stream.partitions}
    given = stream.set_weights({"a": 0.2, "b": 0.8}, consumed=held)
    assert (held[0].consumed, list(held[0].changes)) == held_before, "set_weights changed a state it was given"
    assert set(given) == {0} and given[0].changes == [held[0].consumed]
    assert given[0].consumed == held[0].consumed and given[0].sources == held[0].sources
    # the stream's own: partition 0 changes where training is; the others where their readers are
    changes = {p: ps["mixture"]["changes"] for p, ps in stream.state_dict()["partitions"].items()}
    assert changes == {p: [held[0].consumed] if p == 0 else [now[p]] for p in stream.partitions}


# ------------------------------------------------------------------ no layer writes the stream's fields
# the stream envelope's keys whose value means something about a rank or its partitions
STREAM_FIELDS = {"turn", "rank", "topology", "partitions"}
# state/sidecar.py is the envelope's codec: it decodes a file's bytes into the stream's part (and back)
CHECKED = sorted(p for p in (PACKAGE / "state").glob("*.py") if p.name != "sidecar.py") + [PACKAGE / "loader.py"]


def _const(node) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _subscripts_stream(node) -> bool:
    """``x["stream"]...``: the expression reads into the stream's part of a nested state."""
    return any(isinstance(n, ast.Subscript) and _const(n.slice) == "stream" for n in ast.walk(node))


def _stream_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each place that makes or changes a stream field: a dict display with a stream field's key or
    spreading a stream part (``{**state["stream"], ...}``), an assignment into a stream field or a stream part, and a
    ``dataclasses.replace`` (a partition state remade)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if key is not None and _const(key) in STREAM_FIELDS:
                    found.append((node.lineno, f"dict key {_const(key)!r}"))
                elif key is None and _subscripts_stream(value):
                    found.append((node.lineno, "a copy of a stream part with fields changed"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and (_const(target.slice) in STREAM_FIELDS
                                                          or _subscripts_stream(target.value)):
                    found.append((node.lineno, f"assignment to {ast.unparse(target)}"))
        elif isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id == "replace")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dataclasses")):
            found.append((node.lineno, "dataclasses.replace"))
    return found


def test_no_layer_but_the_stream_writes_the_streams_fields():
    offenders = []
    for path in CHECKED:
        if path.name == "partition_state.py":   # the state type's own method remaking itself
            continue
        for line, what in _stream_writes(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, "a layer writes the stream's part of a state (ask the stream instead):\n" + "\n".join(offenders)


def test_the_stream_field_check_catches_each_form():
    code = ('s = {**state["stream"], "turn": 0}\n'
            'p = {"topology": {**t, "rank": None}}\n'
            'state["stream"]["turn"] = 0\n'
            'part["partitions"] = {}\n'
            'self._consumed = {p: replace(snap, changes=[]) for p, snap in held.items()}\n'
            'fine = {"turns": {}, "lane_turns": {}, "transform": carries}\n'
            'state["indexes"] = carried\n')
    got = sorted((line, what) for line, what in _stream_writes(ast.parse(code)))
    assert got == [(1, "a copy of a stream part with fields changed"), (1, "dict key 'turn'"),
                   (2, "dict key 'rank'"), (2, "dict key 'topology'"),
                   (3, "assignment to state['stream']['turn']"), (4, "assignment to part['partitions']"),
                   (5, "dataclasses.replace")]
