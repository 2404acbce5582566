"""The sampling loop: leases -> engine requests -> scored groups, with weights applied between steps.

One thread drives everything (the client and the engine are not thread-safe)::

    poll the controller (heartbeats go out here) -> handle leases / announcements / acks / welcomes
    -> apply newer weights if any (between two engine steps) -> start leases whose min_version the
    engine holds -> one engine step -> score and send every finished group -> ask for more credit

Leases. Each prompt of a lease becomes one vLLM request with n = G (request id
``"{lease_id}:{prompt_index}"``). A lease is started only once the engine holds weights of version
>= ``lease.min_version``; until then it waits (its ``weights`` announcement is offered to the
weight subscriber, so the reload happens first). Credit: the loop asks for
``max_prompts - (prompts in flight + waiting)`` after every finished group.

Refused weights. When the weight subscriber refuses the target version (bad checksum, traversal,
failed load, ...) the engine keeps its weights, so leases that need the refused version can never
start: they are handed back at once with ``weights_refused`` (the controller counts the refusal
and re-issues them to generators that can serve them), and no credit is asked for until a version
loads (after the retry back-off, or a newer announcement). Leases that arrive meanwhile for the
refused version are handed back the same way.

Controller restarts. A ``Welcome`` after the first one means a new controller session: every
in-flight request is aborted and waiting leases are dropped (the new controller re-issues them from
its checkpoint), then credit is requested again.

Leaving. ``stop()`` (the SIGTERM handler calls it) ends the loop after the current step; ``close()``
aborts in-flight requests and sends ``bye`` with every unfinished lease so the controller re-issues
them at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zmq

from vapo_async.common.sampling import GroupSamplingConfig, request_seed
from vapo_async.generator.engine import Completion, Engine
from vapo_async.generator.sync import WeightSync
from vapo_async.rewards import Score
from vapo_async.transport.fetch import FetchStats
from vapo_async.transport.messages import (
    Ack,
    ErrorReply,
    GroupInfo,
    Lease,
    LeasePrompt,
    RolloutBatch,
    WeightAnnouncement,
    Welcome,
)

log = logging.getLogger(__name__)


class Client(Protocol):
    """The part of ``vapo_async.transport.client.ControllerClient`` the loop uses."""

    generator_id: str
    version: int
    fetch_stats: FetchStats

    def request(self, credit: int) -> None: ...
    def poll(self, timeout_ms: int) -> list[Lease | WeightAnnouncement | Ack | ErrorReply | Welcome]: ...
    def send_group(self, group: RolloutBatch) -> bool: ...
    def bye(self, return_leases: list[int]) -> None: ...
    def weights_refused(self, version: int, held: int, reason: str, return_leases: list[int]) -> None: ...


class RewardFn(Protocol):
    """``vapo_async.rewards.build_reward_fn(cfg)``."""

    def __call__(self, response: str, ground_truth: str, num_tokens: int) -> Score: ...


@dataclass
class InFlight:
    """A prompt being sampled."""

    lease_id: int
    prompt: LeasePrompt
    started: float


@dataclass
class LoopStats:
    """Counters and throughput of the sampling loop."""

    tokens: int = 0
    """Response tokens sampled in finished groups."""
    groups_sent: int = 0
    groups_dropped: int = 0
    """Finished groups not sent (their lease belonged to a previous controller session)."""
    groups_accepted: int = 0
    groups_rejected: int = 0
    groups_duplicate: int = 0
    leases_handed_back: int = 0
    """Leases returned because they need weights this generator refused."""
    sessions: int = 0
    """Welcomes received (1 + controller restarts)."""
    started_at: float = 0.0


class GeneratorLoop:
    """Runs one generator against one controller; see the module docstring."""

    def __init__(self, client: Client, engine: Engine, weights: WeightSync, reward_fn: RewardFn,
                 sampling: GroupSamplingConfig, max_prompts: int, stats_interval_s: float = 10.0) -> None:
        self.client = client
        self.engine = engine
        self.weights = weights
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.max_prompts = max_prompts
        self.stats_interval_s = stats_interval_s
        self.stats = LoopStats(started_at=time.monotonic())
        self.waiting: deque[tuple[Lease, LeasePrompt]] = deque()
        self.in_flight: dict[str, InFlight] = {}
        self.open_leases: dict[int, int] = {}
        """lease id -> prompts of it not sent yet."""
        self.controller_version = 0
        """Newest policy version the controller is known to hold (welcome, leases, announcements)."""
        self.controller_id: str | None = None
        self._session_lost = False
        self._stop = threading.Event()
        self._last_log = time.monotonic()
        self._tokens_at_log = 0

    # ---- lifecycle ----

    def stop(self) -> None:
        """Ask the loop to finish after the current step (safe from a signal handler)."""
        self._stop.set()

    def run(self, welcome: Welcome) -> None:
        """Serve leases until ``stop()``; ``welcome`` is the answer to the first hello."""
        self.on_welcome(welcome)
        while not self._stop.is_set():
            self.tick()

    def close(self) -> list[int]:
        """Abort in-flight work and hand every unfinished lease back; returns their ids."""
        if self.in_flight:
            self.engine.abort(list(self.in_flight))
        returned = sorted(self.open_leases)
        self.client.bye(returned)
        log.info("leaving: %d leases handed back (%d prompts in flight, %d waiting)",
                 len(returned), len(self.in_flight), len(self.waiting))
        self.in_flight.clear()
        self.waiting.clear()
        self.open_leases.clear()
        return returned

    # ---- one iteration ----

    def tick(self) -> None:
        """Poll, apply weights, start ready leases, run one engine step, send finished groups."""
        busy = self.engine.has_work()
        for msg in self.client.poll(0 if busy else 20):
            self.on_message(msg)
        if self.weights.pending():
            self.apply_weights()
        self.start_ready()
        if self.engine.has_work():
            for completion in self.engine.step():
                self.finish(completion)
        self.maybe_log()

    def apply_weights(self) -> None:
        """Load the target weights (between engine steps); on a refusal tell the controller and hand
        back the leases that need them; after a load ask for credit again."""
        refused = self.weights.stats.refused
        if self.weights.apply():
            self._send(lambda: self.client.request(self.free_capacity()) or True, "credit request")
        elif self.weights.stats.refused > refused:
            self.hand_back_unservable()

    def hand_back_unservable(self) -> None:
        """Return every waiting lease that needs a newer version than the engine holds (none of
        their prompts started) with a ``weights_refused`` report of the refused version."""
        assert self.weights.refused_version is not None
        held = self.engine.version
        ids = sorted({lease.lease_id for lease, _ in self.waiting if lease.min_version > held})
        self.waiting = deque((lease, p) for lease, p in self.waiting if lease.min_version <= held)
        for lease_id in ids:
            self.open_leases.pop(lease_id, None)
        self.stats.leases_handed_back += len(ids)
        version, reason = self.weights.refused_version, self.weights.refused_reason
        log.warning("weights version %d refused (%s): %d leases handed back, no credit asked until a "
                    "version loads", version, reason, len(ids))
        self._send(lambda: self.client.weights_refused(version, held, reason, ids) or True, "weights refusal")

    def on_message(self, msg: Lease | WeightAnnouncement | Ack | ErrorReply | Welcome) -> None:
        if isinstance(msg, Lease):
            self.open_leases[msg.lease_id] = len(msg.prompts)
            self.waiting.extend((msg, p) for p in msg.prompts)
            self.controller_version = max(self.controller_version, msg.min_version)
            self.offer(msg.weights)
            if self.weights.stuck() and msg.min_version > self.engine.version:
                self.hand_back_unservable()  # sent before our report arrived: it needs the refused version
        elif isinstance(msg, WeightAnnouncement):
            self.offer(msg)
        elif isinstance(msg, Welcome):
            self.on_welcome(msg)
        elif isinstance(msg, Ack):
            self.on_ack(msg)
        elif isinstance(msg, ErrorReply):
            self._session_lost |= msg.reason == "unknown_session"  # the client says hello again
            log.warning("controller error: %s %s", msg.reason, msg.detail)

    def offer(self, ann: WeightAnnouncement | None) -> None:
        """A newer version was announced: the weight subscriber loads it before the next step."""
        if ann is not None:
            self.controller_version = max(self.controller_version, ann.version)
            self.weights.offer(ann)

    def on_welcome(self, welcome: Welcome) -> None:
        """Start of a (new) controller session: drop old work, adopt its sampling, ask for credit.
        Repeated welcomes of the same session (hellos queued while the controller was down) are
        ignored."""
        if welcome.controller_id == self.controller_id and not self._session_lost:
            return
        self.controller_id, self._session_lost = welcome.controller_id, False
        if self.stats.sessions:
            log.warning("new controller session (%s): dropping %d in-flight and %d waiting prompts",
                        welcome.controller_id, len(self.in_flight), len(self.waiting))
            if self.in_flight:
                self.engine.abort(list(self.in_flight))
            self.in_flight.clear()
            self.waiting.clear()
            self.open_leases.clear()
        self.stats.sessions += 1
        self.sampling = self.sampling.with_welcome(welcome.sampling)
        if welcome.vocab_size != self.engine.vocab_size:
            raise ValueError(f"controller vocab_size {welcome.vocab_size} != engine vocab size "
                             f"{self.engine.vocab_size} (the model config's vocab_size): generator and "
                             "learner load different models")
        self.controller_version = welcome.version
        self.weights.reset(welcome.version, welcome.weights)  # may go back: a restored learner
        self._send(lambda: self.client.request(self.free_capacity()) or True, "credit request")

    def on_ack(self, ack: Ack) -> None:
        if ack.status == "accepted":
            self.stats.groups_accepted += 1
        elif ack.status == "duplicate":
            self.stats.groups_duplicate += 1
        else:
            self.stats.groups_rejected += 1
            log.warning("group of lease %d prompt %d rejected: %s", ack.lease_id, ack.prompt_index, ack.reason)

    def free_capacity(self) -> int:
        """Prompts this generator can take on now (none while its target weights are refused)."""
        if self.weights.stuck():
            return 0
        return max(0, self.max_prompts - len(self.in_flight) - len(self.waiting))

    def start_ready(self) -> None:
        """Submit waiting prompts whose lease's min_version the engine holds (FIFO); nothing starts
        while the engine is ahead of the controller (a restored learner: the rollback comes first)."""
        if self.engine.version > self.controller_version:
            return
        while self.waiting and self.waiting[0][0].min_version <= self.engine.version:
            lease, prompt = self.waiting.popleft()
            request_id = f"{lease.lease_id}:{prompt.index}"
            seed = None if self.sampling.seed is None else request_seed(self.sampling.seed, prompt.index,
                                                                        self.engine.version)
            self.engine.submit(request_id, prompt.prompt, self.sampling, seed)
            self.in_flight[request_id] = InFlight(lease.lease_id, prompt, time.monotonic())

    def finish(self, c: Completion) -> None:
        """Score a finished request and send it as one group."""
        job = self.in_flight.pop(c.request_id, None)
        if job is None:
            return  # aborted when a new controller session started
        group = self.make_group(job, c)
        self.stats.tokens += int(group.response_lens.sum())
        if self._send(lambda: self.client.send_group(group), "group"):
            self.stats.groups_sent += 1
        else:
            self.stats.groups_dropped += 1
        left = self.open_leases.get(job.lease_id, 0) - 1
        if left > 0:
            self.open_leases[job.lease_id] = left
        else:
            self.open_leases.pop(job.lease_id, None)
        self._send(lambda: self.client.request(self.free_capacity()) or True, "credit request")

    def _send(self, send: Callable[[], bool], what: str) -> bool:
        """Run a blocking send; a controller that stays unreachable past the send timeout costs
        this message (its lease is re-issued), not the generator."""
        try:
            return send()
        except zmq.Again:
            log.warning("controller unreachable: %s not sent (send timeout)", what)
            return False

    def make_group(self, job: InFlight, c: Completion) -> RolloutBatch:
        """The group of ``c`` (a batch of one prompt) with every response scored against the
        lease's answer."""
        scores = [self.reward_fn(r.text, job.prompt.answer, int(r.token_ids.shape[0])) for r in c.responses]
        info = GroupInfo(lease_id=job.lease_id, prompt_index=job.prompt.index, generator_id=self.client.generator_id,
                         gen_time_s=time.monotonic() - job.started,
                         finish_reasons=tuple(r.finish_reason for r in c.responses))
        return RolloutBatch.from_group(
            info,
            prompt_ids=c.prompt_ids,
            response_ids=[r.token_ids for r in c.responses],
            logprobs=[r.logprobs for r in c.responses],
            versions=[r.versions for r in c.responses],
            rewards=np.array([s.reward for s in scores], dtype=np.float32),
            correct=np.array([s.correct for s in scores], dtype=bool),
            truncated=np.array([r.truncated for r in c.responses], dtype=bool),
        )

    # ---- reporting ----

    def snapshot(self) -> dict[str, float]:
        """Counters and throughput for logs (``generator/*``)."""
        elapsed = max(1e-9, time.monotonic() - self.stats.started_at)
        w = self.weights.stats
        return {
            "generator/tokens_per_s": self.stats.tokens / elapsed,
            "generator/tokens": float(self.stats.tokens),
            "generator/groups_sent": float(self.stats.groups_sent),
            "generator/groups_accepted": float(self.stats.groups_accepted),
            "generator/groups_rejected": float(self.stats.groups_rejected),
            "generator/groups_dropped": float(self.stats.groups_dropped),
            "generator/version": float(self.engine.version),
            "generator/weights_applied": float(w.applied),
            "generator/weights_refused": float(w.refused),
            "generator/leases_handed_back": float(self.stats.leases_handed_back),
            "generator/reload_pause_s": w.last_pause_s,
            "generator/in_flight": float(len(self.in_flight)),
            "generator/fetch_controller_bytes": float(self.client.fetch_stats.controller_bytes),
            "generator/fetch_peer_bytes": float(self.client.fetch_stats.peer_bytes),
            "generator/relay_fallbacks": float(sum(self.client.fetch_stats.fallbacks.values())),
        }

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.stats_interval_s:
            return
        rate = (self.stats.tokens - self._tokens_at_log) / (now - self._last_log)
        self._last_log, self._tokens_at_log = now, self.stats.tokens
        s = self.snapshot()
        log.info("%.0f tok/s | version %d | groups sent %d (rejected %d) | weights applied %d refused %d | "
                 "in flight %d, waiting %d", rate, self.engine.version, self.stats.groups_sent,
                 self.stats.groups_rejected, s["generator/weights_applied"], s["generator/weights_refused"],
                 len(self.in_flight), len(self.waiting))
