"""The learner's training data: an endless ``IterableDataset`` of rollout batches over the stream.

Each item is this rank's share of the next global batch (``stream.LocalBatch``), pulled by
``stream.RolloutStream.next`` for the run's current step and policy version at the moment the
training step asks for it. That moment matters: the module takes the iterator itself
(``training_step(self, dataloader_iter)``), so Lightning fetches nothing ahead; a prefetched batch
would be pulled before the previous step published its weights, i.e. with the wrong version for
staleness, and with ``algo.eta = 0`` it would wait for rollouts that the controller only admits
once that step is done (a deadlock).

Every rank iterates (the stream's scatter is a collective); only rank 0 holds a ``source``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from vapo_async.learner.state import RunState
from vapo_async.learner.stream import (
    GroupSource,
    LocalBatch,
    RolloutStream,
    StopRequested,
    StreamConfig,
)
from vapo_async.transport.messages import WeightAnnouncement


class RolloutBatches(IterableDataset[LocalBatch]):
    """Endless rollout batches of one rank (see the module docstring)."""

    def __init__(self, state: RunState, source: GroupSource | None = None) -> None:
        self.state = state
        self.source = source
        """Rank 0: where groups come from (the controller, given by the ``Runtime`` in its
        ``setup``; a ``ListSource`` offline and in tests)."""
        self.health: Callable[[], None] | None = None
        """Rank 0: raises while waiting for rollouts when none can come (the ``Runtime``'s check
        that local generators are alive)."""
        self.stream: RolloutStream | None = None
        self.stopped = False
        """The stream raised ``StopRequested``: the iteration ended (a stop, not an error)."""

    def open(self, cfg: StreamConfig, rank: int, world: int, device: torch.device) -> None:
        """Build the stream (the module's ``setup``, once the rank and the world are known)."""
        self.stream = RolloutStream(cfg, self.source if rank == 0 else None, rank, world, device, self.health,
                                    stop=lambda: self.state.stop_signal is not None)

    def __iter__(self) -> Iterator[LocalBatch]:
        """Batches until a stop is requested (``RunState.stop_signal``); then the iteration ends
        on every rank at the same batch, which ends Lightning's fit loop (``LearnerModule.training_step``)."""
        while True:
            try:
                batch = self._stream().next(self.state.step, self.state.version)
            except StopRequested:
                self.stopped = True
                return
            yield batch

    def finish(self, needs_version: int | None) -> None:
        """After the step: report the trained groups now and the step once ``needs_version`` (the
        version it made; None: none) is announced (``RolloutStream.finish``)."""
        self._stream().finish(needs_version)

    def published(self, ann: WeightAnnouncement) -> None:
        """A version is complete on disk (called from the weight writer's thread)."""
        self._stream().published(ann)

    def loader(self) -> DataLoader[LocalBatch]:
        """The DataLoader Lightning iterates: one ``LocalBatch`` per item, in this process."""
        return DataLoader(self, batch_size=None, collate_fn=_as_is, num_workers=0)

    def _stream(self) -> RolloutStream:
        if self.stream is None:
            raise RuntimeError("RolloutBatches: the stream is not open (LearnerModule.setup opens it)")
        return self.stream


def _as_is(batch: Any) -> Any:
    """No collation: the stream already built the batch (on the rank's device)."""
    return batch
