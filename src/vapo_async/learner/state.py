"""The run's state: what the learner has done so far, in one typed object.

``LearnerModule`` owns one ``RunState`` and is the only writer of its counters (``training_step``
advances ``step`` and ``version``); ``prepare.build_callbacks`` hands the same object to the
callbacks that report or save the run, which read it instead of attributes of the module:

- ``metrics.TensorBoardMetrics``: ``last`` (the step's record) and ``held_out`` (progress bar);
- ``checkpoint.Checkpointing``: ``step``, ``version`` and the optimiser fingerprints;
- ``evaluation.HeldOutEval``: ``step``, ``version`` and ``weights``; it writes ``held_out``.

The ``Runtime`` reads none of it: it gives the module's ``rollouts`` their source and asks the
module to publish the current version (``publish_current``, which records ``weights``) before it
announces that version. ``rollouts.RolloutBatches`` reads ``step`` and ``version`` at each pull.

The checkpoint's ``vapo`` section is ``to_checkpoint()`` (the module adds the torch RNG state);
``restore`` reads it back on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vapo_async.learner.stream import LocalBatch
from vapo_async.transport.messages import WeightAnnouncement


@dataclass
class StepRecord:
    """What one training step did, for the metrics callback (rank 0 holds the rollout parts)."""

    step: int
    """The step's index (0-based; its metrics are written at x = step + 1)."""
    step_version: int
    """Policy version when the batch was pulled (staleness is measured against it)."""
    warmup: bool
    """The step was a value-pretraining step (critic only)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalars of the step (this rank's; the rollout ones on rank 0)."""
    batch: LocalBatch | None = None
    """This rank's share of the step's batch."""
    behav_weights: torch.Tensor | None = None
    """(N,) pi_prox / pi_behav of this rank's response tokens (histogram)."""


@dataclass
class RunState:
    """Counters and latest records of one run (see the module docstring for who reads what)."""

    step: int = 0
    """Training steps done (= Lightning's ``global_step``)."""
    version: int = 0
    """Policy version of the current actor weights (0 = the base model)."""
    warmup_stopped_at: int | None = None
    """Step at which value pretraining ended early on the explained-variance threshold."""
    weights: WeightAnnouncement | None = None
    """Rank 0: the announcement of ``version``'s published weights (None before the run starts
    and on other ranks)."""
    last: StepRecord | None = None
    """The latest training step's record (None before the first step)."""
    held_out: dict[str, float] | None = None
    """Metrics of the latest finished held-out evaluation (rank 0; None before the first)."""
    optimizer_sha256: str | None = None
    """Fingerprint of the optimiser states at the last save (see checkpoint.py)."""
    restored_optimizer_sha256: str | None = None
    """The fingerprint the checkpoint this run resumed from recorded (None on a fresh run)."""
    stop_signal: int | None = None
    """The signal that asked this run to stop (SIGTERM; ``learner/stopping.py``), None while it runs."""

    def to_checkpoint(self) -> dict[str, Any]:
        """The checkpoint's ``vapo`` section (without the RNG state, which the module adds)."""
        return {"step": self.step, "version": self.version, "warmup_stopped_at": self.warmup_stopped_at,
                "optimizer_sha256": self.optimizer_sha256}

    def restore(self, section: dict[str, Any]) -> None:
        """Read back what ``to_checkpoint`` wrote (on resume)."""
        self.step = int(section["step"])
        self.version = int(section["version"])
        stopped = section["warmup_stopped_at"]
        self.warmup_stopped_at = None if stopped is None else int(stopped)
        self.restored_optimizer_sha256 = section.get("optimizer_sha256")
