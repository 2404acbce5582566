"""Message handlers of the controller thread (split out of ``server.py`` to keep files small).

Everything here runs on the controller thread. ``_handle`` decodes and validates outside the lock,
then dispatches under it; replies are collected and sent after the lock is released, non-blocking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from vapo_async.transport.messages import (
    Ack,
    Bye,
    Chunk,
    ErrorReply,
    Fetch,
    FromGenerator,
    Heartbeat,
    Hello,
    Lease,
    LeasePrompt,
    MessageError,
    Request,
    RolloutGroup,
    WeightAnnouncement,
    WeightsRefused,
    Welcome,
    decode_from_generator,
)
from vapo_async.transport.weights import WeightsError, read_chunk

if TYPE_CHECKING:
    from vapo_async.controller.admission import Admission
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.leases import LeaseRecord, Ledger
    from vapo_async.controller.server import PromptLike
    from vapo_async.controller.stats import TransportStats
    from vapo_async.transport.sockets import ServerSockets

log = logging.getLogger("vapo_async.controller")

Outgoing = tuple[bytes, list, int | None]
"""(routing id, frames, lease id if the message is a lease)."""


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
    when the controller splits scarce admission capacity (``Controller._serve_credits``)."""


class Handlers:
    """Mixin of ``Controller``: the per-message logic of its thread."""

    cfg: ControllerConfig
    prompts: Sequence[PromptLike]
    vocab_size: int
    controller_id: str
    admission: Admission
    ledger: Ledger
    stats: TransportStats
    version: int
    latest: WeightAnnouncement | None
    announcements: OrderedDict[int, WeightAnnouncement]
    sessions: dict[bytes, Session]
    by_generator: dict[str, bytes]
    buffer: deque[RolloutGroup]
    refusals: Counter[str]
    _lock: threading.Lock
    _cv: threading.Condition
    _sockets: ServerSockets | None

    def weights_root(self) -> str: ...  # provided by Controller

    @property
    def pub_endpoint(self) -> str: ...  # provided by Controller

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        body = frames[1:]
        self.stats.counts["messages_in"] += 1
        self.stats.counts["bytes_in"] += sum(len(f) for f in body)
        try:
            msg = decode_from_generator(body, self.cfg.transport.limits, vocab_size=self.vocab_size,
                                        max_version=self.version)
        except MessageError as e:
            with self._lock:
                self._reject(ident, e.reason, e.detail)
                known = ident in self.sessions
            if not known:  # e.g. a generator still talking to the controller before a restart
                self._send_all([(ident, ErrorReply("unknown_session", "say hello first").to_frames(), None)])
            return
        with self._lock:
            out = self._dispatch(ident, msg, time.monotonic())
        self._send_all(out)

    def _dispatch(self, ident: bytes, msg: FromGenerator, now: float) -> list[Outgoing]:
        if isinstance(msg, Hello):
            return [(ident, self._on_hello(ident, msg, now).to_frames(), None)]
        s = self.sessions.get(ident)
        if s is None:
            self._reject(ident, "unknown_session", type(msg).__name__)
            return [(ident, ErrorReply("unknown_session", "say hello first").to_frames(), None)]
        s.last_seen = now
        self.ledger.heartbeat(ident, now, self.cfg.lease_timeout_s)  # any message shows liveness
        if isinstance(msg, Request | RolloutGroup):
            s.suspended = False
        if isinstance(msg, Request):
            s.wanted = msg.credit
            if msg.credit > 0:
                s.refused_version = None  # it loaded weights it can sample with again
        elif isinstance(msg, WeightsRefused):
            self._on_weights_refused(s, msg)
        elif isinstance(msg, Bye):
            log.info("generator %s left (%d leases re-issued)", s.generator_id, self._forget_session(ident))
        elif isinstance(msg, Fetch):
            return [(ident, self._on_fetch(msg), None)]
        elif isinstance(msg, RolloutGroup):
            return [(ident, self._on_group(s, msg).to_frames(), None)]
        else:
            assert isinstance(msg, Heartbeat)
        return []

    def _on_hello(self, ident: bytes, msg: Hello, now: float) -> Welcome:
        old = self.by_generator.get(msg.generator_id)
        if old is not None and old != ident:
            n = self._forget_session(old)
            log.info("generator %s reconnected with a new session: %d leases re-issued", msg.generator_id, n)
        s = self.sessions.get(ident)
        if s is None or s.session != msg.session:
            if s is not None:
                self._forget_session(ident)
            s = Session(msg.generator_id, msg.session, ident, msg.max_prompts)
            self.sessions[ident] = s
            self.by_generator[msg.generator_id] = ident
            log.info("generator %s joined (holds version %d, %d generators)", msg.generator_id, msg.version,
                     len(self.sessions))
        s.max_prompts, s.version, s.last_seen = msg.max_prompts, msg.version, now
        return Welcome(
            controller_id=self.controller_id, session=msg.session, version=self.version, weights=self.latest,
            weights_root=self.weights_root(), pub_endpoint=self.pub_endpoint, vocab_size=self.vocab_size,
            lease_timeout_s=self.cfg.lease_timeout_s, heartbeat_s=self.cfg.resolved_heartbeat_s(),
            sampling=dict(self.cfg.sampling), max_model_len=self.cfg.max_model_len, reward=dict(self.cfg.reward),
        )

    def _on_weights_refused(self, s: Session, msg: WeightsRefused) -> None:
        """The generator cannot load ``msg.version``: count it (once per session and version),
        re-issue its leases that need a newer version than it holds (those it handed back and any
        still on the way to it), and grant it nothing until its next ``request``."""
        s.wanted, s.version = 0, msg.held
        mine = self.ledger.by_owner.get(s.ident, set())
        unservable = {i for i in mine if self.ledger.leases[i].min_version > msg.held}
        n = self.ledger.release_owner(s.ident, sorted(unservable | set(msg.return_leases)))
        if msg.version == s.refused_version:
            return
        s.refused_version = msg.version
        self.refusals["weights_refused"] += 1
        self.refusals[f"weights_refused/{msg.reason}"] += 1
        log.warning("generator %s refused weights version %d (%s) and keeps version %d: %d of its leases "
                    "re-issued, no new ones until it loads a version", s.generator_id, msg.version, msg.reason,
                    msg.held, n)

    def _forget_session(self, ident: bytes) -> int:
        """Drop a session; its leases are re-issued. Returns how many leases."""
        n = self.ledger.release_owner(ident)
        s = self.sessions.pop(ident, None)
        if s is not None and self.by_generator.get(s.generator_id) == ident:
            del self.by_generator[s.generator_id]
        return n

    def _on_group(self, s: Session, g: RolloutGroup) -> Ack:
        def refused(reason: str, detail: str) -> Ack:
            self._reject(s.ident, reason, detail)
            return Ack(g.lease_id, g.prompt_index, "rejected", reason)

        if g.generator_id != s.generator_id:
            return refused("generator_id_mismatch", f"{g.generator_id[:40]!r} != {s.generator_id!r}")
        status, lease = self.ledger.lookup(g.lease_id, g.prompt_index, s.ident)
        if status == "duplicate":
            self.ledger.counts["duplicates"] += 1
            return Ack(g.lease_id, g.prompt_index, "duplicate")
        if lease is None:
            return refused(status, f"lease {g.lease_id} prompt {g.prompt_index}")
        reason = self._semantic_problem(g, lease)
        if reason:
            self.ledger.refuse(lease, g.prompt_index)  # the owner's copy is unusable: re-issue now
            return refused(reason, f"lease {g.lease_id} prompt {g.prompt_index}")
        g.admission_index = self.ledger.accept(lease, g.prompt_index)
        self.buffer.append(g)
        if len(self.buffer) > self.admission.max_batch():
            raise RuntimeError(f"buffer holds {len(self.buffer)} groups > (eta + 1) * B: admission is broken")
        self._cv.notify_all()
        return Ack(g.lease_id, g.prompt_index, "accepted")

    def _semantic_problem(self, g: RolloutGroup, lease: LeaseRecord) -> str:
        n = self.cfg.sampling.get("n")
        if n is not None and g.group_size != n:
            return "group_size"
        oldest = g.oldest_version()
        if 0 <= oldest < lease.min_version:
            return "version_stale"
        return ""

    def _on_fetch(self, msg: Fetch) -> list:
        ann = self.announcements.get(msg.version)
        if ann is None:
            self.stats.counts["fetch_errors"] += 1
            return ErrorReply("fetch_unknown_version", f"version {msg.version} is not served").to_frames()
        try:
            data, size = read_chunk(ann, msg.file, msg.offset, msg.length)
        except WeightsError as e:
            self.stats.counts["fetch_errors"] += 1
            return ErrorReply(e.reason, str(e)).to_frames()
        self.stats.counts["fetch_bytes"] += len(data)
        return Chunk(msg.version, msg.file, msg.offset, size, data).to_frames()

    def _lease_message(self, lease_id: int, items: dict[int, int]) -> Lease:
        prompts = tuple(LeasePrompt(p, self.prompts[p].prompt, self.prompts[p].answer) for p in items)
        return Lease(lease_id, self.version, self.cfg.lease_timeout_s, prompts, self.latest)

    def _reject(self, ident: bytes, reason: str, detail: str) -> None:
        s = self.sessions.get(ident)
        sender = f"{s.generator_id} ({ident[:40]!r})" if s else repr(ident[:40])
        self.stats.reject(reason, sender, detail)

    def _send_all(self, out: list[Outgoing]) -> None:
        assert self._sockets is not None
        router = self._sockets.router
        for ident, frames, lease_id in out:
            try:
                router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
                continue
            except zmq.Again:
                self.stats.counts["send_dropped_hwm"] += 1
                gone = False
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self.stats.counts["send_unroutable"] += 1
                gone = True
            with self._lock:
                if gone and ident in self.sessions:
                    self._forget_session(ident)
                elif lease_id is not None and lease_id in self.ledger.leases:
                    self.ledger.deactivate(lease_id)
