"""``data.growth: follow``: a stream read round by round, waiting for new files between rounds (docs/growing-data.md).

A ``Follower`` wraps a ``ResumableStream`` through its public seams (``round``, its layout, index and
``adopt_index``). One poll loop (``_wait``): one rank waits alone; several wait in step, their decisions
all-reduced so that they all end at the same step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..dataset.growth import recheck, refresh
from ..errors import ConfigError
from ..runtime.collectives import max_each_over_ranks, max_over_ranks, shared_over_dist
from .base import round_robin

log = logging.getLogger(__name__)


class Follower:
    """The waits of follow mode over one ``ResumableStream`` (see the module docstring)."""

    def __init__(self, stream: Any):
        self.stream = stream     # a ResumableStream (not imported: it imports this module)
        self.ended = False       # the last iteration ended after data.follow_timeout_s: the trainer saves and stops

    def samples(self, read_round: Callable[[], Iterator[dict]]) -> Iterator[dict]:
        """The stream iterated directly: ``read_round()`` (the rank's partitions interleaved as without follow, to
        the end of the round, the rotation saved) round after round, then a wait for the next round's files."""
        self.ended = False
        while True:
            yield from read_round()
            if not self.await_next_round():
                return

    def rounds(self, lane: list[int], turn: int, batches: Callable[[int], Iterator[dict[str, Any]]]
               ) -> Iterator[dict[str, Any]]:
        """A loader's lane: its partitions' ``batches(p)`` in turn through the round; once all ended it, the wait for
        the next. The rotation goes on from the partition after the last batch, as a resume's does. Over several
        ranks a batch is handed out once every rank has one (an all-reduce per batch keeps the steps in lock-step),
        all enter :meth:`wait_in_step` together and a rank still holding a batch hands it out after the wait."""
        in_step = self.stream.world_size > 1
        if in_step:
            self.check_in_step()

        def round_of(turn: int) -> Iterator[dict[str, Any]]:
            return iter(round_robin({p: batches(p) for p in lane}, lane, turn))

        it, held = round_of(turn), None
        while True:
            item = held if held is not None else next(it, None)
            held = None
            if not (max_over_ranks(int(item is None)) if in_step else item is None):   # every rank has a batch
                turn = (lane.index(item["partition"]) + 1) % len(lane)
                yield item
                continue
            held = item
            if not (self.wait_in_step(holding=item is not None) if in_step else self.await_next_round()):
                return
            if item is None:
                it = round_of(turn)

    def check_in_step(self) -> None:
        """Follow mode over several ranks needs their process group (the waits are collectives)."""
        stream = self.stream
        if not shared_over_dist(stream.rank, stream.world_size):
            raise ConfigError(f"data.growth: got 'follow' on rank {stream.rank} of {stream.world_size} without an "
                              "initialized torch.distributed group; allowed: under torchrun with the group set up")

    def await_next_round(self) -> bool:
        """One rank, once every partition ended the round: wait for the next one's files (True), or False (and
        ``ended``) after data.follow_timeout_s."""
        return self._wait(holding=False, in_step=False)

    def wait_in_step(self, holding: bool) -> bool:
        """Several ranks: the wait as a collective at the same step on every rank, rank 0 listing the files (the grown
        index broadcast). True once every rank can go on; False everywhere once rank 0 waited data.follow_timeout_s."""
        self.check_in_step()
        return self._wait(holding, in_step=True)

    def _wait(self, holding: bool, in_step: bool) -> bool:
        """Until the round's files are planned (an epoch without a generation is empty and passes) or this rank holds
        a batch, on every rank when ``in_step``: list the files every poll_interval_s (backing off to 16x), reading
        through a grown index; after data.follow_timeout_s (and one listing at least) False and ``ended``."""
        stream, c = self.stream, self.stream.config
        delay, start, polled = float(c.poll_interval_s), time.monotonic(), False
        self.ended = False
        while True:
            waited = time.monotonic() - start
            ready = holding or self._planned(stream.round())
            timed_out = stream.rank == 0 and polled and waited >= c.follow_timeout_s
            not_ready, ended = (max_each_over_ranks([int(not ready), int(timed_out)]) if in_step
                                else (not ready, timed_out))
            if not not_ready:
                return True
            if ended:
                log.warning("data.growth: follow: no new files for %.1f s (data.follow_timeout_s: %s); the stream "
                            "ends at epoch %d (rank %d)", waited, c.follow_timeout_s, stream.round(), stream.rank)
                self.ended = True
                return False
            known, index, polled = len(stream.source.index["files"]), self._grown(in_step), True
            if index is not None:
                first = stream.adopt_index(index)
                log.info("data.growth: follow: %d new file(s) after %.1f s of waiting; epoch %d reads them",
                         len(index["files"]) - known, waited, first)
                continue
            time.sleep(max(0.0, min(delay, c.follow_timeout_s - (time.monotonic() - start))))
            delay = min(delay * 2, 16 * float(c.poll_interval_s))

    def _grown(self, in_step: bool) -> dict | None:
        """The index grown since the stream's (None: no new file). In step: rank 0's, broadcast (a collective), new
        files joining after the furthest epoch of the job; one rank: they join at its round."""
        stream = self.stream
        if in_step:
            return refresh(stream.spec, stream.source.index, stream.furthest_epoch(), stream.rank, stream.world_size, 0)
        index = recheck(stream.spec, stream.source.index, stream.round(), "while following the data", running=True)
        return index if len(index["files"]) != len(stream.source.index["files"]) else None

    def _planned(self, epoch: int) -> bool:
        """Epoch ``epoch`` has its files: a generation starts at or after it (an epoch before it is empty)."""
        return any(first >= epoch for first, _ in self.stream.layout.generations or ())
