"""Telling the controller a step is done, once the weights that step made are announced.

Weights are written in the background (``learner/publish.py``), so a step that changed the actor
ends before its version exists on disk. The controller must not hear ``step_done`` before then:
the admission slots a step opens are leased with the latest announced version, and tokens sampled
with an older one would be staler than eta when trained (and dropped). ``StepReports`` queues the
reports in step order and releases them when an announcement of at least the version they need
arrives; a step that made no version (value pretraining, a skipped batch) waits only for the steps
before it. When a version is skipped (latest wins: a newer snapshot replaced it before it was
written), the next announcement releases the steps of both.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

from vapo_async.transport.messages import WeightAnnouncement


class StepSink(Protocol):
    """The part of the ``Controller`` this module uses."""

    def step_done(self, ann: WeightAnnouncement | None = None, trained: int | None = None) -> None: ...

    def announce(self, ann: WeightAnnouncement) -> None: ...


class StepReports:
    """Step reports in order, each released once the version it needs is announced (thread-safe:
    the training thread adds, the weight writer's thread announces)."""

    def __init__(self, sink: StepSink, announced: int) -> None:
        self.sink = sink
        self.announced = announced
        """Newest version announced to the controller."""
        self._queue: deque[tuple[int | None, int]] = deque()
        self._lock = threading.Lock()

    def add(self, needs_version: int | None, trained: int) -> None:
        """A step that trained ``trained`` groups finished; it made ``needs_version`` (None: no new
        weights). Reported now if nothing it waits for is missing."""
        with self._lock:
            self._queue.append((needs_version, trained))
            self._release(None)

    def published(self, ann: WeightAnnouncement) -> None:
        """Version ``ann.version`` is complete on disk: announce it with the first report it releases."""
        with self._lock:
            if ann.version <= self.announced:
                raise ValueError(f"version {ann.version} published after version {self.announced}")
            self.announced = ann.version
            self._release(ann)

    def waiting(self) -> int:
        """Reports not yet given to the controller."""
        with self._lock:
            return len(self._queue)

    def _release(self, ann: WeightAnnouncement | None) -> None:
        while self._queue and (self._queue[0][0] is None or self._queue[0][0] <= self.announced):
            _, trained = self._queue.popleft()
            self.sink.step_done(ann, trained)
            ann = None
        if ann is not None:  # written before its step reported (a fast writer): announced now,
            self.sink.announce(ann)  # and the step is released the moment it is added
