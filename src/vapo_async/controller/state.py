"""The controller as a state machine: events in, replies out as values; no sockets, locks or clocks.

``ControllerState`` holds everything the controller knows (items and leases, generator sessions,
admission, the prompt order, weight versions, the buffer of received groups) and changes only on:

- ``handle(sender, msg, now)``: a decoded message from generator ``sender`` -> replies;
- ``undecodable(sender, reason, detail, now)``: a message that failed validation -> replies;
- ``tick(now)``: the timer (lease deadlines, idle sessions, serving credit) -> leases to send;
- ``undelivered(out, unroutable)``: a reply the socket could not send;
- the learner's calls: ``take_batch``, ``mark_trained``, ``mark_dropped``, ``step_done``, ``announce``.

Time comes in as ``now`` (monotonic seconds) and replies go out as ``Outgoing`` values that the
socket thread (``server.py``) encodes and sends, so the property tests drive it directly. Reading
weight files for a ``fetch`` is left to that thread too (``ReadChunk``): file I/O is not state.
Nothing here departs from the paper; the admission rule's departures are in ``admission.py``.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vapo_async.controller.admission import Admission
from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.items import LIVE_STATES
from vapo_async.controller.leases import LeaseRecord, Ledger
from vapo_async.controller.order import PromptOrder
from vapo_async.controller.relay import RelayChains
from vapo_async.controller.sessions import Session, Sessions
from vapo_async.controller.stats import TransportStats
from vapo_async.transport.messages import (
    Ack,
    Bye,
    ErrorReply,
    Fetch,
    FromGenerator,
    Heartbeat,
    Hello,
    Lease,
    LeasePrompt,
    RelayJoin,
    RelayPeer,
    Request,
    RolloutBatch,
    WeightAnnouncement,
    WeightsRefused,
    Welcome,
)

log = logging.getLogger("vapo_async.controller")
STATE_FORMAT = 1
"""Version of ``state_dict``'s layout (checkpoints written since issue 4 read back unchanged)."""


class PromptLike(Protocol):
    """What the controller needs of a prompt record (``vapo_async.data.PromptRecord``)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class ReadChunk:
    """Answer ``fetch`` with bytes of the announced weights ``ann``: the socket thread reads them."""

    ann: WeightAnnouncement
    fetch: Fetch


@dataclass(frozen=True)
class Outgoing:
    """One reply: ``msg`` for the generator whose routing id is ``to``."""

    to: bytes
    msg: Welcome | Lease | Ack | ErrorReply | RelayPeer | ReadChunk

    @property
    def lease_id(self) -> int | None:
        """The lease it grants (its items are re-issued if it cannot be sent), else None."""
        return self.msg.lease_id if isinstance(self.msg, Lease) else None


def _unknown_session(sender: bytes) -> Outgoing:
    return Outgoing(sender, ErrorReply("unknown_session", "say hello first"))


class ControllerState:
    """Leases prompts to generators under the eta admission rule and collects their groups."""

    def __init__(self, cfg: ControllerConfig, prompts: Sequence[PromptLike], batch_groups: int, eta: int,
                 vocab_size: int, controller_id: str) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.vocab_size = vocab_size
        self.controller_id = controller_id
        self.pub_endpoint = ""
        """Where weights are announced (told in ``welcome``); set by the socket thread once bound."""
        self.admission = Admission(batch_groups, eta)
        self.order = PromptOrder(len(prompts), cfg.seed, cfg.shuffle)
        self.ledger = Ledger()
        self.sessions = Sessions()
        self.stats = TransportStats(cfg.log_interval_s)
        self.refusals: Counter[str] = Counter()  # weights_refused[/reason] reports of generators
        self.version = 0
        self.latest: WeightAnnouncement | None = None
        self.announcements: OrderedDict[int, WeightAnnouncement] = OrderedDict()
        self.buffer: deque[RolloutBatch] = deque()
        self.relay = RelayChains()

    # ---- generator events ----

    def handle(self, sender: bytes, msg: FromGenerator, now: float) -> list[Outgoing]:
        """A valid message from ``sender``; returns the replies. Any message shows liveness."""
        if isinstance(msg, Hello):
            return [Outgoing(sender, self._on_hello(sender, msg, now))]
        s = self.sessions.get(sender)
        if s is None:
            self._reject(sender, "unknown_session", type(msg).__name__, now)
            return [_unknown_session(sender)]
        s.last_seen = now
        self.ledger.heartbeat(sender, now, self.cfg.lease_timeout_s)
        if isinstance(msg, Request | RolloutBatch):
            s.suspended = False
        if isinstance(msg, Request):
            s.wanted = msg.credit
            if msg.credit > 0:
                s.refused_version = None  # it loaded weights it can sample with again
        elif isinstance(msg, WeightsRefused):
            self._on_weights_refused(s, msg)
        elif isinstance(msg, Bye):
            n = self.sessions.forget(sender, self.ledger)
            log.info("generator %s left (%d leases re-issued)", s.generator_id, n)
        elif isinstance(msg, Fetch):
            return [Outgoing(sender, self._on_fetch(msg))]
        elif isinstance(msg, RelayJoin):
            return [Outgoing(sender, self._on_relay_join(sender, msg))]
        elif isinstance(msg, RolloutBatch):
            return [Outgoing(sender, self._on_group(s, msg, now))]
        elif not isinstance(msg, Heartbeat):
            raise TypeError(f"no handler for message {type(msg).__name__}")
        return []

    def undecodable(self, sender: bytes, reason: str, detail: str, now: float) -> list[Outgoing]:
        """A message that failed validation: counted; a sender without a session is told to say
        hello (e.g. a generator still talking to the controller before a restart)."""
        self._reject(sender, reason, detail, now)
        return [] if self.sessions.get(sender) is not None else [_unknown_session(sender)]

    def undelivered(self, out: Outgoing, unroutable: bool) -> None:
        """``out`` could not be sent: the peer is gone (``unroutable``: forget its session) or its
        queue is full (a lease is re-issued rather than waiting for its deadline)."""
        self.stats.counts["send_unroutable" if unroutable else "send_dropped_hwm"] += 1
        if unroutable and self.sessions.get(out.to) is not None:
            self.sessions.forget(out.to, self.ledger)
        elif out.lease_id is not None and out.lease_id in self.ledger.leases:
            self.ledger.deactivate(out.lease_id)

    def _on_hello(self, sender: bytes, msg: Hello, now: float) -> Welcome:
        s, new = self.sessions.join(sender, msg.generator_id, msg.session, msg.max_prompts, self.ledger)
        if new:
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

    def _on_group(self, s: Session, g: RolloutBatch, now: float) -> Ack:
        def refused(reason: str, detail: str) -> Ack:
            self._reject(s.ident, reason, detail, now)
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
        return Ack(g.lease_id, g.prompt_index, "accepted")

    def _semantic_problem(self, g: RolloutBatch, lease: LeaseRecord) -> str:
        n = self.cfg.sampling.get("n")
        if n is not None and g.group_size != n:
            return "group_size"
        oldest = g.oldest_version()
        if 0 <= oldest < lease.min_version:
            return "version_stale"
        return ""

    def _on_fetch(self, msg: Fetch) -> ErrorReply | ReadChunk:
        ann = self.announcements.get(msg.version)
        if ann is None:
            self.stats.counts["fetch_errors"] += 1
            return ErrorReply("fetch_unknown_version", f"version {msg.version} is not served")
        return ReadChunk(ann, msg)

    def _on_relay_join(self, sender: bytes, msg: RelayJoin) -> RelayPeer:
        peer = self.relay.join(sender, msg, lambda ident: self.sessions.get(ident) is not None, self.announcements)
        self.stats.counts["relay_joins"] += 1
        if peer.address:
            self.stats.counts["relay_peer_assigned"] += 1
        return peer

    def _reject(self, sender: bytes, reason: str, detail: str, now: float) -> None:
        s = self.sessions.get(sender)
        who = f"{s.generator_id} ({sender[:40]!r})" if s else repr(sender[:40])
        self.stats.reject(reason, who, detail, now)

    # ---- timer ----

    def tick(self, now: float) -> list[Outgoing]:
        """Re-issue leases past their deadline (their owners get no new work until they show
        progress), forget idle sessions, then serve credit; returns the new leases."""
        for lease in self.ledger.due(now):
            s = self.sessions.get(lease.owner)
            if s is not None:
                s.suspended = True
        if self.ledger.expire(now):
            log.info("re-issuing expired leases: %s", self.describe())
        self.sessions.drop_idle(now, self.cfg.resolved_session_timeout_s(), self.ledger)
        return self._serve_credits(now)

    def _serve_credits(self, now: float) -> list[Outgoing]:
        """Grant credit fairly: each pass splits the supply (re-issuable pending items plus
        admission capacity) with ``Sessions.fair_plan``. Passes repeat while leases are made, so
        sessions that wanted less than their share leave the rest to the others and credit is
        filled when supply allows."""
        out: list[Outgoing] = []
        while True:
            progress = False
            for s, chunk in self.sessions.fair_plan(len(self.ledger.pending) + self.admission.capacity()):
                if chunk > 0 and (lease := self._make_lease(s, now, chunk)) is not None:
                    out.append(Outgoing(s.ident, lease))
                    progress = True
            if not progress:
                return out

    def _make_lease(self, s: Session, now: float, chunk: int) -> Lease | None:
        """Up to ``chunk`` prompts for ``s``: re-issued ones first, then newly admitted ones."""
        n = min(s.wanted, s.max_prompts, self.cfg.max_lease_prompts, chunk)
        items = self.ledger.take_pending(n, set())
        prompts = {self.ledger.prompt_of(i) for i in items}
        while len(items) < n and self.admission.capacity() > 0 and self.order.peek() not in prompts:
            index = self.order.next()
            item = self.admission.admit()
            self.ledger.add(item, index, queue=False)
            items.append(item)
            prompts.add(index)
        if not items:
            return None
        rec = self.ledger.open_lease(s.ident, items, now, self.cfg.lease_timeout_s, self.cfg.lease_max_s,
                                     self.version)
        s.wanted -= len(items)
        self.sessions.stamp(s)
        lease_prompts = tuple(LeasePrompt(p, self.prompts[p].prompt, self.prompts[p].answer) for p in rec.items)
        return Lease(rec.lease_id, self.version, self.cfg.lease_timeout_s, lease_prompts, self.latest)

    # ---- learner calls ----

    def take_batch(self, n_groups: int) -> list[RolloutBatch]:
        """The oldest ``n_groups`` received groups (buffered -> consumed)."""
        if not 1 <= n_groups <= len(self.buffer):
            raise ValueError(f"take_batch({n_groups}) with {len(self.buffer)} groups buffered")
        groups = [self.buffer.popleft() for _ in range(n_groups)]
        for g in groups:
            self.ledger.consume(g.admission_index)
        return groups

    def mark_trained(self, groups: Sequence[RolloutBatch]) -> None:
        """The learner trained on ``groups``; each exactly once, or ``IllegalTransition``."""
        for g in groups:
            self.ledger.finish(g.admission_index, trained=True)

    def mark_dropped(self, groups: Sequence[RolloutBatch]) -> None:
        """Consumed without training (dynamic sampling): admission slots are released."""
        for g in groups:
            self.ledger.finish(g.admission_index, trained=False)
        self.admission.release(len(groups))

    def step_done(self, ann: WeightAnnouncement | None = None, trained: int | None = None) -> None:
        """One optimizer step finished (and published ``ann``, if given) having trained
        ``trained`` groups (None: B): as many slots open (``Admission.step_done``)."""
        if ann is not None:
            self.announce(ann)
        self.admission.step_done(self.admission.batch_groups if trained is None else trained)

    def announce(self, ann: WeightAnnouncement) -> None:
        """A new policy version: leases made from now on require it."""
        if ann.version <= self.version and self.latest is not None:
            raise ValueError(f"announced version {ann.version} is not newer than {self.version}")
        self.version = ann.version
        self.latest = ann
        self.announcements[ann.version] = ann
        while len(self.announcements) > self.cfg.keep_announcements:
            self.announcements.popitem(last=False)

    def weights_root(self) -> str:
        """The trusted weights root told to generators."""
        if self.cfg.weights_root:
            return self.cfg.weights_root
        return str(Path(self.latest.path).parent) if self.latest else ""

    # ---- inspection and persistence ----

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for TensorBoard (``controller/*``, ``transport/*``)."""
        states = self.ledger.state_counts()
        out = {f"controller/{k}": float(v) for k, v in self.ledger.counts.items()}
        out.update({f"controller/{s}": float(states[s]) for s in LIVE_STATES})
        out.update({
            "controller/version": float(self.version),
            "controller/steps_done": float(self.admission.steps_done),
            "controller/admission_capacity": float(self.admission.capacity()),
            "controller/generators": float(len(self.sessions)),
            "controller/epoch": float(self.order.epoch),
        })
        out.update({f"controller/{k}": float(v) for k, v in self.refusals.items()})
        out.update(self.stats.metrics())
        return out

    def accounting(self) -> dict[str, Any]:
        """Exactly-once audit: counters, item states, and the done set (watermark + sparse ids).
        ``issued`` = distinct items admitted; at quiescence issued == trained + dropped."""
        self.ledger.check(self.admission.admitted)
        states = self.ledger.state_counts()
        return {
            **{k: int(v) for k, v in self.ledger.counts.items()},
            "admitted": self.admission.admitted,
            **{s.value: states[s] for s in LIVE_STATES},
            "done_watermark": self.ledger.done_watermark,
            "done_above": sorted(self.ledger.done_above),
        }

    def describe(self) -> str:
        """One line for timeouts and logs: generators, queues, admission, refusals."""
        states = self.ledger.state_counts()
        return (f"{len(self.sessions)} generators, buffered {len(self.buffer)}, leased {states['leased']}, "
                f"pending {states['pending']}, admission capacity {self.admission.capacity()}, "
                f"steps_done {self.admission.steps_done}, version {self.version}"
                + "".join(f", {s.generator_id} refused weights version {s.refused_version}"
                          for s in self.sessions if s.refused_version is not None))

    def state_dict(self) -> dict[str, Any]:
        """msgpack/JSON-safe state for the learner checkpoint."""
        return {
            "format": STATE_FORMAT,
            "version": self.version,
            "latest": self.latest.to_header() if self.latest else None,
            "admission": self.admission.state_dict(),
            "order": self.order.state_dict(),
            "ledger": self.ledger.state_dict(),
            "rejected": dict(self.stats.rejected),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore cursor, counters and version; in-flight prompts of the saved run (leased,
        buffered, handed to the learner but untrained) are re-issued first. Sessions are not
        saved: generators say hello again."""
        if d.get("format") != STATE_FORMAT:
            raise ValueError(f"controller state format {d.get('format')!r} != {STATE_FORMAT}")
        self.admission.load_state_dict(d["admission"])
        self.order.load_state_dict(d["order"])
        self.ledger = Ledger()
        self.ledger.load_state_dict(d["ledger"])
        self.sessions = Sessions()
        self.version = int(d["version"])
        latest = d["latest"]
        self.latest = None if latest is None else WeightAnnouncement(
            int(latest["version"]), str(latest["path"]), str(latest["checksum"]), int(latest["bytes"]),
            tuple(latest["files"]))
        if self.latest is not None:
            self.announcements[self.latest.version] = self.latest
        self.stats.rejected.update({str(k): int(v) for k, v in d["rejected"].items()})
        self.buffer.clear()
