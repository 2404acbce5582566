"""``ControllerClient``: the generator's end of the controller link (DEALER + SUB).

Typical generator loop (single thread; the client is not thread-safe)::

    client = ControllerClient(cfg, generator_id="gen-0", max_prompts=8)
    welcome = client.connect(timeout_s=None)          # waits (with backoff) for the learner
    weights_dir = client.resolve_weights(welcome.weights, local_dir) if welcome.weights else base_dir
    client.request(credit=8)                          # "I can take 8 prompts now"
    while running:
        for msg in client.poll(timeout_ms=20):        # also sends heartbeats when due
            if isinstance(msg, Lease): ...            # sample msg.prompts with version >= msg.min_version
            elif isinstance(msg, WeightAnnouncement): path = client.resolve_weights(msg, local_dir); reload
            elif isinstance(msg, Welcome): ...        # (re)joined a controller: see rules below
            elif isinstance(msg, Ack | ErrorReply): ...  # receipts / refusals, for metrics and logs
        ... step the engine ...; client.send_group(group); client.request(free_capacity)
    client.bye(return_leases=[...]); client.close()

Rules the generator must follow:
- Call ``poll()`` at least every ``heartbeat_s``: heartbeats keep its leases alive, and a generator
  whose main loop hangs must stop heartbeating so its prompts are re-issued.
- Sample a lease's prompts only with weights of version >= ``lease.min_version`` (``lease.weights``
  names the newest version); the controller rejects groups with older tokens (``version_stale``).
- ``request(credit)`` states how many *more* prompts it can take now (it replaces the last request).
- Version 0 is the base model the generator started from (no announcement needed for it).
- A ``Welcome`` out of ``poll()`` means the controller restarted or forgot this session: drop
  in-flight leases (they were re-issued), load ``welcome.weights`` when ``welcome.version`` differs
  from the version held (a learner resumed from a checkpoint rolls versions *back*; groups stamped
  with newer versions are refused as ``version_future``), then ``request`` credit again.
- ``Ack(status="rejected", reason=...)`` for a group means it was refused; ``version_stale`` /
  ``version_future`` say the weights are out of step with the controller.
- Weights that fail verification or loading: ``weights_refused(version, held, reason, leases)``
  hands back the leases that need them; ask for no credit until a newer version is loaded, then
  ``request`` again (the controller re-issues the leases instead of waiting on this generator).

Reconnects are automatic: when the controller answers ``unknown_session`` (it restarted), the client
says hello again and the new ``Welcome`` comes out of ``poll()``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, deque
from pathlib import Path

import zmq

from vapo_async.transport.config import TransportConfig
from vapo_async.transport.fetch import FetchStats, Peer, fetch_weights
from vapo_async.transport.messages import (
    Ack,
    Bye,
    Chunk,
    ErrorReply,
    FromController,
    Heartbeat,
    Hello,
    Lease,
    MessageError,
    RelayJoin,
    RelayPeer,
    Request,
    RolloutBatch,
    WeightAnnouncement,
    WeightsRefused,
    Welcome,
    decode_announcement,
    decode_from_controller,
    encode_group,
)
from vapo_async.transport.relay import PeerLink, RelayServer
from vapo_async.transport.sockets import ClientSockets, InsecureEndpointError
from vapo_async.transport.weights import (
    WeightsError,
    locate_version,
    pin_version,
    verify_weights_dir,
)

log = logging.getLogger(__name__)

Message = Lease | WeightAnnouncement | Ack | ErrorReply | Welcome


class ControllerClient:
    """Generator-side connection to the controller: hello/lease/group/heartbeat/bye, weight
    announcements and chunked weight fetches. See the module docstring for the loop."""

    def __init__(self, cfg: TransportConfig, generator_id: str, *, max_prompts: int = 64,
                 ctx: zmq.Context | None = None) -> None:
        if not generator_id or ":" in generator_id or len(generator_id) > 64:
            raise ValueError(f"generator_id must be 1-64 chars without ':', got {generator_id!r}")
        self.cfg = cfg
        self.generator_id = generator_id
        self.max_prompts = max_prompts
        self.session = uuid.uuid4().hex[:16]
        self.version = 0
        """Weight version the generator holds (sent in hello; set it after each reload)."""
        self.welcome: Welcome | None = None
        self.rejected: Counter[str] = Counter()
        """Invalid controller messages dropped, per reason."""
        self._links_work = True
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        try:
            self._sockets = ClientSockets(cfg, self._ctx, f"{generator_id}:{self.session}")
        except BaseException:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sockets.dealer, zmq.POLLIN)
        self._inbox: deque[FromController | WeightAnnouncement] = deque()
        self._leases: deque[int] = deque(maxlen=100_000)
        self._last_send = 0.0
        self.fetch_stats = FetchStats()
        """Where fetched weight bytes came from (controller, relay peer) and relay fallbacks."""
        self.relay: RelayServer | None = None
        """This generator's weight relay server (started by its first fetch)."""

    # ---- session ----

    def connect(self, timeout_s: float | None = None) -> Welcome:
        """Say hello and wait for the welcome, retrying with exponential backoff while the
        controller is unreachable. Raises ``TimeoutError`` after ``timeout_s`` (None = forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = self.cfg.connect_backoff_s
        while True:
            try:
                self._send(Hello(self.generator_id, self.session, self.max_prompts, self.version).to_frames(),
                           block=False)
            except zmq.Again:  # no usable connection yet (down, or the CURVE handshake failed)
                pass
            wait_until = time.monotonic() + pause
            if deadline is not None:
                wait_until = min(wait_until, deadline)
            while (left := wait_until - time.monotonic()) > 0:
                msg = self._recv_one(int(left * 1000) + 1)
                if isinstance(msg, Welcome) and msg.session == self.session:
                    return msg
                if msg is not None and not isinstance(msg, (Welcome, ErrorReply)):
                    self._inbox.append(msg)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no welcome from controller at {self.cfg.endpoint} within {timeout_s} s "
                                   "(down, wrong address, or CURVE keys refused)")
            pause = min(2 * pause, self.cfg.connect_backoff_max_s)

    def request(self, credit: int) -> None:
        """Tell the controller this generator can take ``credit`` (>= 0) more prompts now."""
        if credit < 0:
            raise ValueError(f"credit must be >= 0, got {credit}")
        self._send(Request(int(credit)).to_frames())

    def heartbeat(self) -> None:
        """Extend this generator's lease deadlines (``poll`` does it when due)."""
        try:
            self._send(Heartbeat().to_frames(), block=False)
        except zmq.Again:  # queue full while the controller is away: the next one will do
            log.debug("heartbeat dropped: send queue full")

    def send_group(self, group: RolloutBatch) -> bool:
        """Send one finished group (a batch of one prompt). Returns False (and sends nothing) when its lease came from a
        previous controller incarnation (that controller re-issued the prompt already). Raises
        ``TimeoutError`` when the controller accepted nothing for ``send_timeout_ms`` (the lease
        deadline then re-issues the prompt; the generator may retry or drop the group)."""
        if group.lease_id not in self._leases:
            log.warning("dropping group for lease %d: not granted by the current controller", group.lease_id)
            return False
        try:
            self._send(encode_group(group))
        except zmq.Again:
            raise TimeoutError(f"controller at {self.cfg.endpoint} accepted nothing for "
                               f"{self.cfg.send_timeout_ms} ms") from None
        return True

    def weights_refused(self, version: int, held: int, reason: str, return_leases: list[int]) -> None:
        """Tell the controller that weights ``version`` were refused (``reason`` token) and version
        ``held`` stays loaded, handing back ``return_leases`` (they need a version it cannot load).
        It then grants this generator nothing until the next ``request``."""
        self._send(WeightsRefused(version, held, reason, tuple(return_leases)).to_frames())

    def bye(self, return_leases: list[int]) -> None:
        """Leave cleanly, handing ``return_leases`` back for immediate re-issue."""
        try:
            self._send(Bye(tuple(return_leases)).to_frames(), block=False)
        except zmq.Again:
            log.warning("bye not sent (queue full); the lease deadlines will re-issue the work")

    def close(self) -> None:
        """Close the sockets (queued messages get up to 1 s to leave) and the relay server."""
        if self.relay is not None:
            self.relay.close()
        self._sockets.close()
        if self._own_ctx:
            self._ctx.term()

    # ---- receiving ----

    def poll(self, timeout_ms: int) -> list[Message]:
        """Messages that arrived within ``timeout_ms`` (all that are ready once one is); sends a
        heartbeat first when one is due. Invalid messages are counted in ``rejected`` and dropped."""
        if time.monotonic() - self._last_send >= self.heartbeat_s():
            self.heartbeat()
        out: list[Message] = []
        while self._inbox:
            self._route(self._inbox.popleft(), out)
        first = self._recv_one(0 if out else timeout_ms)
        while first is not None:
            self._route(first, out)
            first = self._recv_one(0)
        return out

    def heartbeat_s(self) -> float:
        """Heartbeat period: the configured one, or the controller's if that is shorter."""
        told = self.welcome.heartbeat_s if self.welcome is not None and self.welcome.heartbeat_s > 0 else None
        return min(self.cfg.heartbeat_s, told) if told else self.cfg.heartbeat_s

    def _route(self, msg: FromController | WeightAnnouncement, out: list[Message]) -> None:
        if isinstance(msg, Chunk | RelayPeer):
            return  # a late chunk of a finished fetch, a late answer to a relay join
        if isinstance(msg, ErrorReply) and msg.reason == "unknown_session":
            log.info("controller does not know session %s (restarted?): saying hello again", self.session)
            self._send(Hello(self.generator_id, self.session, self.max_prompts, self.version).to_frames())
        if isinstance(msg, Welcome) and msg.session != self.session:
            return
        out.append(msg)

    def _recv_one(self, timeout_ms: int) -> FromController | WeightAnnouncement | None:
        """One decoded message (or None on timeout); handles welcome/lease bookkeeping."""
        events = dict(self._poller.poll(timeout_ms))
        sub = self._sockets.sub
        if sub is not None and events.get(sub):
            frames = sub.recv_multipart(copy=False)
            try:
                return decode_announcement(frames, self.cfg.limits)
            except MessageError as e:
                self._reject("pub", e)
        if events.get(self._sockets.dealer):
            frames = self._sockets.dealer.recv_multipart(copy=False)
            try:
                msg = decode_from_controller(frames, self.cfg.limits)
            except MessageError as e:
                self._reject("controller", e)
                return None
            if isinstance(msg, Welcome) and msg.session == self.session:
                self._on_welcome(msg)
            elif isinstance(msg, Lease):
                self._leases.append(msg.lease_id)
            return msg
        return None

    def _on_welcome(self, msg: Welcome) -> None:
        if self.welcome is None or msg.controller_id != self.welcome.controller_id:
            self._leases.clear()  # leases of a previous controller incarnation are void
        if self.welcome is None or msg.pub_endpoint != self.welcome.pub_endpoint or self._sockets.sub is None:
            if self._sockets.sub is not None:
                self._poller.unregister(self._sockets.sub)
            self._poller.register(self._sockets.connect_sub(msg.pub_endpoint), zmq.POLLIN)
        self.welcome = msg

    def _reject(self, source: str, e: MessageError) -> None:
        self.rejected[e.reason] += 1
        if self.rejected[e.reason] in (1, 10, 100, 1000) or self.rejected[e.reason] % 10_000 == 0:
            log.warning("rejected %s message (%s, %d so far): %s", source, e.reason, self.rejected[e.reason], e)

    def _send(self, frames: list, block: bool = True) -> None:
        self._sockets.dealer.send_multipart(frames, flags=0 if block else zmq.NOBLOCK, copy=False)
        self._last_send = time.monotonic()

    # ---- weights ----

    def weights_root(self) -> Path:
        """The trusted weights root: ``cfg.weights_root`` or the one the controller named."""
        if self.cfg.weights_root:
            return Path(self.cfg.weights_root)
        if self.welcome is None or not self.welcome.weights_root:
            raise WeightsError("no_root", "no weights root known: connect() first or set transport.weights_root")
        return Path(self.welcome.weights_root)

    def resolve_weights(self, ann: WeightAnnouncement, local_dir: str | Path) -> Path:
        """A verified directory holding ``ann``'s weights in ``local_dir``: hard links to the
        announced directory when this machine can read it (so the learner's pruning cannot take
        the files away; across filesystems, the announced directory itself, with one warning),
        else a chunked fetch. Raises ``WeightsError`` when the files fail verification (traversal,
        checksum, size) or vanished: keep the current weights then."""
        path = Path(ann.path)
        try:
            readable = path.is_dir() and (path / "MANIFEST.json").is_file()
        except OSError:
            readable = False
        if not readable:
            return self.fetch_weights(ann, Path(local_dir))
        root = self.weights_root()
        if self._links_work:
            try:
                pinned = pin_version(locate_version(path, root, ann.version), Path(local_dir))
            except FileNotFoundError as e:  # pruned while we looked
                raise WeightsError("vanished", f"version {ann.version} at {path} vanished: {e}") from None
            except OSError as e:
                self._links_work = False
                log.warning("cannot hard-link weights from %s into %s (%s): reading the learner's directory; "
                            "a generator lagging more than checkpoint.keep_weights versions may then fail a "
                            "reload", root, local_dir, e)
            else:
                return verify_weights_dir(pinned, Path(local_dir), ann, self.cfg.limits)
        return verify_weights_dir(path, root, ann, self.cfg.limits)

    def fetch_weights(self, ann: WeightAnnouncement, dest_dir: Path) -> Path:
        """Fetch ``ann``'s files in chunks into ``dest_dir/v{version:08d}`` (resumable from a partial
        earlier attempt, every file checked against its manifest digest): the manifest from the
        controller, the other files from the relay peer the controller names (``relay.py``), or
        from the controller. Messages that arrive meanwhile are kept for the next ``poll()``."""
        dest = Path(dest_dir)
        server = self._relay_server(dest)
        if server is not None:
            server.expect(ann.version)  # a generator after this one may ask before the manifest is here
        link = None if server is None else self._relay_peer(ann, server)
        try:
            peer = None if link is None else Peer(link.send, link.recv, link.address)
            return fetch_weights(self._send, self._recv_chunk, ann, dest, self.cfg, peer,
                                 None if server is None else server.serve, self.fetch_stats)
        except BaseException:
            if server is not None:
                server.forget(ann.version)
            raise
        finally:
            if link is not None:
                link.close()

    def _relay_server(self, dest: Path) -> RelayServer | None:
        """This generator's relay server over ``dest`` (started now if needed), or None when off."""
        if not self.cfg.relay.enabled:
            return None
        if self.relay is not None:
            self.relay.check()
            if self.relay.cache_dir == dest:
                return self.relay
            self.relay.close()
        self.relay = RelayServer(self.cfg, dest)
        return self.relay

    def _peer_link(self, ann: WeightAnnouncement, peer: RelayPeer) -> PeerLink | None:
        """A link to ``peer``, or None (with a warning, counted as the fallback ``relay_link``) when
        this generator cannot talk to it safely: CURVE keys on one side only, or plain text off
        loopback without ``allow_insecure``."""
        if peer.public_key and not self.cfg.curve.client_ready():
            problem = "the peer uses CURVE but this generator has no transport.curve key files"
        else:
            try:
                link = PeerLink(self.cfg, self._ctx, peer.address, peer.public_key)
            except (InsecureEndpointError, OSError, ValueError) as e:
                problem = str(e)
            else:
                log.info("fetching version %d from relay peer %s", ann.version, peer.address)
                return link
        self.fetch_stats.fallbacks["relay_link"] += 1
        log.warning("cannot fetch version %d from relay peer %s (%s): fetching from the controller",
                    ann.version, peer.address, problem)
        return None

    def _relay_peer(self, ann: WeightAnnouncement, server: RelayServer) -> PeerLink | None:
        """Join ``ann``'s relay chain; a link to the peer to fetch from, or None (the controller).
        A controller that does not answer within ``relay.stall_s`` is taken as "from me"."""
        self._send(RelayJoin(ann.version, server.address, server.public_key).to_frames())
        deadline = time.monotonic() + self.cfg.relay.stall_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self._recv_one(int(left * 1000) + 1)
            if isinstance(msg, RelayPeer) and msg.version == ann.version:
                if not msg.address:
                    return None
                return self._peer_link(ann, msg)
            if msg is not None and not isinstance(msg, Chunk | RelayPeer):
                self._inbox.append(msg)
        log.warning("no relay_peer answer for version %d within %.0f s: fetching from the controller",
                    ann.version, self.cfg.relay.stall_s)
        return None

    def _recv_chunk(self, timeout_ms: int) -> Chunk | ErrorReply | None:
        msg = self._recv_one(timeout_ms)
        if isinstance(msg, Chunk):
            return msg
        if isinstance(msg, ErrorReply) and msg.reason.startswith("fetch"):
            return msg
        if msg is not None:
            self._inbox.append(msg)
        return None
