"""The lease ledger: every admitted item (``items.py``) from admission to trained, exactly once.

A lease is a set of items for one generator session (``owner``), with a deadline that heartbeats
push back (up to a hard deadline). When a lease is deactivated its unreceived items go back to the
front of the pending queue, but the lease record stays while any of its items is unreceived, so a
late group from a generator that was only slow is still accepted (and the copy sampled by the new
lease is then a duplicate, dropped). A group for an item already received is a duplicate; one
for an unknown lease, another owner's lease or a prompt not in the lease is rejected.

Items that are done (trained or dropped) leave ``items`` and are folded into ``done_watermark``
(every id below it is done) plus the sparse set ``done_above``, so memory stays bounded by the
items in flight; the final state of the most recent ones is remembered for error messages.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from vapo_async.controller.items import LIVE_STATES, IllegalTransition, Item, ItemState

PENDING, LEASED, BUFFERED, CONSUMED = LIVE_STATES
LEASE_ID_STRIDE = 2**32
"""Lease ids jump by this on restore, so ids issued after the checkpoint are never reused."""
_MEMORY = 100_000
"""Closed lease ids and final states of done items remembered (duplicates, error messages)."""


@dataclass
class LeaseRecord:
    """One lease: ``items`` maps prompt index -> item id; ``open`` = prompt indices not received."""

    lease_id: int
    owner: bytes
    items: dict[int, int]
    open: set[int]
    min_version: int
    deadline: float
    hard_deadline: float
    active: bool = True


class Ledger:
    """Items, leases and exactly-once counters (see module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self.items: dict[int, Item] = {}
        self.pending: deque[int] = deque()
        self.leases: dict[int, LeaseRecord] = {}
        self.by_owner: dict[bytes, set[int]] = {}
        self.closed: OrderedDict[int, None] = OrderedDict()
        self.next_lease_id = 1
        self.done_watermark = 0
        self.done_above: set[int] = set()
        self.recently_done: OrderedDict[int, ItemState] = OrderedDict()
        self.counts: Counter[str] = Counter()

    # ---- admission and leasing ----

    def add(self, item: int, prompt_index: int, queue: bool = True) -> None:
        """A newly admitted item joins the back of the pending queue (``queue=False``: the caller
        leases it right away with ``open_lease``)."""
        if item in self.items or self.is_done(item):
            raise RuntimeError(f"item {item} admitted twice")
        self.items[item] = Item(item, prompt_index)
        if queue:
            self.pending.append(item)
        self.counts["issued"] += 1

    def prompt_of(self, item: int) -> int:
        """Dataset prompt index of the live ``item``."""
        return self.items[item].prompt_index

    def state_of(self, item: int) -> ItemState | None:
        """State of ``item``: live, or the final state of a recently done one; None when unknown."""
        live = self.items.get(item)
        return live.state if live is not None else self.recently_done.get(item)

    def take_pending(self, n: int, exclude_prompts: set[int]) -> list[int]:
        """Up to ``n`` pending items (front first) whose prompts are not in ``exclude_prompts``."""
        taken: list[int] = []
        skipped: list[int] = []
        prompts = set(exclude_prompts)
        while self.pending and len(taken) < n:
            item = self.pending.popleft()
            (skipped if self.prompt_of(item) in prompts else taken).append(item)
            prompts.add(self.prompt_of(item))
        self.pending.extendleft(reversed(skipped))
        return taken

    def open_lease(self, owner: bytes, items: list[int], now: float, timeout_s: float, max_s: float,
                   min_version: int) -> LeaseRecord:
        """Lease pending ``items`` (distinct prompts, out of the queue) to ``owner``."""
        by_prompt = {self.prompt_of(i): i for i in items}
        if len(by_prompt) != len(items):
            raise RuntimeError("a lease must not hold the same prompt twice")
        lease = LeaseRecord(self.next_lease_id, owner, by_prompt, set(by_prompt), min_version,
                            now + timeout_s, now + max_s)
        self.next_lease_id += 1
        for i in items:
            self.items[i].move(LEASED, lease.lease_id)
            self.items[i].refs.add(lease.lease_id)
        self.leases[lease.lease_id] = lease
        self.by_owner.setdefault(owner, set()).add(lease.lease_id)
        self.counts["leases"] += 1
        return lease

    # ---- receipt ----

    def lookup(self, lease_id: int, prompt_index: int, owner: bytes) -> tuple[str, LeaseRecord | None]:
        """Status of a group for (lease, prompt) from ``owner``: ok, duplicate, unknown_lease,
        wrong_owner or not_in_lease."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return ("duplicate" if lease_id in self.closed else "unknown_lease"), None
        if lease.owner != owner:
            return "wrong_owner", None
        if prompt_index not in lease.items:
            return "not_in_lease", None
        if prompt_index not in lease.open:
            return "duplicate", None
        return "ok", lease

    def accept(self, lease: LeaseRecord, prompt_index: int) -> int:
        """Record the group for ``prompt_index`` of ``lease`` (status ok); returns its item id."""
        item = self.items[lease.items[prompt_index]]
        if item.state is PENDING:
            self.pending.remove(item.item_id)
        item.move(BUFFERED)
        self.counts["received"] += 1
        for lease_id in item.refs:
            other = self.leases[lease_id]
            other.open.discard(item.prompt_index)
            if not other.open:
                self._close(lease_id)
        item.refs.clear()
        return item.item_id

    def refuse(self, lease: LeaseRecord, prompt_index: int) -> None:
        """The lease owner sent an unusable group for ``prompt_index``: re-issue the item now."""
        item = self.items[lease.items[prompt_index]]
        lease.open.discard(prompt_index)
        item.refs.discard(lease.lease_id)
        if item.lease_id == lease.lease_id:
            self._requeue(item)
        if not lease.open:
            self._close(lease.lease_id)

    def _close(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        self.by_owner.get(lease.owner, set()).discard(lease_id)
        self.closed[lease_id] = None
        while len(self.closed) > _MEMORY:
            self.closed.popitem(last=False)

    def _requeue(self, item: Item) -> None:
        item.move(PENDING)
        self.pending.appendleft(item.item_id)
        self.counts["reissued"] += 1

    # ---- liveness ----

    def heartbeat(self, owner: bytes, now: float, timeout_s: float) -> None:
        """Push back the deadlines of ``owner``'s active leases (never past their hard deadline)."""
        for lease_id in self.by_owner.get(owner, ()):
            lease = self.leases[lease_id]
            lease.deadline = min(now + timeout_s, lease.hard_deadline)

    def due(self, now: float) -> list[LeaseRecord]:
        """Active leases past their deadline (or hard deadline) at ``now``."""
        return [lease for lease in self.leases.values()
                if lease.active and (lease.deadline < now or lease.hard_deadline < now)]

    def expire(self, now: float) -> int:
        """Deactivate leases past their deadline; returns how many."""
        due = self.due(now)
        for lease in due:
            self.deactivate(lease.lease_id)
        self.counts["leases_expired"] += len(due)
        return len(due)

    def release_owner(self, owner: bytes, lease_ids: list[int] | None = None) -> int:
        """Deactivate ``owner``'s leases (all, or those in ``lease_ids``); returns how many."""
        mine = self.by_owner.get(owner, set())
        chosen = list(mine) if lease_ids is None else [i for i in lease_ids if i in mine]
        for lease_id in chosen:
            self.deactivate(lease_id)
        self.counts["leases_released"] += len(chosen)
        if lease_ids is None:
            self.by_owner.pop(owner, None)
        return len(chosen)

    def deactivate(self, lease_id: int) -> None:
        """Send the lease's unreceived items back to the front of the queue (re-issue)."""
        lease = self.leases[lease_id]
        lease.active = False
        self.by_owner.get(lease.owner, set()).discard(lease_id)
        for prompt_index in sorted(lease.open, reverse=True):
            item = self.items[lease.items[prompt_index]]
            if item.lease_id == lease_id:
                self._requeue(item)

    # ---- learner side ----

    def consume(self, item: int) -> None:
        """The learner took the group of ``item`` (buffered -> consumed)."""
        self._live(item, CONSUMED).move(CONSUMED)

    def finish(self, item: int, trained: bool) -> None:
        """The learner trained on (or dropped) the consumed ``item``: it is done, exactly once."""
        target = ItemState.TRAINED if trained else ItemState.DROPPED
        self._live(item, target).move(target)
        del self.items[item]
        self.counts[target.value] += 1
        self.recently_done[item] = target
        while len(self.recently_done) > _MEMORY:
            self.recently_done.popitem(last=False)
        if item == self.done_watermark:
            self.done_watermark += 1
            while self.done_watermark in self.done_above:
                self.done_above.remove(self.done_watermark)
                self.done_watermark += 1
        else:
            self.done_above.add(item)

    def _live(self, item: int, target: ItemState) -> Item:
        """The live record of ``item``, or ``IllegalTransition`` from its final (or unknown) state."""
        live = self.items.get(item)
        if live is not None:
            return live
        if self.is_done(item):
            raise IllegalTransition(item, self.recently_done.get(item, "done"), target,
                                    " (done already: trained twice?)")
        raise IllegalTransition(item, "unknown", target, " (never admitted)")

    def is_done(self, item: int) -> bool:
        """True when ``item`` was trained or dropped."""
        return item < self.done_watermark or item in self.done_above

    # ---- inspection and persistence ----

    def state_counts(self) -> Counter[str]:
        """Number of live items per state."""
        return Counter(item.state.value for item in self.items.values())

    def check(self, admitted: int) -> None:
        """Raise ``AssertionError`` unless every admitted item is in exactly one place."""
        counts = self.state_counts()
        done = self.done_watermark + len(self.done_above)
        assert done + len(self.items) == admitted, f"{done} done + {len(self.items)} live != {admitted} admitted"
        assert not set(self.items) & self.done_above and all(i >= self.done_watermark for i in self.items)
        assert counts[PENDING] == len(self.pending) == len(set(self.pending)), "pending queue out of sync"
        assert all(self.items[i].state is PENDING for i in self.pending), "a non-pending item is queued"
        assert done == self.counts["trained"] + self.counts["dropped"]
        for item in self.items.values():
            if item.state is LEASED:
                lease = self.leases.get(item.lease_id) if item.lease_id is not None else None
                assert lease is not None and lease.active, f"item {item.item_id} leased without an active lease"

    def state_dict(self) -> dict[str, Any]:
        """msgpack/JSON-safe state; leased, buffered and consumed items are saved as in flight."""
        inflight = [[i, it.prompt_index] for i, it in sorted(self.items.items()) if it.state is not PENDING]
        return {
            "pending": [[i, self.prompt_of(i)] for i in self.pending],
            "inflight": inflight,
            "done_watermark": self.done_watermark,
            "done_above": sorted(self.done_above),
            "next_lease_id": self.next_lease_id,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore into an empty ledger; in-flight items of the saved run go first in the queue
        (re-issued)."""
        if self.items or self.leases or self.done_watermark or self.done_above:
            raise RuntimeError("load_state_dict needs a fresh Ledger")
        self.done_watermark = int(d["done_watermark"])
        self.done_above = {int(i) for i in d["done_above"]}
        self.next_lease_id = int(d["next_lease_id"]) + LEASE_ID_STRIDE
        self.counts = Counter({str(k): int(v) for k, v in d["counts"].items()})
        for item, prompt_index in list(d["inflight"]) + list(d["pending"]):
            self.items[int(item)] = Item(int(item), int(prompt_index))
            self.pending.append(int(item))
        self.counts["reissued"] += len(d["inflight"])
