"""The controller's socket thread beside learner rank 0, around the state machine ``state.py``.

Learner-facing API (docs/CONTRACTS.md)::

    ctl = Controller(cfg, prompts, batch_groups=B, eta=eta, vocab_size=V)
    ctl.start()
    groups = ctl.next_batch(B, timeout_s)      # blocks; every group admitted under eta
    ctl.mark_trained(groups)                   # or mark_dropped(filtered) for dynamic sampling
    ctl.step_done(publisher.publish(v, sd))    # step finished + its new policy version (atomic);
                                               # step_done() alone for steps that publish nothing
    ctl.state_dict() / ctl.load_state_dict(d)  # into the Lightning checkpoint (load before start)
    ctl.metrics(); ctl.accounting(); ctl.stop()

This module owns what the state machine must not: the ROUTER for generators, the PUB for weight
announcements (both used only by the thread), the inproc PAIR through which learner calls wake the
thread, the lock shared with the learner thread, and the clock. The thread decodes each message
outside the lock, hands it to ``ControllerState.handle`` under the lock, and sends the replies after
releasing it, never blocking on a generator (see ``ServerSockets`` for back-pressure): a reply that
cannot be sent is counted and reported back (``ControllerState.undelivered``). Invalid messages are
rejected, counted and logged (``stats.py``); any other exception stops the thread and is re-raised
in the learner by ``next_batch``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.state import ControllerState, Outgoing, PromptLike, ReadChunk
from vapo_async.transport.messages import (
    Chunk,
    ErrorReply,
    MessageError,
    RolloutBatch,
    WeightAnnouncement,
    decode_from_generator,
)
from vapo_async.transport.sockets import ServerSockets
from vapo_async.transport.weights import WeightsError, read_chunk

log = logging.getLogger("vapo_async.controller")
_BURST = 256
"""Messages handled in a row before deadlines, credit and announcements get a turn."""


class Controller:
    """The learner's handle on the controller: a ``ControllerState`` served by one socket thread."""

    def __init__(self, cfg: ControllerConfig, prompts: Sequence[PromptLike], batch_groups: int, eta: int,
                 vocab_size: int) -> None:
        self.cfg = cfg
        self.controller_id = uuid.uuid4().hex[:16]
        self.state = ControllerState(cfg, prompts, batch_groups, eta, vocab_size, self.controller_id)
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
        self.state.pub_endpoint = self._sockets.pub_endpoint
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

    @property
    def version(self) -> int:
        """The latest announced policy version."""
        return self.state.version

    # ---- learner API ----

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutBatch]:
        """The next ``n_groups`` received groups (arrival order). Raises ``TimeoutError`` after
        ``timeout_s`` (None = wait forever) and re-raises a failure of the controller thread."""
        if not 1 <= n_groups <= self.state.admission.max_batch():
            raise ValueError(f"n_groups={n_groups} can never be admitted: at most (eta + 1) * B = "
                             f"{self.state.admission.max_batch()} groups are in flight")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while True:
                self._raise_if_failed()
                if len(self.state.buffer) >= n_groups:
                    return self.state.take_batch(n_groups)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"next_batch({n_groups}) timed out after {timeout_s} s: "
                                       f"{self.state.describe()}")
                self._cv.wait(1.0 if left is None else min(left, 1.0))

    def mark_trained(self, groups: Sequence[RolloutBatch]) -> None:
        """The learner trained on ``groups`` (from ``next_batch``); each exactly once, or it raises."""
        with self._lock:
            self.state.mark_trained(groups)

    def mark_dropped(self, groups: Sequence[RolloutBatch]) -> None:
        """The learner consumed ``groups`` without training on them (dynamic sampling); their
        admission slots are released so replacements can be admitted."""
        with self._lock:
            self.state.mark_dropped(groups)
        self._wake()

    def step_done(self, ann: WeightAnnouncement | None = None, trained: int | None = None) -> None:
        """One optimizer step finished, having trained ``trained`` groups (None: B): admission
        opens for as many more (a short step of dynamic sampling opens fewer).

        If the step publishes weights, pass its announcement here (or ``announce`` it first):
        the slots this opens are then leased with the new version, which keeps the staleness
        of every trained token <= eta versions. Calling ``step_done()`` before the announcement
        lets generators start those slots on the previous version (staleness up to eta + 1)."""
        with self._lock:
            self.state.step_done(ann, trained)
            if ann is not None:
                self._to_publish.append(ann)
        self._wake()

    def announce(self, ann: WeightAnnouncement) -> None:
        """A new policy version was published: leases now require it; PUB tells generators."""
        with self._lock:
            self.state.announce(ann)
            self._to_publish.append(ann)
        self._wake()

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for TensorBoard (``controller/*``, ``transport/*``)."""
        with self._lock:
            return self.state.metrics()

    def accounting(self) -> dict[str, Any]:
        """Exactly-once audit (``ControllerState.accounting``)."""
        with self._lock:
            return self.state.accounting()

    def state_dict(self) -> dict[str, Any]:
        """msgpack/JSON-safe state for the learner checkpoint."""
        with self._lock:
            return self.state.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore before ``start()`` (``ControllerState.load_state_dict``)."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        self.state.load_state_dict(d)

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
        router = self._sockets.router
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
            for _ in range(_BURST):
                if not router.poll(0):
                    break
                self._receive(router.recv_multipart(copy=False))
            next_republish = self._publish(next_republish)
            with self._lock:
                out = self.state.tick(time.monotonic())
            self._send_all(out)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """Decode outside the lock, change the state under it, send the replies after it."""
        sender, body = frames[0].bytes, frames[1:]
        try:
            msg = decode_from_generator(body, self.cfg.transport.limits, vocab_size=self.state.vocab_size,
                                        max_version=self.state.version)
        except MessageError as e:
            with self._lock:
                self._count_in(body)
                out = self.state.undecodable(sender, e.reason, e.detail, time.monotonic())
        else:
            with self._lock:
                self._count_in(body)
                out = self.state.handle(sender, msg, time.monotonic())
                if isinstance(msg, RolloutBatch):
                    self._cv.notify_all()  # a group may complete the learner's batch
        self._send_all(out)

    def _count_in(self, body: list[zmq.Frame]) -> None:
        self.state.stats.counts["messages_in"] += 1
        self.state.stats.counts["bytes_in"] += sum(len(f) for f in body)

    def _publish(self, next_republish: float) -> float:
        """Send new announcements on PUB, or re-send the latest every ``republish_s`` (PUB drops
        while a SUB is connecting); returns the next re-send time."""
        assert self._sockets is not None
        with self._lock:
            announcements = list(self._to_publish)
            self._to_publish.clear()
            if not announcements and self.state.latest is not None and time.monotonic() > next_republish:
                announcements = [self.state.latest]  # for subscribers that joined after it was sent
        for ann in announcements:
            self._sockets.pub.send_multipart(ann.to_frames())
            next_republish = time.monotonic() + self.cfg.republish_s
        return next_republish

    def _send_all(self, out: list[Outgoing]) -> None:
        assert self._sockets is not None
        router = self._sockets.router
        for o in out:
            try:
                router.send_multipart([o.to, *self._frames(o)], flags=zmq.NOBLOCK, copy=False)
                continue
            except zmq.Again:
                unroutable = False
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                unroutable = True
            with self._lock:
                self.state.undelivered(o, unroutable)

    def _frames(self, o: Outgoing) -> list:
        """Wire frames of ``o``; a ``ReadChunk`` is read from the weights files here, off the lock."""
        if not isinstance(o.msg, ReadChunk):
            return o.msg.to_frames()
        ann, f = o.msg.ann, o.msg.fetch
        try:
            data, size = read_chunk(ann, f.file, f.offset, f.length)
        except WeightsError as e:
            with self._lock:
                self.state.stats.counts["fetch_errors"] += 1
            return ErrorReply(e.reason, str(e)).to_frames()
        with self._lock:
            self.state.stats.counts["fetch_bytes"] += len(data)
        return Chunk(f.version, f.file, f.offset, size, data).to_frames()
