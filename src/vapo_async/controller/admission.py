"""Admission control: the staleness bound eta (PAPER.md, "Off-policy tolerance", AReaL).

AReaL admits a new generation request only while floor((N_r - 1) / B) <= i + eta. Here, with
admission slots numbered k = 0, 1, ... in admission order, slot k is consumed by optimizer step
floor(k / B), so it is admitted only while

    floor(k / B) <= steps_done + eta    <=>    k < (steps_done + eta + 1) * B,

and ``capacity() = (steps_done + eta + 1) * B - shortfall - k_next`` slots may be admitted now
(``shortfall`` = 0 while every step trains B groups). eta = 0 is synchronous: the B groups of step
s are admitted only after step s - 1 is done.

Departures (documented): (1) the counter is optimizer steps done (``step_done``), not the published
policy version, so value-pretraining steps that publish nothing still advance admission; (2) a
group that the learner consumes but does not train on (dynamic sampling drops it) releases its slot
(``release``), otherwise filtered groups would starve admission; (3) a re-issued prompt keeps the
slot it was admitted with (it is not admitted twice); (4) a short step, one that trains K < B
groups (dynamic sampling gave up after ``max_sampling_rounds``), consumed only K slots, so it opens
only K: its B - K are added to ``shortfall``. Without this the slots of later steps shift and the
buffer outgrows (eta + 1) * B (a DAPO run stopped with "admission is broken").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Admission:
    """Slot counters for the eta rule above."""

    batch_groups: int
    """B: groups consumed per optimizer step."""
    eta: int
    """Staleness bound (0 = synchronous)."""
    admitted: int = 0
    """Slots handed out so far (also the next item id)."""
    released: int = 0
    """Slots given back by consumed-but-dropped groups."""
    steps_done: int = 0
    """Optimizer steps the learner finished."""
    shortfall: int = 0
    """Slots short steps did not consume (sum of B - K over steps that trained K < B groups)."""

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.eta < 0:
            raise ValueError(f"need batch_groups >= 1 and eta >= 0, got {self.batch_groups}, {self.eta}")

    def next_slot(self) -> int:
        """k of the next admission (admitted slots not released)."""
        return self.admitted - self.released

    def capacity(self) -> int:
        """Slots admissible now: (steps_done + eta + 1) * B - shortfall - k_next, at least 0."""
        return max(0, (self.steps_done + self.eta + 1) * self.batch_groups - self.shortfall - self.next_slot())

    def admit(self) -> int:
        """Take one slot; returns its item id. Raises if the bound would be exceeded."""
        if self.capacity() <= 0:
            raise RuntimeError(f"admission beyond eta={self.eta}: k={self.next_slot()}, steps_done={self.steps_done}")
        self.admitted += 1
        return self.admitted - 1

    def step_done(self, trained: int) -> None:
        """A step finished that trained ``trained`` groups (<= B): B more slots, minus what it fell short."""
        if not 0 <= trained <= self.batch_groups:
            raise ValueError(f"a step trained {trained} groups, outside [0, B={self.batch_groups}]")
        self.steps_done += 1
        self.shortfall += self.batch_groups - trained

    def release(self, n: int) -> None:
        """Give back ``n`` slots of groups that were consumed but not trained on."""
        self.released += n

    def max_batch(self) -> int:
        """Largest batch the learner can ever wait for: (eta + 1) * B."""
        return (self.eta + 1) * self.batch_groups

    def state_dict(self) -> dict[str, int]:
        """Counters (batch_groups/eta included for a consistency check on load)."""
        return asdict(self)

    def load_state_dict(self, d: dict[str, int]) -> None:
        """Restore counters; B and eta come from the current config (they may change on resume)."""
        self.admitted = int(d["admitted"])
        self.released = int(d["released"])
        self.steps_done = int(d["steps_done"])
        self.shortfall = int(d.get("shortfall", 0))  # absent in checkpoints made before it existed
