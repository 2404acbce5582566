"""Helpers for controller tests: prompts, fake announcements, a learner stand-in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vapo_async.controller.server import Controller
from vapo_async.transport.messages import RolloutBatch, WeightAnnouncement
from vapo_async.transport.synthetic import ScriptedGenerator

VOCAB = 500


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str
    uid: str = ""


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"What is {i} + {i}?", str(2 * i), f"p{i}") for i in range(n)]


def fake_announcement(version: int) -> WeightAnnouncement:
    return WeightAnnouncement(version, f"/nonexistent/v{version:08d}", "0" * 64, 0, ())


@dataclass
class GeneratorThread:
    """A ``ScriptedGenerator`` running on a thread."""

    gen: ScriptedGenerator
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.gen.run, kwargs={"connect_timeout_s": 20}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.gen.stop_event.set()
        self.thread.join(10)
        self.gen.close()


def run_learner(ctl: Controller, n_batches: int, batch_groups: int, steps: int | None = None,
                on_batch: Callable[[int, list[RolloutBatch]], None] | None = None,
                timeout_s: float = 30.0, first_step: int = 0) -> list[list[RolloutBatch]]:
    """Take ``n_batches`` batches; after each of the first ``steps`` (default all) batches call
    step_done with the next version's announcement (version = steps done), like the real learner.
    Steps are numbered from ``first_step`` (a resumed run)."""
    steps = n_batches if steps is None else steps
    batches = []
    for s in range(first_step, first_step + n_batches):
        batch = ctl.next_batch(batch_groups, timeout_s)
        if on_batch is not None:
            on_batch(s, batch)
        ctl.mark_trained(batch)
        batches.append(batch)
        if s < first_step + steps:
            ctl.step_done(fake_announcement(s + 1))
    return batches


def trained_ids(batches: list[list[RolloutBatch]]) -> list[int]:
    return sorted(g.admission_index for b in batches for g in b)
