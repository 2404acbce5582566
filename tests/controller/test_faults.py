"""Faults with real processes: a generator killed with SIGKILL mid-lease; a controller restored
from its checkpoint state while generators keep running. Nothing lost, nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
from ctl_helpers import run_learner, trained_ids

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _spawn_generator(endpoint: str, generator_id: str, delay_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "vapo_async.transport.synthetic", "--endpoint", endpoint, "--id", generator_id,
         "--group-size", "2", "--max-prompts", "4", "--delay", str(delay_s)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _active_leases(ctl, generator_id: str) -> int:
    with ctl._lock:
        ident = ctl.state.sessions.by_generator.get(generator_id)
        return len(ctl.state.ledger.by_owner.get(ident, ())) if ident else 0


def test_sigkill_mid_lease_reissues_and_trains_everything_once(make_controller, start_generator, endpoint) -> None:
    B, steps, eta = 4, 8, 1
    ctl = make_controller(n_prompts=50, batch_groups=B, eta=eta, lease_timeout_s=1.0)
    victim = _spawn_generator(endpoint, "victim", delay_s=0.5)  # slow: holds its lease for 2 s
    try:
        deadline = time.monotonic() + 20
        while _active_leases(ctl, "victim") == 0:
            assert time.monotonic() < deadline and victim.poll() is None, victim.stderr.read().decode()[-2000:]
            time.sleep(0.02)
        start_generator("survivor", group_size=2, max_prompts=4)
        result: list = []
        learner = threading.Thread(target=lambda: result.append(run_learner(ctl, steps + eta + 1, B, steps=steps)))
        learner.start()
        time.sleep(0.3)
        held = _active_leases(ctl, "victim")
        victim.send_signal(signal.SIGKILL)  # mid-lease, no bye
        victim.wait(5)
        learner.join(60)
        assert not learner.is_alive(), "learner stalled after the kill"
    finally:
        if victim.poll() is None:
            victim.kill()
    assert held >= 1
    acc = ctl.accounting()
    assert acc["reissued"] >= 1
    assert acc["admitted"] == acc["trained"] == (steps + eta + 1) * B  # total trained == total issued
    assert trained_ids(result[0]) == list(range(acc["admitted"]))  # each admitted item exactly once
    assert acc["pending"] == acc["leased"] == acc["buffered"] == acc["consumed"] == 0


def test_state_round_trip_then_resume_with_running_generators(make_controller, start_generator, endpoint) -> None:
    B, eta = 3, 1
    a = make_controller(n_prompts=13, batch_groups=B, eta=eta)
    start_generator("g0", group_size=2, max_prompts=3)
    start_generator("g1", group_size=2, max_prompts=3)
    before = run_learner(a, 4, B)  # steps 0-3 trained
    deadline = time.monotonic() + 10
    while a.accounting()["buffered"] == 0:  # make sure rollouts are in flight at the checkpoint
        assert time.monotonic() < deadline
        time.sleep(0.01)
    state = a.state_dict()  # the checkpoint, taken after step 3 like Lightning would
    run_learner(a, 2, B, first_step=4)  # steps 4-5: trained, then lost with the crash
    a.stop()  # "crash" (the generators keep running and reconnect by themselves)

    state = json.loads(json.dumps(msgpack.unpackb(msgpack.packb(state))))  # checkpoint-safe
    b = make_controller(n_prompts=13, batch_groups=B, eta=eta, state=state)
    assert b.version == 4 and b.state.admission.steps_done == 4
    resumed = run_learner(b, 6 + eta + 1, B, steps=6, first_step=4)  # steps 4-9, then drain
    acc = b.accounting()
    ids_a = trained_ids(before)
    ids_b = trained_ids(resumed)
    assert not set(ids_a) & set(ids_b)  # nothing trained twice across the restart
    assert sorted(ids_a + ids_b) == list(range(acc["admitted"]))  # nothing lost
    assert acc["trained"] == acc["admitted"] == (10 + eta + 1) * B
    assert acc["reissued"] >= len(state["ledger"]["inflight"]) > 0  # in-flight work was re-issued
    deadline = time.monotonic() + 10  # both generators rejoined by themselves (heartbeat -> hello)
    while b.metrics()["controller/generators"] < 2:
        assert time.monotonic() < deadline, b.metrics()
        time.sleep(0.05)
