"""Generator sessions and the fair split of scarce work among them.

A session is one connected generator process, keyed by its ROUTER routing id; a ``hello`` with a
fresh session id (a restarted generator) replaces the old session, whose leases are re-issued.
The ledger is handed in explicitly wherever a session's leases change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from vapo_async.controller.leases import Ledger

log = logging.getLogger("vapo_async.controller")


@dataclass
class Session:
    """One connected generator process (a ``hello`` with a fresh session id starts a new one)."""

    generator_id: str
    session: str
    ident: bytes
    max_prompts: int
    wanted: int = 0
    """Prompts the generator asked for and has not been granted yet (its credit)."""
    version: int = 0
    last_seen: float = 0.0
    suspended: bool = False
    """Set when one of its leases expired: no new leases until it sends a request or a group
    (heartbeats alone do not lift it, so a wedged sampler with a live heartbeat stops getting work)."""
    refused_version: int | None = None
    """Weight version it reported refusing (``weights_refused``), until it asks for credit again."""
    last_served: int = 0
    """Stamp of its latest lease (0 = never served); the least recently served get the remainder
    when scarce admission capacity is split (``fair_plan``)."""


class Sessions:
    """Sessions by routing id, with the index generator id -> routing id."""

    def __init__(self) -> None:
        self.by_ident: dict[bytes, Session] = {}
        self.by_generator: dict[str, bytes] = {}
        self.served = 0
        """Leases made so far: stamps ``Session.last_served``."""

    def __len__(self) -> int:
        return len(self.by_ident)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self.by_ident.values()))

    def get(self, ident: bytes) -> Session | None:
        """The session of routing id ``ident``, if any."""
        return self.by_ident.get(ident)

    def join(self, ident: bytes, generator_id: str, session: str, max_prompts: int,
             ledger: Ledger) -> tuple[Session, bool]:
        """The session for a ``hello``: the existing one, or a new one replacing any older session
        of the same generator (or an older session on this routing id), whose leases are re-issued.
        Returns (session, whether it is new)."""
        old = self.by_generator.get(generator_id)
        if old is not None and old != ident:
            n = self.forget(old, ledger)
            log.info("generator %s reconnected with a new session: %d leases re-issued", generator_id, n)
        s = self.by_ident.get(ident)
        if s is not None and s.session == session:
            return s, False
        if s is not None:
            self.forget(ident, ledger)
        s = Session(generator_id, session, ident, max_prompts)
        self.by_ident[ident] = s
        self.by_generator[generator_id] = ident
        return s, True

    def forget(self, ident: bytes, ledger: Ledger) -> int:
        """Drop a session; its leases are re-issued. Returns how many leases."""
        n = ledger.release_owner(ident)
        s = self.by_ident.pop(ident, None)
        if s is not None and self.by_generator.get(s.generator_id) == ident:
            del self.by_generator[s.generator_id]
        return n

    def drop_idle(self, now: float, timeout_s: float, ledger: Ledger) -> int:
        """Forget sessions silent for longer than ``timeout_s`` that hold no lease; returns how many."""
        idle = [ident for ident, s in self.by_ident.items()
                if now - s.last_seen > timeout_s and not ledger.by_owner.get(ident)]
        for ident in idle:
            self.forget(ident, ledger)
        return len(idle)

    def stamp(self, s: Session) -> None:
        """``s`` was just served a lease."""
        self.served += 1
        s.last_served = self.served

    def fair_plan(self, supply: int) -> list[tuple[Session, int]]:
        """Split ``supply`` prompts evenly among the sessions that want work (not suspended); the
        remainder goes one each to the least recently served. The sessions that get one more are
        listed (and so stamped) last, so the next split hands its remainder to the others: over
        many rounds shares differ by at most one chunk."""
        ready = sorted((s for s in self.by_ident.values() if s.wanted > 0 and not s.suspended),
                       key=lambda s: s.last_served)  # stable: ties keep session order
        if not ready or supply <= 0:
            return []
        share, extra = divmod(supply, len(ready))
        return [(s, share) for s in ready[extra:]] + [(s, share + 1) for s in ready[:extra]]
