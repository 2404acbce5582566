"""Typed configuration of the ZeroMQ transport (shared by the controller and the generators).

One ``TransportConfig`` describes both ends: the controller binds ``endpoint`` (ROUTER) and
``pub_endpoint`` (PUB); a generator connects its DEALER and SUB to the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vapo_async.transport.messages import MessageLimits


@dataclass
class CurveConfig:
    """CURVE (public-key) authentication and encryption; key files use the zmq.auth format."""

    server_secret_file: str | None = None
    """Controller side: its ``.key_secret`` file (holds public and secret key)."""
    server_public_file: str | None = None
    """Generator side: the controller's ``.key`` public key file."""
    client_secret_file: str | None = None
    """Generator side: its own ``.key_secret`` file."""
    authorized_keys_dir: str | None = None
    """Controller side: directory of ``*.key`` public keys of the generators allowed in."""
    force: bool = False
    """Use CURVE even on loopback/ipc endpoints (tests; paranoid single-host setups)."""

    def server_ready(self) -> bool:
        """True when the controller side has everything CURVE needs."""
        return bool(self.server_secret_file and self.authorized_keys_dir)

    def client_ready(self) -> bool:
        """True when the generator side has everything CURVE needs."""
        return bool(self.server_public_file and self.client_secret_file)


@dataclass
class RelayConfig:
    """Generator side: the weight relay between generators that fetch (no shared filesystem).

    A generator fetching a version serves the bytes it already has to the next fetching generator,
    which the controller names (a chain in the order they asked): each byte leaves the learner once
    whatever the number of generators. A peer that stalls or sends bad bytes is left for the
    controller (the repair path)."""

    enabled: bool = True
    """Take part in the relay; false = every fetch goes to the controller."""
    host: str | None = None
    """Address other generators reach this one at; None = the local address this machine uses to
    reach the controller (127.0.0.1 when the controller is on loopback or ipc)."""
    port: int = 0
    """TCP port of this generator's relay server; 0 = any free port (it is told to the controller)."""
    stall_s: float = 10.0
    """Leave a peer for the controller when it sent no new byte for this long."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transport.relay.port must be 0-65535, got {self.port}")
        if self.stall_s <= 0:
            raise ValueError(f"transport.relay.stall_s must be > 0, got {self.stall_s}")


@dataclass
class TransportConfig:
    """Addresses, security, queue bounds and timing of the controller <-> generator link."""

    endpoint: str = "tcp://127.0.0.1:5555"
    """Controller ROUTER address (tcp://HOST:PORT or ipc://PATH); generators connect here."""
    pub_endpoint: str | None = None
    """Weight-announcement PUB address; None = derived (tcp port + 1, ipc path + '-pub')."""
    curve: CurveConfig = field(default_factory=CurveConfig)
    """CURVE keys; required for endpoints off loopback unless ``allow_insecure``."""
    allow_insecure: bool = False
    """Allow plain-text tcp off loopback (logs a loud warning). Never the default."""
    sndhwm: int = 1000
    """ZeroMQ send high-water mark (messages queued per peer before back-pressure applies)."""
    rcvhwm: int = 1000
    """ZeroMQ receive high-water mark (messages queued per peer before TCP back-pressure)."""
    send_timeout_ms: int = 30_000
    """Generator-side: a blocking send waits at most this long, then raises (controller gone)."""
    heartbeat_s: float = 2.0
    """Generator-side: ``poll()`` sends a heartbeat when nothing was sent for this long."""
    connect_backoff_s: float = 0.2
    """First pause between hello retries while the controller is unreachable (doubles each time)."""
    connect_backoff_max_s: float = 5.0
    """Longest pause between hello retries."""
    fetch_chunk_bytes: int = 4 << 20
    """Chunk size of weight fetches over the ROUTER (must be <= limits.max_chunk_bytes)."""
    fetch_window: int = 4
    """Chunk requests kept in flight during a fetch (pipelining)."""
    fetch_timeout_s: float = 30.0
    """A fetch fails when no chunk arrives for this long (after retries)."""
    relay: RelayConfig = field(default_factory=RelayConfig)
    """Generator-side: the weight relay between fetching generators."""
    weights_root: str | None = None
    """Generator-side: trusted weights root; None = the root named in the controller's welcome."""
    limits: MessageLimits = field(default_factory=MessageLimits)
    """Size bounds applied to every incoming message."""

    def __post_init__(self) -> None:
        if not (self.endpoint.startswith("tcp://") or self.endpoint.startswith("ipc://")):
            raise ValueError(f"transport.endpoint must be tcp://HOST:PORT or ipc://PATH, got {self.endpoint!r}")
        if self.fetch_chunk_bytes > self.limits.max_chunk_bytes:
            raise ValueError(
                f"transport.fetch_chunk_bytes={self.fetch_chunk_bytes} exceeds "
                f"limits.max_chunk_bytes={self.limits.max_chunk_bytes}"
            )
        if self.fetch_window < 1 or self.heartbeat_s <= 0:
            raise ValueError("transport.fetch_window must be >= 1 and heartbeat_s > 0")

    def resolved_pub_endpoint(self) -> str:
        """The PUB address: explicit, or derived from ``endpoint`` (tcp port + 1, ipc '-pub')."""
        if self.pub_endpoint:
            return self.pub_endpoint
        if self.endpoint.startswith("ipc://"):
            return self.endpoint + "-pub"
        host, _, port = self.endpoint[len("tcp://"):].rpartition(":")
        if port == "*":  # ephemeral port: the PUB gets its own ephemeral port too
            return self.endpoint
        if not port.isdigit():
            raise ValueError(f"cannot derive pub_endpoint from {self.endpoint!r}: set it explicitly")
        return f"tcp://{host}:{int(port) + 1}"
