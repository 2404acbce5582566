"""An admitted prompt ("item") and the states it moves through, with every transition checked.

An item is one admission slot (id = admission counter k, ``admission.py``) carrying a dataset
prompt index. Its life::

    pending --lease--> leased --group arrives--> buffered --next_batch--> consumed --> trained
       ^  |              |                                                       \\-> dropped
       |  +--------------|-- a late group of an earlier lease --> buffered
       +-- deadline / bye / new session / refused group (re-issue, same item id and slot)

``trained`` and ``dropped`` are final. Any other move raises ``IllegalTransition`` naming the
item and both states, so a bookkeeping slip fails loudly instead of training a prompt twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class ItemState(StrEnum):
    """Where an admitted prompt is; the values are the metric names (``controller/<state>``)."""

    PENDING = "pending"
    """Waiting in the queue for a lease (new, or re-issued)."""
    LEASED = "leased"
    """Held by an active lease of a generator session."""
    BUFFERED = "buffered"
    """Its group arrived; waiting for the learner's ``next_batch``."""
    CONSUMED = "consumed"
    """Handed to the learner, not yet marked trained or dropped."""
    TRAINED = "trained"
    """The learner trained on it (final)."""
    DROPPED = "dropped"
    """The learner consumed it without training (dynamic sampling; final)."""


LIVE_STATES = (ItemState.PENDING, ItemState.LEASED, ItemState.BUFFERED, ItemState.CONSUMED)
"""States of an item still in flight (in the metrics and the accounting, in this order)."""

TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    ItemState.PENDING: frozenset({ItemState.LEASED, ItemState.BUFFERED}),
    ItemState.LEASED: frozenset({ItemState.PENDING, ItemState.BUFFERED}),
    ItemState.BUFFERED: frozenset({ItemState.CONSUMED}),
    ItemState.CONSUMED: frozenset({ItemState.TRAINED, ItemState.DROPPED}),
    ItemState.TRAINED: frozenset(),
    ItemState.DROPPED: frozenset(),
}
"""Legal moves. pending -> buffered: a group of a deactivated lease arrives after its item was
re-queued (the generator was slow, not dead); the copy sampled by the next lease is a duplicate."""


class IllegalTransition(RuntimeError):
    """An item was asked to move along an edge ``TRANSITIONS`` does not have."""

    def __init__(self, item_id: int, current: ItemState | str, target: ItemState, hint: str = "") -> None:
        super().__init__(f"item {item_id}: illegal transition {current} -> {target}{hint}")
        self.item_id = item_id
        self.current = current
        self.target = target


@dataclass
class Item:
    """One admitted prompt in flight."""

    item_id: int
    """Admission slot k (also the order in which items were admitted)."""
    prompt_index: int
    """Dataset index of its prompt."""
    state: ItemState = ItemState.PENDING
    lease_id: int | None = None
    """The lease it is ``leased`` under (None in every other state)."""
    refs: set[int] = field(default_factory=set)
    """Leases (active or deactivated) that still expect its group; a group under any of them is
    accepted once, the others then see a duplicate."""

    def move(self, target: ItemState, lease_id: int | None = None) -> None:
        """Go to ``target`` (``lease_id`` when it is ``leased``); raises ``IllegalTransition``."""
        if target not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.item_id, self.state, target)
        if (target is ItemState.LEASED) != (lease_id is not None):
            raise ValueError(f"item {self.item_id}: a lease id goes with leased and only with it, "
                             f"got {target} with lease {lease_id}")
        self.state = target
        self.lease_id = lease_id
