"""``ControllerState`` driven without sockets, threads or sleeps: random sequences of generator
messages (hellos, requests, groups incl. duplicates, late, stale and foreign ones, byes, refusals),
lost replies, lease expiries by advancing ``now``, controller restarts from ``state_dict``, and the
learner's next_batch / mark_trained / mark_dropped / step_done. After every event: exactly once
(no item received or trained twice), no lost prompt (every admitted item is done, or in flight in
exactly one re-issuable place) and the eta admission bound. At the end everything is drained and
every admitted item must have ended trained or dropped."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import msgpack
import numpy as np
from ctl_helpers import VOCAB, fake_announcement, prompts
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.items import ItemState
from vapo_async.controller.order import PromptOrder
from vapo_async.controller.state import ControllerState, Outgoing
from vapo_async.transport.messages import (
    Ack,
    Bye,
    ErrorReply,
    Heartbeat,
    Hello,
    Lease,
    Request,
    RolloutBatch,
    WeightsRefused,
    Welcome,
)
from vapo_async.transport.synthetic import random_group

GENERATORS = ("g0", "g1", "g2")
LEASE_S, LEASE_MAX_S = 1.0, 3.0
gens_ = st.sampled_from(GENERATORS)
EVENTS: dict[str, tuple[int, st.SearchStrategy[tuple[Any, ...]]]] = {
    # kind: (weight, arguments)
    "hello": (2, st.tuples(gens_, st.booleans(), st.booleans(), st.integers(1, 4))),
    "request": (3, st.tuples(gens_, st.integers(0, 5))),
    "heartbeat": (2, st.tuples(gens_)),
    "bye": (1, st.tuples(gens_)),
    "refuse": (1, st.tuples(gens_, st.booleans())),
    "group": (4, st.tuples(gens_, st.integers(0, 50), st.booleans(),
                           st.sampled_from(["good", "stale", "wrong_size", "foreign"]))),
    "work": (4, st.tuples(gens_)),
    "tick": (5, st.tuples(st.sampled_from([0.0, 0.1, 0.3, 0.8, 1.5, 3.5]), st.lists(st.booleans(), max_size=3))),
    "take": (4, st.tuples(st.integers(1, 3))),
    "mark": (3, st.tuples(st.integers(1, 3), st.sampled_from([True, True, False]))),
    "learn": (3, st.tuples(st.booleans())),
    "step": (3, st.tuples(st.booleans())),
    "restart": (1, st.tuples()),
}
event_ = st.sampled_from([k for k, (w, _) in EVENTS.items() for _ in range(w)]).flatmap(
    lambda k: EVENTS[k][1].map(lambda args: (k, *args)))


class Gen:
    """What one generator process knows: its routing ids so far, its session, the leases it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.idents: list[bytes] = []
        self.session = 0
        self.leases: dict[int, Lease] = {}

    @property
    def ident(self) -> bytes | None:
        return self.idents[-1] if self.idents else None


class Sim:
    """The controller state machine, three generator models and a learner model around it."""

    def __init__(self, batch_groups: int, eta: int, n_prompts: int, max_lease: int, group_n: int | None) -> None:
        self.cfg = ControllerConfig(lease_timeout_s=LEASE_S, lease_max_s=LEASE_MAX_S, max_lease_prompts=max_lease,
                                    seed=3, sampling={} if group_n is None else {"n": group_n})
        self.args = (prompts(n_prompts), batch_groups, eta, VOCAB)
        self.ctl = ControllerState(self.cfg, *self.args, controller_id="c0")
        self.B, self.eta, self.n = batch_groups, eta, group_n or 2
        self.now = 0.0
        self.gens = {name: Gen(name) for name in GENERATORS}
        order = PromptOrder(n_prompts, 3)
        self.expected_prompt = [order.next() for _ in range(1000)]  # item k carries the k-th prompt of the order
        self.received: set[int] = set()  # items whose group was accepted (in-flight ones leave it on restart)
        self.consumed: list[RolloutBatch] = []  # handed to the learner, not yet marked
        self.trained: list[int] = []
        self.dropped: list[int] = []
        self.hello("g0", True, True, 4)  # one generator from the start, asking for work
        self.request("g0", 4)

    def apply(self, kind: str, *args: Any) -> None:
        getattr(self, kind)(*args)

    # ---- generators ----

    def _send(self, ident: bytes, msg: Any) -> list[Outgoing]:
        """``msg`` from ``ident``; a live generator told ``unknown_session`` says hello again, like
        ``ControllerClient`` (the controller restarted or forgot an idle session)."""
        known = self.ctl.sessions.get(ident) is not None
        out = self.ctl.handle(ident, msg, self.now)
        if not isinstance(msg, Hello | RolloutBatch):
            assert out == ([] if known else [Outgoing(ident, ErrorReply("unknown_session", "say hello first"))])
        if not known and not isinstance(msg, Hello):
            gen = next(g for g in self.gens.values() if ident in g.idents)
            if ident == gen.ident:
                self.hello(gen.name, False, False, 4)
        return out

    def _group(self, name: str, lease: Lease, prompt: int, version: int, size: int) -> RolloutBatch:
        return random_group(np.random.default_rng(prompt), lease_id=lease.lease_id, prompt_index=prompt,
                            generator_id=name, group_size=size, lengths=(1, 3), vocab_size=VOCAB,
                            version=version)

    def hello(self, name: str, new_ident: bool, new_session: bool, max_prompts: int) -> None:
        gen = self.gens[name]
        if new_ident or gen.ident is None:  # a restarted process has a new socket
            gen.idents.append(f"{name}#{len(gen.idents)}".encode())
        gen.session += int(new_session)
        assert gen.ident is not None
        out = self._send(gen.ident, Hello(name, f"s{gen.session}", max_prompts, self.ctl.version))
        assert len(out) == 1 and isinstance(out[0].msg, Welcome) and out[0].msg.version == self.ctl.version
        assert self.ctl.sessions.by_generator[name] == gen.ident

    def request(self, name: str, credit: int) -> None:
        if (ident := self.gens[name].ident) is not None:
            self._send(ident, Request(credit))

    def heartbeat(self, name: str) -> None:
        if (ident := self.gens[name].ident) is not None:
            self._send(ident, Heartbeat())

    def bye(self, name: str) -> None:
        if (ident := self.gens[name].ident) is not None:
            self._send(ident, Bye(tuple(self.gens[name].leases)))

    def refuse(self, name: str, hand_back: bool) -> None:
        gen = self.gens[name]
        if gen.ident is not None:
            returned = tuple(gen.leases) if hand_back else ()
            self._send(gen.ident, WeightsRefused(self.ctl.version + 1, self.ctl.version, "checksum", returned))

    def group(self, name: str, pick: int, old_ident: bool, kind: str) -> None:
        """A group for a prompt this generator was ever leased: maybe a duplicate, late (its lease
        expired), from a previous incarnation (old routing id), stale, of the wrong size or with
        another generator's id."""
        gen = self.gens[name]
        offers = [(lease, p.index) for _, lease in sorted(gen.leases.items()) for p in lease.prompts]
        if not offers:
            return
        lease, prompt = offers[pick % len(offers)]
        version = self.ctl.version if kind != "stale" else max(lease.min_version - 1, 0)
        g = self._group(name if kind != "foreign" else "someone-else", lease, prompt, version,
                        self.n + (kind == "wrong_size"))
        ident = gen.idents[0] if old_ident else gen.ident
        assert ident is not None
        buffered, known = len(self.ctl.buffer), self.ctl.sessions.get(ident) is not None
        (reply,) = self._send(ident, g)
        if isinstance(reply.msg, ErrorReply):
            assert not known and reply.msg.reason == "unknown_session"
            return
        ack = reply.msg
        assert isinstance(ack, Ack) and (ack.lease_id, ack.prompt_index) == (lease.lease_id, prompt)
        event(f"group {kind}: {ack.status}")
        if ack.status != "accepted":
            assert len(self.ctl.buffer) == buffered
            return
        assert (kind == "good" or (kind == "stale" and lease.min_version == 0)
                or (kind == "wrong_size" and "n" not in self.cfg.sampling)), kind
        assert len(self.ctl.buffer) == buffered + 1 and self.ctl.buffer[-1] is g
        self._record_receipts()

    def work(self, name: str) -> None:
        """A healthy generator answers every prompt of every lease it holds, at the current
        version, then asks for more."""
        gen = self.gens[name]
        if gen.ident is None:
            return
        for lease in list(gen.leases.values()):
            for p in lease.prompts:
                self._send(gen.ident, self._group(name, lease, p.index, self.ctl.version, self.n))
            del gen.leases[lease.lease_id]
        self._record_receipts()
        self._send(gen.ident, Request(4))

    def _record_receipts(self) -> None:
        for g in self.ctl.buffer:
            if g.admission_index not in self.received:
                self.received.add(g.admission_index)
                assert g.prompt_index == self.expected_prompt[g.admission_index]

    # ---- clock ----

    def tick(self, dt: float, lost: list[bool]) -> None:
        """Time passes; the leases served are delivered, except those marked lost (full queue)."""
        self.now += dt
        for i, o in enumerate(self.ctl.tick(self.now)):
            assert isinstance(o.msg, Lease) and 1 <= len(o.msg.prompts) <= self.cfg.max_lease_prompts
            assert o.msg.min_version == self.ctl.version
            if i < len(lost) and lost[i]:
                self.ctl.undelivered(o, unroutable=False)
                continue
            for gen in self.gens.values():
                if o.to in gen.idents:
                    gen.leases[o.msg.lease_id] = o.msg

    # ---- learner ----

    def take(self, n: int) -> None:
        n = min(n, len(self.ctl.buffer))
        if n:
            batch = self.ctl.take_batch(n)
            assert all(self.ctl.ledger.state_of(g.admission_index) is ItemState.CONSUMED for g in batch)
            self.consumed += batch

    def mark(self, k: int, train: bool) -> None:
        done, self.consumed = self.consumed[:k], self.consumed[k:]
        (self.ctl.mark_trained if train else self.ctl.mark_dropped)(done)
        (self.trained if train else self.dropped).extend(g.admission_index for g in done)

    def step(self, publish: bool) -> None:
        """An optimizer step, once B groups per step were trained (see
        test_short_step_overfills_the_buffer for what happens otherwise)."""
        if len(self.trained) >= (self.ctl.admission.steps_done + 1) * self.B:
            self.ctl.step_done(fake_announcement(self.ctl.version + 1) if publish else None)

    def learn(self, publish: bool) -> None:
        """A whole learner step: the next batch of up to B groups trained, then step_done."""
        self.take(self.B)
        self.mark(len(self.consumed), True)
        self.step(publish)

    def restart(self) -> None:
        """The learner crashes right after a checkpoint and resumes from it: the groups it held
        untrained are lost with it and re-issued; generators must say hello again."""
        d = json.loads(json.dumps(msgpack.unpackb(msgpack.packb(self.ctl.state_dict()))))
        self.ctl = ControllerState(self.cfg, *self.args, controller_id="c1")
        self.ctl.load_state_dict(d)
        inflight = {int(i) for i, _ in d["ledger"]["inflight"]}
        self.received -= inflight  # pending again: one new receipt each is due
        self.consumed = []
        assert all(self.ctl.ledger.state_of(i) is ItemState.PENDING for i in inflight)

    # ---- invariants ----

    def check(self) -> None:
        adm, led = self.ctl.admission, self.ctl.ledger
        # eta: slot k is admitted only while floor(k / B) <= steps_done + eta <=> k < (steps_done + eta + 1) * B
        assert adm.next_slot() <= (adm.steps_done + self.eta + 1) * self.B
        acc = self.ctl.accounting()  # raises unless every admitted item is in exactly one place
        assert len(set(self.trained)) == len(self.trained) == acc.get("trained", 0)  # exactly once
        assert len(set(self.dropped)) == len(self.dropped) == acc.get("dropped", 0)
        assert not set(self.trained) & set(self.dropped)
        buffered = Counter(g.admission_index for g in self.ctl.buffer)
        consumed = Counter(g.admission_index for g in self.consumed)
        assert set(buffered.values()) <= {1} and set(consumed.values()) <= {1}
        for k in range(adm.admitted):  # nothing lost: each item is done or in flight, re-issuable
            if led.is_done(k):
                assert (k in self.trained) != (k in self.dropped), k
                continue
            assert led.prompt_of(k) == self.expected_prompt[k]
            state = led.state_of(k)
            if state is ItemState.LEASED:  # under an active lease, which expires by its hard deadline
                lease = led.leases[led.items[k].lease_id]  # type: ignore[index]
                assert lease.active and lease.hard_deadline <= self.now + LEASE_MAX_S
            else:
                where = {ItemState.PENDING: k in led.pending, ItemState.BUFFERED: k in buffered,
                         ItemState.CONSUMED: k in consumed}
                assert where[state], f"item {k} is {state} but not where that state keeps it"  # type: ignore[index]

    def drain(self) -> None:
        """One healthy generator and a learner that trains everything; every admitted item must
        end trained or dropped."""
        ctl = self.ctl
        self.now += 2 * LEASE_MAX_S  # every lease of the others is past its hard deadline
        ctl.handle(b"drain#0", Hello("drain", "s", 8, ctl.version), self.now)
        for _ in range(300):
            self.mark(len(self.consumed), True)
            ctl.handle(b"drain#0", Request(8), self.now)
            self.now += 0.1  # the others' fresh leases expire too; drain answers its own at once
            for o in ctl.tick(self.now):
                assert isinstance(o.msg, Lease)
                for p in o.msg.prompts if o.to == b"drain#0" else ():
                    ack = ctl.handle(b"drain#0", self._group("drain", o.msg, p.index, ctl.version, self.n), self.now)
                    assert isinstance(ack[0].msg, Ack) and ack[0].msg.status == "accepted"
            self.take(len(ctl.buffer))
            if not ctl.ledger.items:
                break
        acc = ctl.accounting()
        assert not ctl.ledger.items, f"never drained: {ctl.describe()}"
        assert acc["trained"] + acc.get("dropped", 0) == acc["admitted"] == len(self.trained) + len(self.dropped)
        assert sorted(self.trained + self.dropped) == list(range(acc["admitted"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_groups=st.integers(1, 3), eta=st.integers(0, 2), n_prompts=st.integers(1, 6),
       max_lease=st.integers(1, 3), group_n=st.sampled_from([None, 2]), events=st.lists(event_, min_size=30, max_size=120))
def test_random_event_sequences_keep_exactly_once_no_loss_and_eta(
        batch_groups: int, eta: int, n_prompts: int, max_lease: int, group_n: int | None,
        events: list[tuple[Any, ...]]) -> None:
    sim = Sim(batch_groups, eta, n_prompts, max_lease, group_n)
    for ev in events:
        sim.apply(*ev)
        sim.check()
    counts = sim.ctl.ledger.counts
    for key in ("received", "trained", "dropped", "reissued", "leases_expired", "duplicates", "leases_released"):
        if counts[key]:
            event(f"{key} > 0")
    sim.drain()
