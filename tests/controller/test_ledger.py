"""Lease ledger, prompt order and admission arithmetic (pure, hand-derived values)."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from vapo_async.controller.admission import Admission
from vapo_async.controller.leases import BUFFERED, LEASE_ID_STRIDE, LEASED, PENDING, Ledger
from vapo_async.controller.order import PromptOrder

A, B = b"gen-a", b"gen-b"


def _ledger(n_items: int) -> Ledger:
    led = Ledger()
    for i in range(n_items):
        led.add(i, prompt_index=100 + i)
    return led


def _receive(led: Ledger, lease_id: int, prompt: int, owner: bytes) -> str:
    status, lease = led.lookup(lease_id, prompt, owner)
    if status == "ok":
        assert lease is not None
        led.accept(lease, prompt)
    return status


def test_deadline_reissues_to_the_front_and_heartbeats_extend() -> None:
    led = _ledger(5)
    lease = led.open_lease(A, led.take_pending(3, set()), now=0.0, timeout_s=1.0, max_s=10.0, min_version=0)
    assert sorted(lease.items) == [100, 101, 102] and list(led.pending) == [3, 4]
    led.heartbeat(A, now=0.8, timeout_s=1.0)  # deadline 0.8 + 1.0 = 1.8
    assert led.expire(now=1.5) == 0
    assert led.expire(now=1.9) == 1
    assert list(led.pending) == [0, 1, 2, 3, 4]  # re-issued first, in their original order
    assert led.counts["reissued"] == 3 and all(led.state_of(i) == PENDING for i in range(5))
    led.check(admitted=5)


def test_hard_deadline_beats_heartbeats() -> None:
    led = _ledger(1)
    led.open_lease(A, led.take_pending(1, set()), now=0.0, timeout_s=1.0, max_s=2.0, min_version=0)
    for t in (0.5, 1.0, 1.5, 1.9):
        led.heartbeat(A, now=t, timeout_s=1.0)  # capped at the hard deadline 2.0
        assert led.expire(now=t + 0.05) == 0
    assert led.expire(now=2.01) == 1


def test_late_group_is_accepted_and_the_reissued_copy_is_a_duplicate() -> None:
    led = _ledger(2)
    first = led.open_lease(A, led.take_pending(2, set()), 0.0, 1.0, 10.0, 0)
    led.expire(now=5.0)
    second = led.open_lease(B, led.take_pending(2, set()), 5.0, 1.0, 10.0, 0)
    assert _receive(led, first.lease_id, 100, A) == "ok"  # A was slow, not dead
    assert led.state_of(0) == BUFFERED and led.state_of(1) == LEASED
    assert _receive(led, second.lease_id, 100, B) == "duplicate"
    assert _receive(led, second.lease_id, 101, B) == "ok"
    assert _receive(led, first.lease_id, 101, A) == "duplicate"  # both leases closed now
    assert led.counts["received"] == 2 and led.leases == {}
    led.check(admitted=2)


def test_lookup_rejections() -> None:
    led = _ledger(2)
    lease = led.open_lease(A, led.take_pending(1, set()), 0.0, 1.0, 10.0, 0)
    assert _receive(led, lease.lease_id, 100, B) == "wrong_owner"
    assert _receive(led, lease.lease_id, 101, A) == "not_in_lease"
    assert _receive(led, 999, 100, A) == "unknown_lease"
    assert _receive(led, lease.lease_id, 100, A) == "ok"
    assert _receive(led, lease.lease_id, 100, A) == "duplicate"


def test_refused_group_reissues_immediately() -> None:
    led = _ledger(2)
    lease = led.open_lease(A, led.take_pending(2, set()), 0.0, 1.0, 10.0, 0)
    led.refuse(lease, 101)
    assert list(led.pending) == [1] and led.counts["reissued"] == 1
    assert _receive(led, lease.lease_id, 101, A) == "duplicate"  # no longer expected from this lease
    led.check(admitted=2)


def test_exactly_once_finish_and_watermark() -> None:
    led = _ledger(4)
    lease = led.open_lease(A, led.take_pending(4, set()), 0.0, 1.0, 10.0, 0)
    for p in (100, 101, 102, 103):
        _receive(led, lease.lease_id, p, A)
    for i in (2, 0, 3, 1):
        led.consume(i)
    led.finish(2, trained=True)
    assert (led.done_watermark, led.done_above) == (0, {2})
    led.finish(0, trained=True)
    assert (led.done_watermark, led.done_above) == (1, {2})
    led.finish(3, trained=False)
    led.finish(1, trained=True)
    assert (led.done_watermark, led.done_above) == (4, set())  # everything below 4 done
    assert (led.counts["trained"], led.counts["dropped"]) == (3, 1)
    with pytest.raises(RuntimeError, match="trained twice"):
        led.finish(1, trained=True)
    led.check(admitted=4)


def test_take_pending_keeps_prompts_distinct() -> None:
    led = Ledger()
    for i, p in enumerate([7, 7, 8]):  # the same prompt twice (two epochs)
        led.add(i, p)
    assert led.take_pending(3, set()) == [0, 2]
    assert list(led.pending) == [1]


def test_state_round_trip_reissues_in_flight_first() -> None:
    led = _ledger(6)
    lease = led.open_lease(A, led.take_pending(3, set()), 0.0, 1.0, 10.0, 0)  # items 0-2 leased
    _receive(led, lease.lease_id, 100, A)
    led.consume(0)
    led.finish(0, trained=True)
    _receive(led, lease.lease_id, 101, A)  # item 1 buffered, item 2 leased, items 3-5 pending
    d = json.loads(json.dumps(msgpack.unpackb(msgpack.packb(led.state_dict()))))
    new = Ledger()
    new.load_state_dict(d)
    assert list(new.pending) == [1, 2, 3, 4, 5]
    assert new.counts["reissued"] == 2 and new.done_watermark == 1
    assert new.next_lease_id == led.next_lease_id + LEASE_ID_STRIDE
    new.check(admitted=6)


def test_admission_capacity_hand_derived() -> None:
    adm = Admission(batch_groups=4, eta=2)
    assert adm.capacity() == 12  # (0 + 2 + 1) * 4 - 0
    for k in range(12):
        assert adm.admit() == k
    assert adm.capacity() == 0
    with pytest.raises(RuntimeError, match="beyond eta"):
        adm.admit()
    adm.steps_done = 1
    assert adm.capacity() == 4  # (1 + 2 + 1) * 4 - 12
    adm.release(3)  # three consumed groups dropped by dynamic sampling
    assert adm.capacity() == 7  # 16 - (12 - 3)
    sync = Admission(batch_groups=3, eta=0)
    assert sync.capacity() == 3 and sync.max_batch() == 3


def test_prompt_order_epochs_and_resume() -> None:
    order = PromptOrder(5, seed=3)
    seen = [order.next() for _ in range(15)]
    for e in range(3):
        assert sorted(seen[5 * e: 5 * e + 5]) == [0, 1, 2, 3, 4]  # each epoch visits all once
    assert seen[:5] != seen[5:10] or seen[5:10] != seen[10:15]  # reshuffled per epoch
    assert seen[:5] == list(np.random.default_rng([3, 0]).permutation(5))
    a = PromptOrder(5, seed=3)
    for _ in range(7):
        a.next()
    b = PromptOrder(5, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.next() for _ in range(9)] == [b.next() for _ in range(9)]
    with pytest.raises(ValueError, match="n=5"):
        PromptOrder(6, seed=3).load_state_dict(a.state_dict())
    assert [PromptOrder(4, 0, shuffle=False).next() for _ in range(1)] == [0]
