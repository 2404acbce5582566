"""GeneratorSupervisor on real processes with a hand-driven clock: a crash is restarted after its
backoff (doubled after a short life), the log is rotated, a clean exit is not restarted, repeated
deaths at start and a spent hourly budget stop the run with the generator's last log lines."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vapo_async.learner.launch import GeneratorHandle, stop_generators
from vapo_async.learner.supervise import GeneratorFailure, GeneratorSupervisor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _spawn(tmp_path: Path, i: int, code: int | None, started_at: float, text: str = "") -> GeneratorHandle:
    """A process that prints ``text`` and exits with ``code`` (None: sleeps until stopped)."""
    path = tmp_path / f"generator-{i}.log"
    f = open(path, "a")  # noqa: SIM115 - closed by stop_generators
    body = f"print({text!r}, flush=True); " + ("import time; time.sleep(600)" if code is None else f"raise SystemExit({code})")
    proc = subprocess.Popen([sys.executable, "-c", body], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return GeneratorHandle(i, f"local-{i}", proc, path, f, started_at)


def _exited(h: GeneratorHandle) -> None:
    h.process.wait(timeout=30)


def test_a_crash_is_restarted_after_its_backoff_with_the_log_rotated(tmp_path):
    clock = Clock()
    first = _spawn(tmp_path, 0, 137, clock.now - 500, "engine OOM")  # lived 500 s: a healthy life
    _exited(first)
    launched: list[GeneratorHandle] = []

    def relaunch(i: int) -> GeneratorHandle:
        launched.append(_spawn(tmp_path, i, None, clock.now, "second life"))
        return launched[-1]

    sup = GeneratorSupervisor([first], relaunch, backoff_s=5.0, max_restarts_per_hour=10, clock=clock)
    sup.check()  # death noticed: restart due at now + 5 s (base backoff after a healthy life)
    assert launched == [] and sup.restarts == 0
    clock.now += 4.9
    sup.check()
    assert launched == []
    clock.now += 0.2
    sup.check()
    assert len(launched) == 1 and sup.handles[0] is launched[0] and sup.restarts == 1
    assert (tmp_path / "generator-0.log.1").read_text().strip() == "engine OOM"
    time.sleep(0.5)
    assert "second life" in (tmp_path / "generator-0.log").read_text()
    stop_generators(sup.handles, 10)


def test_short_lives_double_the_backoff_and_three_in_a_row_stop_the_run(tmp_path):
    clock = Clock()

    def relaunch(i: int) -> GeneratorHandle:
        h = _spawn(tmp_path, i, 1, clock.now, "ValueError: engine.max_model_len too short")
        _exited(h)
        return h

    h = _spawn(tmp_path, 0, 1, clock.now, "ValueError: engine.max_model_len too short")
    _exited(h)
    sup = GeneratorSupervisor([h], relaunch, backoff_s=2.0, max_restarts_per_hour=10, clock=clock)
    sup.check()  # death 1 (quick): due in 2 s
    clock.now += 2.0
    sup.check()  # restart 1
    clock.now += 1.0
    sup.check()  # death 2 (quick): due in 2 * 2 = 4 s
    clock.now += 3.9
    sup.check()
    assert sup.restarts == 1
    clock.now += 0.1
    sup.check()  # restart 2
    assert sup.restarts == 2
    clock.now += 1.0
    with pytest.raises(GeneratorFailure, match=r"(?s)local-0 died 3 times in a row.*max_model_len too short"):
        sup.check()


def test_the_hourly_budget_and_a_clean_exit(tmp_path):
    clock = Clock()
    relaunched: list[GeneratorHandle] = []

    def relaunch(i: int) -> GeneratorHandle:
        relaunched.append(_spawn(tmp_path, i, 9, clock.now - 1000, "crash"))  # each lives "long"
        _exited(relaunched[-1])
        return relaunched[-1]

    h = _spawn(tmp_path, 0, 9, clock.now - 1000, "crash")
    _exited(h)
    sup = GeneratorSupervisor([h], relaunch, backoff_s=1.0, max_restarts_per_hour=2, clock=clock)
    for _ in range(2):  # death, restart, death, restart: the budget of 2 is spent
        sup.check()
        clock.now += 1.0
        sup.check()
        clock.now += 1.0
    with pytest.raises(GeneratorFailure, match=r"after 2 restarts in the last hour \(generators.max_restarts=2\)"):
        sup.check()
    # a generator that left cleanly (exit 0) is not restarted; with none alive the run stops
    clean = _spawn(tmp_path, 1, 0, clock.now, "bye")
    _exited(clean)
    calls: list[int] = []
    sup = GeneratorSupervisor([clean], lambda i: calls.append(i), backoff_s=1.0, max_restarts_per_hour=5, clock=clock)
    with pytest.raises(GeneratorFailure, match="all 1 local generators exited"):
        sup.check()
    assert calls == []


def test_max_restarts_0_keeps_the_old_behaviour(tmp_path):
    clock = Clock()
    alive = _spawn(tmp_path, 0, None, clock.now)
    dead = _spawn(tmp_path, 1, 3, clock.now - 1000, "boom")
    _exited(dead)
    sup = GeneratorSupervisor([alive, dead], lambda i: pytest.fail("restarted"), backoff_s=1.0,
                              max_restarts_per_hour=0, clock=clock)
    clock.now += 100
    sup.check()  # one is still alive: the run goes on without restarting the other
    stop_generators([alive], 10)
    with pytest.raises(GeneratorFailure, match="all 2 local generators exited"):
        sup.check()
