"""Typed configuration of the controller (leases, deadlines, prompt order)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vapo_async.transport.config import TransportConfig


@dataclass
class ControllerConfig:
    """Controller knobs; the staleness bound eta and batch size B come from the algorithm config."""

    transport: TransportConfig = field(default_factory=TransportConfig)
    """Endpoints, CURVE keys, high-water marks and message limits."""
    lease_timeout_s: float = 60.0
    """A lease whose generator sent nothing (heartbeat or group) for this long is re-issued."""
    lease_max_s: float = 3600.0
    """Any lease older than this is re-issued even if heartbeats continue (a wedged sampler)."""
    max_lease_prompts: int = 64
    """Most prompts in one lease (a generator's credit is served by several leases if larger)."""
    heartbeat_s: float = 0.0
    """Heartbeat period told to generators; 0 = lease_timeout_s / 4."""
    session_timeout_s: float = 0.0
    """A generator session that sent nothing for this long and holds no lease is forgotten (its
    next message gets ``unknown_session`` and it says hello again); 0 = 2 x lease_timeout_s."""
    seed: int = 0
    """Seed of the per-epoch prompt shuffle (epoch e uses permutation(seed, e))."""
    shuffle: bool = True
    """Shuffle prompts each epoch; False = dataset order."""
    weights_root: str = ""
    """Trusted weights root told to generators; '' = the parent of the latest announced path."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling settings forwarded in ``welcome``; when it has ``n`` every group must have n responses."""
    max_model_len: int = 0
    """Context (longest prompt + max_tokens) every generator engine must offer, sent in ``welcome``
    (0 = no demand)."""
    reward: dict[str, Any] = field(default_factory=dict)
    """Reward settings (``RewardConfig`` as a map) sent in ``welcome``: generators score with these."""
    keep_announcements: int = 8
    """Weight versions whose files the controller serves to chunked fetches."""
    republish_s: float = 5.0
    """The latest announcement is re-sent on PUB this often (PUB drops while a SUB is connecting)."""
    log_interval_s: float = 10.0
    """Rejection warnings are logged at most once per reason per this many seconds."""
    tick_s: float = 0.05
    """Controller loop wake-up period (deadline checks) when no message arrives."""

    def __post_init__(self) -> None:
        if self.lease_timeout_s <= 0 or self.lease_max_s < self.lease_timeout_s:
            raise ValueError(
                f"need 0 < lease_timeout_s <= lease_max_s, got {self.lease_timeout_s}, {self.lease_max_s}"
            )
        if self.session_timeout_s < 0 or 0 < self.session_timeout_s < 2 * self.resolved_heartbeat_s():
            raise ValueError(f"session_timeout_s must be 0 (= 2 x lease_timeout_s) or at least two heartbeat periods "
                             f"({2 * self.resolved_heartbeat_s():g} s), got {self.session_timeout_s}")
        if self.max_lease_prompts < 1 or self.keep_announcements < 1:
            raise ValueError("max_lease_prompts and keep_announcements must be >= 1")
        if "n" in self.sampling and (not isinstance(self.sampling["n"], int) or self.sampling["n"] < 1):
            raise ValueError(f"sampling.n must be a positive int, got {self.sampling['n']!r}")

    def resolved_heartbeat_s(self) -> float:
        """The heartbeat period generators are told to use."""
        return self.heartbeat_s if self.heartbeat_s > 0 else self.lease_timeout_s / 4

    def resolved_session_timeout_s(self) -> float:
        """Silence after which a lease-less generator session is forgotten."""
        return self.session_timeout_s if self.session_timeout_s > 0 else 2 * self.lease_timeout_s
