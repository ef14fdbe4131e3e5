"""The job's state: every rank's, in one plain value any trainer's own checkpoint keeps as it is (DCP keeps one
rank's copy, accelerate and Lightning rank 0's). Each rank's state is gathered at save time with one collective,
merged and encoded as one sidecar under :data:`STATE_KEY`; each rank loads its own partitions from it (or, under
``data.elastic``, those it reads now). A state that could not restore every rank (several ranks, no process
group) is refused when written, never discovered at resume."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, SidecarError
from ..limits import MAX_SIDECAR_BYTES
from ..runtime.collectives import all_gather_bytes, shared_over_dist
from ..sources.index import encode_message
from .checkpoint import StreamPart, merge
from .sidecar import decode_state, encode_state

STATE_KEY = "resumable_stream_state"
# A growing dataset's index travels in a state a trainer keeps (no stream_state directory saves it); past this it
# is refused when written: such a dataset's states belong in stream_state directories, which write it once
MAX_CARRIED_INDEX_BYTES = 64 << 20


def gather_job_state(rank_state: dict[str, Any], stream_part: StreamPart) -> dict[str, Any]:
    """Every rank's nested state (``rank_state``: this rank's, of ``stream.topology``'s rank and world size)
    merged into the job's: all partitions, each rank's rotation; the stream's part made by ``stream_part``
    (``stream.base.gathered_part``: of no rank)."""
    topology = rank_state["stream"]["topology"]
    rank, world = topology["rank"], topology["world_size"]
    if world == 1:      # the job's state is its one rank's, with the stream's part of a job
        return {**rank_state, "stream": stream_part(rank_state["stream"], rank_state["stream"]["partitions"])}
    if not shared_over_dist(rank, world):
        raise ConfigError(
            f"state_dict(): this loader is rank {rank} of {world}, and a state is the job's (whatever rank's copy a "
            "trainer saves restores every rank), so state_dict() gathers every rank's with torch.distributed, which "
            "is not initialized here (or has another world size). Initialize the process group before the loader "
            "(torchrun), or save each rank's state into one directory with loader.save_sidecar(dir) (rank 0 then "
            "calls resumable_stream.state.checkpoint.finish(dir, world_size))")
    states = [decode_state(data, f"rank {r}'s state") for r, data in enumerate(all_gather_bytes(encode_state(rank_state)))]
    for r, state in enumerate(states):
        if state["stream"]["topology"]["rank"] != r or state["stream"]["topology"]["world_size"] != world:
            raise ConfigError(f"state_dict(): rank {r} of the process group sent the state of rank "
                              f"{state['stream']['topology']['rank']} of {state['stream']['topology']['world_size']}: "
                              "each rank's loader must read its own rank of the job")
    every = set(range(topology["num_partitions"]))
    return merge(states, every, "the job's state", stream_part, every=True)     # with every rank's rotation


def carried_indexes(indexes: dict[str | None, dict]) -> dict[str | None, bytes]:
    """The growing sources' indexes (``Stream.growing_indexes``) as the bytes a state carries; too large ones
    refused here, when the state is written, naming the way that keeps them."""
    out = {}
    for label, index in indexes.items():
        data = encode_message(index)
        if len(data) > MAX_CARRIED_INDEX_BYTES:
            whose = "the dataset" if label is None else f"source {label!r}"
            raise ConfigError(
                f"state_dict(): data.growth: the state of a growing dataset carries its index (which files each epoch "
                f"reads), and {whose}'s is {len(data) >> 20} MiB; allowed: at most {MAX_CARRIED_INDEX_BYTES >> 20} MiB. "
                "Keep this run's states in stream_state directories (resumable_stream.Checkpoints, "
                "loader.save_sidecar, the Trainer patch), which write the index once per job")
        out[label] = data
    return out


def encode_state_dict(job_state: dict[str, Any]) -> dict[str, bytes]:
    """``{STATE_KEY: bytes}``: what ``state_dict()`` returns."""
    return {STATE_KEY: encode_state(job_state)}


def decode_state_dict(state: Any, where: str) -> dict[str, Any]:
    """The nested state of a ``state_dict()`` (``{STATE_KEY: bytes}``), or a nested state as it is."""
    if isinstance(state, dict) and STATE_KEY in state:
        data = state[STATE_KEY]
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_SIDECAR_BYTES:
            raise SidecarError(f"{where}: {STATE_KEY}: got {type(data).__name__}; allowed: the bytes a "
                               f"StreamLoader.state_dict() made (at most {MAX_SIDECAR_BYTES} bytes)")
        return decode_state(bytes(data), where)
    if isinstance(state, dict) and isinstance(state.get("stream"), dict):
        return state
    shown = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
    raise SidecarError(f"{where}: got {shown!r:.80}; allowed: what StreamLoader.state_dict() returns "
                       f"({{{STATE_KEY!r}: bytes}}) or a nested state (rank_state(), read_sidecar())")
