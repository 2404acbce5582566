"""Relay chains: which generator each fetching generator takes a weight version from.

For every weight version the controller keeps the generators that asked to fetch it
(``relay_join``), in the order they asked. A generator is told to fetch from the nearest one
before it in that order whose session is still alive, and the first one from the controller
itself (``relay_peer`` with no address): a chain, so each byte leaves the learner once however
many generators fetch, and every generator uploads what it has to at most one other. A generator
that asks again keeps its place, so no two generators ever wait on each other (the order has no
cycles). Chains of versions the controller no longer serves are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from vapo_async.transport.messages import RelayJoin, RelayPeer


@dataclass
class Member:
    """A generator in a version's chain: its routing id and relay server."""

    ident: bytes
    address: str
    public_key: str


class RelayChains:
    """The relay chain of each served weight version (module docstring)."""

    def __init__(self) -> None:
        self.chains: dict[int, list[Member]] = {}

    def join(self, ident: bytes, msg: RelayJoin, alive: Callable[[bytes], bool],
             served: Collection[int]) -> RelayPeer:
        """``ident`` fetches ``msg.version``: put it in the chain (or keep its place, with the new
        address) and name the nearest live member before it (none: the controller)."""
        for v in [v for v in self.chains if v not in served]:
            del self.chains[v]
        chain = self.chains.setdefault(msg.version, [])
        pos = next((i for i, m in enumerate(chain) if m.ident == ident), None)
        if pos is None:
            chain.append(Member(ident, msg.address, msg.public_key))
            pos = len(chain) - 1
        else:
            chain[pos] = Member(ident, msg.address, msg.public_key)
        for m in reversed(chain[:pos]):
            if alive(m.ident):
                return RelayPeer(msg.version, m.address, m.public_key)
        return RelayPeer(msg.version)

    def members(self, version: int) -> list[bytes]:
        """Routing ids in ``version``'s chain, in order."""
        return [m.ident for m in self.chains.get(version, [])]
