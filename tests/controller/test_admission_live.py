"""Admission under eta against a simulated learner, over real ipc sockets with scripted generators."""

from __future__ import annotations

import threading
import time

import pytest
from ctl_helpers import run_learner, trained_ids


def _watch_admission(ctl, stop: threading.Event, violations: list[str]) -> None:
    """Check the rule k_next <= (steps_done + eta + 1) * B continuously, under the controller lock."""
    adm = ctl.state.admission
    while not stop.is_set():
        with ctl._lock:
            bound = (adm.steps_done + adm.eta + 1) * adm.batch_groups
            if adm.next_slot() > bound or len(ctl.state.buffer) > adm.max_batch():
                violations.append(f"k_next={adm.next_slot()} bound={bound} buffer={len(ctl.state.buffer)}")
        time.sleep(0.0005)


@pytest.mark.parametrize("eta,learner_delay_s,gen_delay_s", [
    (0, 0.0, 0.0), (1, 0.03, 0.0), (2, 0.03, 0.0), (2, 0.0, 0.004), (4, 0.05, 0.001),
])
def test_staleness_never_exceeds_eta(make_controller, start_generator, eta, learner_delay_s, gen_delay_s) -> None:
    B, steps = 3, 12
    ctl = make_controller(n_prompts=17, batch_groups=B, eta=eta)
    start_generator("g0", group_size=2, max_prompts=4, delay_s=gen_delay_s)  # one FIFO generator
    stop, violations = threading.Event(), []
    watcher = threading.Thread(target=_watch_admission, args=(ctl, stop, violations))
    watcher.start()
    staleness: list[int] = []

    def on_batch(step: int, batch) -> None:
        # consumed at policy version min(step, steps): version s is announced after step s - 1,
        # and the final eta + 1 drain batches take no optimizer step
        staleness.extend(min(step, steps) - g.oldest_version() for g in batch)
        time.sleep(learner_delay_s)

    batches = run_learner(ctl, steps + eta + 1, B, steps=steps, on_batch=on_batch)
    stop.set()
    watcher.join()
    assert violations == []
    assert 0 <= min(staleness) and max(staleness) <= eta
    if learner_delay_s > 0:  # a slow learner: generators run ahead exactly as far as eta allows
        assert max(staleness) == eta
    acc = ctl.accounting()
    # every admitted item trained exactly once: (steps + eta + 1) * B slots, all consumed
    assert acc["admitted"] == acc["trained"] == (steps + eta + 1) * B
    assert trained_ids(batches) == list(range(acc["admitted"]))


def test_eta_zero_is_synchronous(make_controller, start_generator) -> None:
    """eta = 0: batch s holds exactly admission slots [sB, (s+1)B), all sampled by version s, and
    the prompts follow the seeded order exactly as a synchronous loop would take them."""
    B, steps = 4, 6
    ctl = make_controller(n_prompts=10, batch_groups=B, eta=0, seed=7)
    start_generator("g0", group_size=2, max_prompts=8)
    start_generator("g1", group_size=2, max_prompts=8)  # two generators racing: still synchronous
    batches = run_learner(ctl, steps + 1, B, steps=steps)
    from vapo_async.controller.order import PromptOrder
    order = PromptOrder(10, seed=7)
    for s, batch in enumerate(batches):
        assert sorted(g.admission_index for g in batch) == list(range(s * B, (s + 1) * B))
        assert {g.oldest_version() for g in batch} == {s}
        assert sorted(g.prompt_index for g in batch) == sorted(order.next() for _ in range(B))


def test_dynamic_sampling_drops_release_slots(make_controller, start_generator) -> None:
    """A learner that drops half of each batch (dynamic sampling) keeps getting groups."""
    B = 4
    ctl = make_controller(n_prompts=30, batch_groups=B, eta=0)
    start_generator("g0", group_size=2, max_prompts=4)
    for _ in range(5):
        kept = []
        while len(kept) < B:
            got = ctl.next_batch(B - len(kept), 10)
            keep, drop = got[: max(1, len(got) // 2)], got[max(1, len(got) // 2):]
            ctl.mark_dropped(drop)
            kept += keep
        ctl.mark_trained(kept)
        ctl.step_done()
    acc = ctl.accounting()
    assert acc["trained"] == 5 * B and acc["dropped"] > 0
    assert acc["trained"] + acc["dropped"] + acc["buffered"] + acc["leased"] + acc["pending"] == acc["admitted"]


def test_next_batch_larger_than_admission_allows_is_refused(make_controller) -> None:
    ctl = make_controller(batch_groups=4, eta=1)
    with pytest.raises(ValueError, match="at most"):
        ctl.next_batch(9, 0.1)
    with pytest.raises(TimeoutError, match="0 generators"):
        ctl.next_batch(4, 0.05)
