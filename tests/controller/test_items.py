"""Item states and their checked transitions; the checkpoint format of the controller state; one
known limit of the buffer check (hand-derived values)."""

from __future__ import annotations

import json
from itertools import product

import numpy as np
import pytest
from ctl_helpers import VOCAB, prompts

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.items import IllegalTransition, Item, ItemState
from vapo_async.controller.leases import LEASE_ID_STRIDE, Ledger
from vapo_async.controller.state import ControllerState
from vapo_async.transport.messages import Hello, Lease, Request
from vapo_async.transport.synthetic import random_group

P, L, BU, C, T, D = (ItemState.PENDING, ItemState.LEASED, ItemState.BUFFERED, ItemState.CONSUMED,
                     ItemState.TRAINED, ItemState.DROPPED)
LEGAL = {(P, L), (P, BU), (L, P), (L, BU), (BU, C), (C, T), (C, D)}
"""Written out by hand from the life of an item (items.py docstring), not read from TRANSITIONS."""


@pytest.mark.parametrize(("a", "b"), list(product(ItemState, ItemState)), ids=lambda s: s.value)
def test_every_transition_is_legal_exactly_when_the_life_of_an_item_has_it(a: ItemState, b: ItemState) -> None:
    item = Item(7, prompt_index=3, state=a, lease_id=5 if a is L else None)
    lease = 9 if b is L else None
    if (a, b) in LEGAL:
        item.move(b, lease)
        assert (item.state, item.lease_id) == (b, lease)
    else:
        with pytest.raises(IllegalTransition, match=f"^item 7: illegal transition {a.value} -> {b.value}$"):
            item.move(b, lease)
        assert item.state is a  # unchanged


def test_ledger_names_both_states_of_a_double_mark_or_an_early_consume() -> None:
    led = Ledger()
    led.add(0, prompt_index=100)
    with pytest.raises(IllegalTransition, match="item 0: illegal transition pending -> consumed"):
        led.consume(0)
    lease = led.open_lease(b"g", led.take_pending(1, set()), 0.0, 1.0, 10.0, 0)
    led.accept(lease, 100)
    led.consume(0)
    led.finish(0, trained=False)
    with pytest.raises(IllegalTransition, match=r"item 0: illegal transition dropped -> trained \(done already"):
        led.finish(0, trained=True)
    with pytest.raises(IllegalTransition, match="item 5: illegal transition unknown -> trained"):
        led.finish(5, trained=True)


# Written by the controller before the state machine (commit 5a1c64a): B=2, eta=1, 7 prompts, seed 5;
# leases 1 (prompts 1, 4) and 2 (2, 3); lease 1 answered, lease 2 expired and prompt 2 re-leased
# (lease 3); item 0 trained, item 1 handed to the learner; step 1 published version 1.
OLD_CHECKPOINT = json.loads("""{"admission": {"admitted": 4, "batch_groups": 2, "eta": 1, "released": 0,
  "steps_done": 1}, "format": 1, "latest": {"bytes": 10, "checksum": "abababababababababababababababababababababababababababababababab",
  "files": ["model.safetensors"], "path": "/w/v00000001", "version": 1}, "ledger": {"counts": {"issued": 4,
  "leases": 3, "leases_expired": 1, "received": 2, "reissued": 2, "trained": 1}, "done_above": [],
  "done_watermark": 1, "inflight": [[1, 4], [2, 2]], "next_lease_id": 4, "pending": [[3, 3]]},
  "order": {"cursor": 4, "epoch": 0, "n": 7, "seed": 5, "shuffle": true}, "rejected": {"unknown_lease": 2},
  "version": 1}""")


def test_a_checkpoint_of_the_previous_controller_resumes_with_in_flight_items_first() -> None:
    cfg = ControllerConfig(lease_timeout_s=1.0, lease_max_s=5.0, max_lease_prompts=3, seed=5)
    ctl = ControllerState(cfg, prompts(7), batch_groups=2, eta=1, vocab_size=VOCAB, controller_id="c")
    ctl.load_state_dict(OLD_CHECKPOINT)
    d = ctl.state_dict()
    # in flight (items 1, 2) go first, then the pending item 3; 2 more re-issues; lease ids jump
    assert d["ledger"]["pending"] == [[1, 4], [2, 2], [3, 3]] and d["ledger"]["inflight"] == []
    assert d["ledger"]["counts"]["reissued"] == 2 + 2 and d["ledger"]["next_lease_id"] == 4 + LEASE_ID_STRIDE
    # the old checkpoint's fields unchanged; ``shortfall`` (added later) read as 0
    assert d["admission"] == {**OLD_CHECKPOINT["admission"], "shortfall": 0}
    assert {k: v for k, v in d.items() if k not in ("ledger", "admission")} == \
        {k: v for k, v in OLD_CHECKPOINT.items() if k not in ("ledger", "admission")}
    ctl.handle(b"g", Hello("g", "s", 3), 0.0)
    ctl.handle(b"g", Request(3), 0.0)
    (out,) = ctl.tick(0.0)
    # capacity (1 + 1 + 1) * 2 - 4 = 2 new slots, but 3 prompts re-issued first fill the credit of 3
    assert isinstance(out.msg, Lease) and [p.index for p in out.msg.prompts] == [4, 2, 3]
    assert out.msg.lease_id == 4 + LEASE_ID_STRIDE and out.msg.min_version == 1
    assert ctl.admission.admitted == 4


def test_a_short_step_opens_only_the_slots_it_consumed() -> None:
    """A step that trains fewer than B groups (dynamic sampling gave up after max_sampling_rounds)
    opens only as many slots as it trained; before, it opened B and the buffer outgrew
    (eta + 1) * B ("admission is broken", seen in a DAPO ablation run)."""
    B = 2  # eta = 0: at most (0 + 1) * 2 = 2 groups in the buffer
    ctl = ControllerState(ControllerConfig(), prompts(10), batch_groups=B, eta=0, vocab_size=VOCAB, controller_id="c")
    ctl.handle(b"g", Hello("g", "s", 8), 0.0)

    def serve_and_answer() -> None:
        ctl.handle(b"g", Request(8), 0.0)
        for o in ctl.tick(0.0):
            assert isinstance(o.msg, Lease)
            for p in o.msg.prompts:
                ctl.handle(b"g", random_group(np.random.default_rng(0), lease_id=o.msg.lease_id, prompt_index=p.index,
                                              generator_id="g", group_size=2, lengths=(1, 2), vocab_size=VOCAB,
                                              version=0), 0.0)

    serve_and_answer()  # slots 0, 1 -> buffer 2
    ctl.mark_dropped(ctl.take_batch(2))  # all flat: dropped, 2 slots released -> capacity 2
    serve_and_answer()  # buffer 2 again; the learner gives up the round and steps with 0 trained
    ctl.step_done(trained=0)  # shortfall 2 - 0 = 2: capacity (1 + 0 + 1) * 2 - 2 - (4 - 2) = 0
    assert ctl.admission.shortfall == 2 and ctl.admission.capacity() == 0
    serve_and_answer()  # nothing more is leased: the buffer stays at (eta + 1) * B = 2
    assert len(ctl.buffer) == 2
    ctl.mark_trained(ctl.take_batch(2))
    ctl.step_done(trained=2)  # a full step: capacity (2 + 0 + 1) * 2 - 2 - (4 - 2) = 2
    assert ctl.admission.capacity() == 2
