"""The controller: a thread beside learner rank 0 that owns prompts, versions and admission.

Learner-facing API (docs/CONTRACTS.md)::

    ctl = Controller(cfg, prompts, batch_groups=B, eta=eta, vocab_size=V)
    ctl.start()
    groups = ctl.next_batch(B, timeout_s)      # blocks; every group admitted under eta
    ctl.mark_trained(groups)                   # or mark_dropped(filtered) for dynamic sampling
    ctl.step_done(publisher.publish(v, sd))    # step finished + its new policy version (atomic);
                                               # step_done() alone for steps that publish nothing
    ctl.state_dict() / ctl.load_state_dict(d)  # into the Lightning checkpoint (load before start)
    ctl.metrics(); ctl.accounting(); ctl.stop()

Network side: one ROUTER for generators (hello/request/group/heartbeat/bye/fetch/weights_refused)
and one PUB for weight announcements, both used only by the controller thread. Learner calls take
``_lock`` and wake the thread through an inproc PAIR. The thread never blocks on a generator (see
``ServerSockets`` for back-pressure). Invalid messages are rejected, counted and logged
(``stats.py``); any other exception stops the thread and is re-raised in the learner by
``next_batch``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import zmq

from vapo_async.controller.admission import Admission
from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.handlers import Handlers, Outgoing, Session
from vapo_async.controller.leases import Ledger
from vapo_async.controller.order import PromptOrder
from vapo_async.controller.stats import TransportStats
from vapo_async.transport.messages import Lease, RolloutGroup, WeightAnnouncement
from vapo_async.transport.sockets import ServerSockets

log = logging.getLogger("vapo_async.controller")
STATE_FORMAT = 1


class PromptLike(Protocol):
    """What the controller needs of a prompt record (``vapo_async.data.PromptRecord``)."""

    prompt: str
    answer: str


class Controller(Handlers):
    """Leases prompts to generators under the eta admission rule and collects their groups."""

    def __init__(self, cfg: ControllerConfig, prompts: Sequence[PromptLike], batch_groups: int, eta: int,
                 vocab_size: int) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.vocab_size = vocab_size
        self.controller_id = uuid.uuid4().hex[:16]
        self.admission = Admission(batch_groups, eta)
        self.order = PromptOrder(len(prompts), cfg.seed, cfg.shuffle)
        self.ledger = Ledger()
        self.stats = TransportStats(cfg.log_interval_s)
        self.version = 0
        self.latest: WeightAnnouncement | None = None
        self.announcements: OrderedDict[int, WeightAnnouncement] = OrderedDict()
        self.sessions: dict[bytes, Session] = {}
        self.by_generator: dict[str, bytes] = {}
        self.refusals: Counter[str] = Counter()  # weights_refused[/reason] reports of generators
        self._served = 0  # leases made so far: stamps Session.last_served (fair credit serving)
        self.buffer: deque[RolloutGroup] = deque()
        self._to_publish: deque[WeightAnnouncement] = deque()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._sockets: ServerSockets | None = None
        self._wake_lock = threading.Lock()

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind the sockets (raises on bad/insecure endpoints) and start the controller thread."""
        if self._thread is not None:
            raise RuntimeError("controller already started")
        self._ctx = zmq.Context()
        try:
            self._sockets = ServerSockets(self.cfg.transport, self._ctx)
        except BaseException:
            self._ctx.term()
            raise
        wake_addr = f"inproc://controller-wake-{self.controller_id}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._thread = threading.Thread(target=self._run, name="vapo-controller", daemon=True)
        self._thread.start()
        log.info("controller %s on %s (announcements on %s)", self.controller_id, self.endpoint, self.pub_endpoint)

    def stop(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake()
        self._thread.join()
        self._thread = None
        assert self._sockets is not None and self._ctx is not None
        self._sockets.close()
        self._wake_rx.close(linger=0)
        self._wake_tx.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Controller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """The bound ROUTER address (actual port when an ephemeral one was asked for)."""
        assert self._sockets is not None, "start() first"
        return self._sockets.endpoint

    @property
    def pub_endpoint(self) -> str:
        """The bound PUB address."""
        assert self._sockets is not None, "start() first"
        return self._sockets.pub_endpoint

    # ---- learner API ----

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """The next ``n_groups`` received groups (arrival order). Raises ``TimeoutError`` after
        ``timeout_s`` (None = wait forever) and re-raises a failure of the controller thread."""
        if not 1 <= n_groups <= self.admission.max_batch():
            raise ValueError(f"n_groups={n_groups} can never be admitted: at most (eta + 1) * B = "
                             f"{self.admission.max_batch()} groups are in flight")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while True:
                self._raise_if_failed()
                if len(self.buffer) >= n_groups:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"next_batch({n_groups}) timed out after {timeout_s} s: {self._describe()}")
                self._cv.wait(1.0 if left is None else min(left, 1.0))
            groups = [self.buffer.popleft() for _ in range(n_groups)]
            for g in groups:
                self.ledger.consume(g.admission_index)
        return groups

    def mark_trained(self, groups: Sequence[RolloutGroup]) -> None:
        """The learner trained on ``groups`` (from ``next_batch``); each exactly once, or it raises."""
        with self._lock:
            for g in groups:
                self.ledger.finish(g.admission_index, trained=True)

    def mark_dropped(self, groups: Sequence[RolloutGroup]) -> None:
        """The learner consumed ``groups`` without training on them (dynamic sampling); their
        admission slots are released so replacements can be admitted."""
        with self._lock:
            for g in groups:
                self.ledger.finish(g.admission_index, trained=False)
            self.admission.release(len(groups))
        self._wake()

    def step_done(self, ann: WeightAnnouncement | None = None) -> None:
        """One optimizer step finished: admission opens for B more groups.

        If the step publishes weights, pass its announcement here (or ``announce`` it first):
        the slots this opens are then leased with the new version, which keeps the staleness
        of every trained token <= eta versions. Calling ``step_done()`` before the announcement
        lets generators start those slots on the previous version (staleness up to eta + 1)."""
        with self._lock:
            if ann is not None:
                self._announce_locked(ann)
            self.admission.steps_done += 1
        self._wake()

    def announce(self, ann: WeightAnnouncement) -> None:
        """A new policy version was published: leases now require it; PUB tells generators."""
        with self._lock:
            self._announce_locked(ann)
        self._wake()

    def _announce_locked(self, ann: WeightAnnouncement) -> None:
        if ann.version <= self.version and self.latest is not None:
            raise ValueError(f"announced version {ann.version} is not newer than {self.version}")
        self.version = ann.version
        self.latest = ann
        self.announcements[ann.version] = ann
        while len(self.announcements) > self.cfg.keep_announcements:
            self.announcements.popitem(last=False)
        self._to_publish.append(ann)

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for TensorBoard (``controller/*``, ``transport/*``)."""
        with self._lock:
            states = self.ledger.state_counts()
            out = {f"controller/{k}": float(v) for k, v in self.ledger.counts.items()}
            out.update({f"controller/{s}": float(states[s]) for s in ("pending", "leased", "buffered", "consumed")})
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
        with self._lock:
            self.ledger.check(self.admission.admitted)
            states = self.ledger.state_counts()
            return {
                **{k: int(v) for k, v in self.ledger.counts.items()},
                "admitted": self.admission.admitted,
                **{s: states[s] for s in ("pending", "leased", "buffered", "consumed")},
                "done_watermark": self.ledger.done_watermark,
                "done_above": sorted(self.ledger.done_above),
            }

    def state_dict(self) -> dict[str, Any]:
        """msgpack/JSON-safe state for the learner checkpoint."""
        with self._lock:
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
        """Restore before ``start()``: cursor, counters, version; in-flight prompts of the saved
        run (leased, buffered, handed to the learner but untrained) are re-issued first."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        if d.get("format") != STATE_FORMAT:
            raise ValueError(f"controller state format {d.get('format')!r} != {STATE_FORMAT}")
        self.admission.load_state_dict(d["admission"])
        self.order.load_state_dict(d["order"])
        self.ledger.load_state_dict(d["ledger"])
        self.version = int(d["version"])
        latest = d["latest"]
        self.latest = None if latest is None else WeightAnnouncement(
            int(latest["version"]), str(latest["path"]), str(latest["checksum"]), int(latest["bytes"]),
            tuple(latest["files"]))
        if self.latest is not None:
            self.announcements[self.latest.version] = self.latest
        self.stats.rejected.update({str(k): int(v) for k, v in d["rejected"].items()})
        self.buffer.clear()

    # ---- thread ----

    def _wake(self) -> None:
        if self._thread is None:
            return
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the thread has wake-ups queued already
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"controller thread failed: {self._error!r}") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("controller is not running (start() it first)")

    def _describe(self) -> str:
        states = self.ledger.state_counts()
        return (f"{len(self.sessions)} generators, buffered {len(self.buffer)}, leased {states['leased']}, "
                f"pending {states['pending']}, admission capacity {self.admission.capacity()}, "
                f"steps_done {self.admission.steps_done}, version {self.version}"
                + "".join(f", {s.generator_id} refused weights version {s.refused_version}"
                          for s in self.sessions.values() if s.refused_version is not None))

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # not swallowed: next_batch() re-raises it in the learner thread
            log.exception("controller thread failed")
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _loop(self) -> None:
        assert self._sockets is not None
        router, pub = self._sockets.router, self._sockets.pub
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        tick_ms = max(1, int(self.cfg.tick_s * 1000))
        next_republish = 0.0
        while not self._stop.is_set():
            events = dict(poller.poll(tick_ms))
            if events.get(self._wake_rx):
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            for _ in range(256):  # bounded burst, then deadlines and credits get a turn
                if not router.poll(0):
                    break
                self._handle(router.recv_multipart(copy=False))
            with self._lock:
                announcements = list(self._to_publish)
                self._to_publish.clear()
                if not announcements and self.latest is not None and time.monotonic() > next_republish:
                    announcements = [self.latest]  # for subscribers that joined after it was sent
            for ann in announcements:
                pub.send_multipart(ann.to_frames())
                next_republish = time.monotonic() + self.cfg.republish_s
            self._housekeeping(time.monotonic())

    def _housekeeping(self, now: float) -> None:
        with self._lock:
            for lease in self.ledger.leases.values():
                if lease.active and (lease.deadline < now or lease.hard_deadline < now):
                    session = self.sessions.get(lease.owner)
                    if session is not None:
                        session.suspended = True  # no new work until it shows progress
            if self.ledger.expire(now):
                log.info("re-issuing expired leases: %s", self._describe())
            self._drop_idle_sessions(now)
            out = self._serve_credits(now)
        self._send_all(out)

    def _drop_idle_sessions(self, now: float) -> None:
        idle = [ident for ident, s in self.sessions.items()
                if now - s.last_seen > self.cfg.resolved_session_timeout_s() and not self.ledger.by_owner.get(ident)]
        for ident in idle:
            self._forget_session(ident)

    def _serve_credits(self, now: float) -> list[Outgoing]:
        """Grant credit fairly: each pass splits the supply (re-issuable pending items plus
        admission capacity) evenly among the sessions that want work; the remainder goes to the
        least recently served. Passes repeat while leases are made, so sessions that wanted less
        than their share leave the rest to the others and credit is filled when supply allows."""
        out: list[Outgoing] = []
        while True:
            ready = sorted((s for s in self.sessions.values() if s.wanted > 0 and not s.suspended),
                           key=lambda s: s.last_served)  # stable: ties keep session order
            supply = len(self.ledger.pending) + self.admission.capacity()
            if not ready or supply == 0:
                return out
            share, extra = divmod(supply, len(ready))
            # the ``extra`` sessions that get one more are served (stamped) last, so the next split
            # hands its remainder to the others: over many rounds shares differ by at most one chunk
            plan = [(s, share) for s in ready[extra:]] + [(s, share + 1) for s in ready[:extra]]
            progress = False
            for s, chunk in plan:
                if chunk > 0 and (lease := self._make_lease(s, now, chunk)) is not None:
                    out.append((s.ident, lease.to_frames(), lease.lease_id))
                    progress = True
            if not progress:
                return out

    def _make_lease(self, s: Session, now: float, chunk: int) -> Lease | None:
        n = min(s.wanted, s.max_prompts, self.cfg.max_lease_prompts, chunk)
        items = self.ledger.take_pending(n, set())
        prompts = {self.ledger.prompt[i] for i in items}
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
        self._served += 1
        s.last_served = self._served
        return self._lease_message(rec.lease_id, rec.items)

    def weights_root(self) -> str:
        """The trusted weights root told to generators."""
        if self.cfg.weights_root:
            return self.cfg.weights_root
        return str(Path(self.latest.path).parent) if self.latest else ""
