"""Pathological answers and threads: scoring returns a (wrong) reward within a measured time bound.

math-verify's own timeouts use SIGALRM, which fails outside the main thread and cannot interrupt C
code; these tests call from worker threads and feed inputs that hang sympy (checked in a
subprocess below: without the kill they run past 20 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from vapo_async.rewards import RewardConfig, RewardFn, Score, build_reward_fn

# Legitimate slow-path checks take up to ~0.4 s here (\\sqrt{5} vs 2) and several times that
# while other jobs load the 2 cores, so the bound is not set tighter.
TIMEOUT_S = 2.0
# Margin over TIMEOUT_S for one bomb: kill + pipe round trip (ms) and a loaded 2-core machine.
MARGIN_S = 4.0  # killing and restarting the verifier process; generous for loaded CI machines (a hang is >> this)

POWER_TOWER = "Answer: 10^{10^{10^{10}}}"
FACTORIAL = "Answer: (10^{10})!"
PRODUCT = "Answer: \\prod_{i=1}^{10^{7}} i"


@pytest.fixture(scope="module")
def fn() -> Iterator[RewardFn]:
    with build_reward_fn(RewardConfig(timeout_s=TIMEOUT_S, verify_workers=2)) as f:
        f.warmup()  # worker start-up (~0.5-5 s) is outside the per-check bound
        yield f


def _timed(fn: RewardFn, response: str, gold: str = "5") -> tuple[Score, float]:
    t0 = time.perf_counter()
    score = fn(response, gold, 10)
    return score, time.perf_counter() - t0


@pytest.mark.parametrize("bomb", [POWER_TOWER, FACTORIAL, PRODUCT])
def test_sympy_bombs_time_out_as_wrong(fn: RewardFn, bomb: str) -> None:
    fn.warmup()  # the previous bomb's replacement worker must be ready before timing
    before = fn.metrics()["reward/verify_timeout"]
    score, elapsed = _timed(fn, bomb)
    assert score == Score(-1.0, False, True)
    assert fn.metrics()["reward/verify_timeout"] == before + 1
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + MARGIN_S, f"{bomb!r} took {elapsed:.2f} s"
    # the same bomb again is answered from the cache at once
    assert _timed(fn, bomb)[1] < 0.05
    # and the pool still verifies correctly afterwards (a fresh worker replaced the killed one)
    assert fn("Answer: \\sqrt{2}/2", "\\frac{\\sqrt 2}{2}", 10).correct


@pytest.mark.parametrize(
    "response",
    [
        "x" * 2**20,  # 1 MB, no marker
        "x" * 2**20 + "\nAnswer: 5",  # 1 MB with the right answer at the end
        "\\boxed{" + "1" * 2**20 + "}",  # 1 MB boxed answer: too long
        "\\boxed{" + "{" * 2**20,  # 1 MB of unbalanced braces
        "Answer: " + "{" * 100 + "5" + "}" * 100,  # depth 100 > cap
        "\\boxed{" + "\\frac{" * 200 + "1" + "}{2}" * 200 + "}",  # \frac bomb, too long
        "Answer: "
        + "\\frac{" * 12
        + "1"
        + "}{2}" * 12,  # depth 12 = cap: parsed, under the time bound
        "Answer: " + "\\sqrt{" * 13 + "2" + "}" * 13,  # depth 13 > cap
        "Answer: 9" + "9" * 290,  # 300-digit integer: exact fast path
        "\\boxed{\\frac{1}{0}}",
        "Answer: \x00\udcff\u202e",
    ],
)
def test_adversarial_inputs_return_quickly(fn: RewardFn, response: str) -> None:
    fn.warmup()
    score, elapsed = _timed(fn, response)
    assert score.correct == response.endswith("Answer: 5")
    assert elapsed < TIMEOUT_S + MARGIN_S, f"{response[:40]!r}... took {elapsed:.2f} s"


def test_bomb_really_hangs_math_verify_without_the_kill() -> None:
    """The reason for the worker: in-process math-verify (timeouts off) is still busy after 4 s."""
    import subprocess
    import sys

    code = (
        "from math_verify import parse, verify\n"
        "g = parse('$5$', parsing_timeout=None)\n"
        "p = parse('$10^{10^{10^{10}}}$', parsing_timeout=None)\n"
        "verify(g, p, timeout_seconds=None)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=4.0, capture_output=True)


def test_threads_get_correct_bounded_scores(fn: RewardFn) -> None:
    """16 threads score a mix of easy, slow-path and bomb answers; each call is bounded."""
    fn.warmup()
    timeouts_before = fn.metrics()["reward/verify_timeout"]
    cases = [
        ("Answer: 5", "5", True),
        ("Answer: 6", "5", False),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", True),
        ("Answer: 2\\sqrt{3}", "\\sqrt{12}", True),
        ("Answer: 10^{10^{10^{11}}}", "5", False),  # a bomb not yet cached
        ("Answer: \\sqrt{3}", "\\sqrt{2}", False),  # ~0.02 s unloaded (\\sqrt{5} vs 2 takes 0.35 s)
    ] * 8
    with ThreadPoolExecutor(max_workers=16) as ex:
        results = list(ex.map(lambda c: _timed(fn, c[0], c[1]), cases))
    for (response, gold, correct), (score, _) in zip(cases, results, strict=True):
        assert score.correct == correct, (response, gold)
    worst = max(elapsed for _, elapsed in results)
    # The bomb is checked once (its 7 copies wait for it) and holds one worker for TIMEOUT_S; other
    # calls queue behind at most that plus a replacement worker's start-up (~3 s when loaded).
    assert fn.metrics()["reward/verify_timeout"] == timeouts_before + 1
    assert worst < TIMEOUT_S + 10.0, f"worst call {worst:.2f} s"
    print(f"threads: worst call {worst:.2f} s, metrics {fn.metrics()}")


def test_forked_child_uses_its_own_workers(fn: RewardFn) -> None:
    """A process forked after the pool started must neither share nor kill its parent's workers."""
    import os

    fn.warmup()
    parent_procs = [w.proc.pid for w in fn.verifier.pool()._workers]
    pid = os.fork()
    if pid == 0:  # child: a slow-path check, then leave without running pytest's teardown
        ok = fn("Answer: \\sqrt{2}/2", "\\frac{\\sqrt 2}{2}", 1).correct
        child_procs = [w.proc.pid for w in fn.verifier.pool()._workers if w.proc is not None]
        fn.close()
        os._exit(0 if ok and not set(child_procs) & set(parent_procs) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [w.proc.pid for w in fn.verifier.pool()._workers] == parent_procs  # still alive, same
    assert fn("Answer: \\pi/2", "\\frac{\\pi}{2}", 1).correct


def test_orphaned_worker_stuck_in_a_bomb_is_ended_by_its_cpu_limit() -> None:
    """If the parent dies mid-check, nothing kills the worker on time; RLIMIT_CPU does (SIGXCPU)."""
    import json
    import signal
    import subprocess
    import sys

    from vapo_async.rewards.verify import _src_root

    cmd = [sys.executable, "-m", "vapo_async.rewards.worker", "--cpu-s-per-request", "1"]
    env = {"PYTHONPATH": _src_root(), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        proc.stdin.write(json.dumps({"id": 1, "gold": "5", "pred": "5/1 + 0"}) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"id": 1, "equal": True}
        proc.stdin.write(json.dumps({"id": 2, "gold": "5", "pred": "(10^{10})!"}) + "\n")
        proc.stdin.flush()
        # the limit is set 1 + 1 CPU seconds past the CPU used so far (start-up included)
        assert proc.wait(timeout=30) == -signal.SIGXCPU
    finally:
        proc.kill()
        proc.wait()
