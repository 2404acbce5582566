"""Supervised local generators: a generator that dies is restarted, with backoff, within a budget.

Rank 0's ``Runtime`` checks its local generators while the learner waits for rollouts (every
``HEALTH_POLL_S``) and after every step. A generator that exited with a non-zero code (a crash,
the OOM killer's SIGKILL, a Python error) is restarted after ``generators.restart_backoff_s``,
doubled for each death that follows a short life (under ``HEALTHY_AFTER_S``), at most 5 minutes.
Its leases were re-issued by the controller when its session expired; the new process joins as
the same generator id with the current policy version and logs to a fresh ``generator-i.log``
(the earlier ones become ``.log.1``, ``.log.2``, ...). ``generators/restarts`` counts restarts.

The run stops (one line, the generator's last log lines quoted) when a generator dies
``START_FAILURES`` times in a row shortly after starting (a setting or an environment it cannot
start with; restarting will not help), or when the restarts of the last hour pass
``generators.max_restarts``. A generator that exits 0 left cleanly (a SIGTERM of its own) and is
not restarted; with none left alive, the run stops as before. ``generators.max_restarts=0`` turns
restarts off.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from vapo_async.learner.launch import GeneratorHandle, rotate_log, stop_generators, tail

log = logging.getLogger("vapo_async.learner")

HEALTHY_AFTER_S = 120.0
"""A generator that lived this long before dying is restarted after the base backoff again."""
START_FAILURES = 3
"""Deaths in a row, each within ``HEALTHY_AFTER_S`` of its start, that stop the run."""
MAX_BACKOFF_S = 300.0


class GeneratorFailure(RuntimeError):
    """Local generators cannot be kept running; the message quotes the last log lines."""


class GeneratorSupervisor:
    """Restarts dead local generators (see the module docstring). Not thread-safe: rank 0's main thread."""

    def __init__(self, handles: list[GeneratorHandle], relaunch: Callable[[int], GeneratorHandle],
                 backoff_s: float, max_restarts_per_hour: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.handles = handles
        self.relaunch = relaunch
        """Starts generator ``i`` again (with the current weights) and returns its handle."""
        self.backoff_s = backoff_s
        self.max_restarts = max_restarts_per_hour
        self.clock = clock
        self.restarts = 0
        """Restarts so far (``generators/restarts``)."""
        self._recent: deque[float] = deque()
        self._quick_deaths = [0] * len(handles)
        self._due: dict[int, float] = {}
        """Generator index -> when its restart is due."""
        self._gone: set[int] = set()
        """Generators that exited and are not restarted (a clean exit, or supervision off)."""

    def check(self) -> None:
        """Notice deaths, restart those whose backoff has passed; raise ``GeneratorFailure`` when
        restarting cannot help or the hourly budget is spent."""
        now = self.clock()
        for i, h in enumerate(self.handles):
            if h.alive() or i in self._gone:
                continue
            if i in self._due:
                if now >= self._due[i]:
                    self._restart(i, now)
                continue
            code = h.process.returncode
            if code == 0 or self.max_restarts <= 0:
                self._gone.add(i)  # left cleanly, or supervision is off
                continue
            self._on_death(i, h, code, now)
        if self.handles and len(self._gone) == len(self.handles):
            h = self.handles[0]
            raise GeneratorFailure(f"all {len(self.handles)} local generators exited (generator 0: code "
                                   f"{h.process.returncode}); last lines of {h.log_path}:\n{tail(h)}")

    def _on_death(self, i: int, h: GeneratorHandle, code: int, now: float) -> None:
        lived = now - h.started_at
        self._quick_deaths[i] = self._quick_deaths[i] + 1 if lived < HEALTHY_AFTER_S else 1
        if self._quick_deaths[i] >= START_FAILURES:
            raise GeneratorFailure(f"generator {h.generator_id} died {self._quick_deaths[i]} times in a row within "
                                   f"{HEALTHY_AFTER_S:.0f} s of starting (last code {code}): not restarting; last "
                                   f"lines of {h.log_path}:\n{tail(h)}")
        while self._recent and now - self._recent[0] > 3600:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            raise GeneratorFailure(f"generator {h.generator_id} died (code {code}) after {len(self._recent)} restarts "
                                   f"in the last hour (generators.max_restarts={self.max_restarts}); last lines of "
                                   f"{h.log_path}:\n{tail(h)}")
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self._quick_deaths[i] - 1))
        self._due[i] = now + delay
        log.warning("generator %s exited with code %s after %.0f s; restarting it in %.0f s", h.generator_id, code,
                    lived, delay)

    def _restart(self, i: int, now: float) -> None:
        old = self.handles[i]
        stop_generators([old], timeout_s=5.0)  # what is left of its process group; closes its log
        rotate_log(old.log_path)
        self.handles[i] = self.relaunch(i)
        del self._due[i]
        self._recent.append(now)
        self.restarts += 1
        log.warning("generator %s restarted (pid %d; restart %d, %d in the last hour); its previous log is %s.1",
                    old.generator_id, self.handles[i].pid, self.restarts, len(self._recent), old.log_path.name)
