"""A clean stop on SIGTERM: SLURM, Kubernetes and systemd stop jobs with SIGTERM and kill them
after a grace period.

What happens, wherever the learner is when the signal comes:
- the handler (``GracefulStop``, installed on every rank when training starts, in place of
  Lightning's) records the signal in ``RunState.stop_signal`` and logs one line; it does nothing
  else in signal context;
- rank 0 decides: while it waits for rollouts it notices within ``HEALTH_POLL_S`` (stream.py); in an
  update or while publishing, the step finishes and the next batch is not pulled. Either way every
  rank leaves Lightning's fit loop at the same batch (``StopRequested`` -> the data ends ->
  ``training_step`` sets ``should_stop``); the other ranks follow rank 0, whatever signals they got;
- the normal end of training follows: ``Checkpointing`` writes ``last.ckpt`` for the last
  finished step (unless it already holds it), the runtime stops the local generators (they hand
  their leases back) and the controller; then the learner exits 143 (128 + SIGTERM), so that a
  scheduler or a wrapper sees a run that did not finish. Re-running with ``resume=true`` continues;
- a watchdog started by the signal: if the learner is still running ``trainer.stop_grace_s`` later
  (a long update, a hung collective), it stops the local generators, kills the other ranks the
  launcher started and exits 143 at once; ``last.ckpt`` then holds the last complete step (it is
  written to a temporary name and renamed, never half-written).

SIGINT (Ctrl-C) keeps Lightning's KeyboardInterrupt path (``__main__``). A second SIGTERM only
logs again; the watchdog's deadline does not move.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from vapo_async.learner.state import RunState

log = logging.getLogger("vapo_async.learner")

STOP_EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit code of a learner stopped by SIGTERM (clean or by the watchdog): 143."""


class GracefulStop(Callback):
    """Installs the SIGTERM handler for the fit and arms the watchdog (see the module docstring)."""

    def __init__(self, state: RunState, grace_s: float, on_deadline: Callable[[], None]) -> None:
        self.state = state
        self.grace_s = grace_s
        self.on_deadline = on_deadline
        """Rank 0's last acts before the hard exit (the runtime's shutdown: generators, controller)."""
        self._previous: Any = None
        self._timer: threading.Timer | None = None
        self._trainer: L.Trainer | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        if trainer.received_sigterm:  # came before this handler: Lightning's only took note
            self._handle(signal.SIGTERM, None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        state = self.state
        if state.stop_signal is not None:
            log.warning("signal %d again: already stopping (at most %.0f s after the first)", signum, self.grace_s)
            return
        state.stop_signal = signum
        log.warning("signal %d: stopping after step %d (checkpoint, generators stopped, exit %d); "
                    "at most trainer.stop_grace_s=%g s", signum, state.step, STOP_EXIT_CODE, self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._deadline)
        self._timer.daemon = True
        self._timer.start()

    def _deadline(self) -> None:
        log.error("not stopped within trainer.stop_grace_s=%g s: stopping the local generators and exiting "
                  "%d now; last.ckpt holds the last complete checkpoint", self.grace_s, STOP_EXIT_CODE)
        try:
            self.on_deadline()
            launcher = self._trainer.strategy.launcher if self._trainer is not None else None
            if launcher is not None:
                launcher.kill(signal.SIGKILL)  # the other ranks this process started
        finally:
            logging.shutdown()
            os._exit(STOP_EXIT_CODE)
