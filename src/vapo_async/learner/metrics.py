"""TensorBoard output of the learner (rank 0): scalars, histograms, sampled responses, progress bar.

Scalar tags written every step (at least): ``rollout/reward_mean``, ``rollout/accuracy``,
``rollout/response_length_mean``, ``actor/pg_loss``, ``actor/clip_fraction``, ``actor/entropy``,
``actor/behav_weight_mean``, ``actor/nll_loss``, ``critic/value_loss``, ``critic/explained_variance``,
``async/staleness_mean``, ``async/dropped_stale``, ``perf/learner_tokens_per_s``,
``perf/generator_tokens_per_s``, ``perf/learner_idle_fraction``, plus the controller's
``controller/*`` and ``transport/*`` counters (``transport/rejected`` among them). Histograms:
``async/staleness`` (per token) and ``actor/behav_weight`` (pi_prox / pi_behav per token, rank 0's
share). Text: ``samples/responses`` every ``logging.text_every_n_steps``.

The x axis of every tag is the number of training steps completed (step k's metrics at k + 1;
the held-out evaluation of the base model at 0). Metrics a step does not produce (the actor's during value pretraining, the critic's for GRPO) are
not written for that step rather than written as 0.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback

from vapo_async.learner.config import LoggingConfig
from vapo_async.learner.rollout_stats import token_staleness
from vapo_async.learner.state import RunState, StepRecord

REQUIRED_TAGS = (
    "rollout/reward_mean", "rollout/accuracy", "rollout/response_length_mean", "actor/pg_loss",
    "actor/clip_fraction", "actor/entropy", "actor/behav_weight_mean", "actor/nll_loss",
    "critic/value_loss", "critic/explained_variance", "async/staleness_mean", "async/dropped_stale",
    "perf/learner_tokens_per_s", "perf/generator_tokens_per_s", "perf/learner_idle_fraction",
)
"""Tags a VAPO run writes (the issue's list; the end-to-end test checks them)."""

PROGRESS = {"rollout/reward_mean": "reward", "rollout/accuracy": "acc", "train/version": "v",
            "async/staleness_mean": "stale", "perf/generator_tokens_per_s": "tok/s", "eval/accuracy": "eval"}
"""Progress-bar names of a few scalars, in the order the bar shows them (``console.StepProgressBar``)."""


class ThroughputWindow:
    """Tokens per second over the last ``n`` steps (wall time between step ends)."""

    def __init__(self, n: int = 10) -> None:
        self.events: collections.deque[tuple[float, float]] = collections.deque(maxlen=n + 1)

    def add(self, tokens: float, now: float | None = None) -> float | None:
        """Record a step's tokens; the rate over the window (None until two steps were seen)."""
        self.events.append((time.monotonic() if now is None else now, tokens))
        if len(self.events) < 2:
            return None
        span = self.events[-1][0] - self.events[0][0]
        total = sum(t for _, t in list(self.events)[1:])
        return total / span if span > 0 else None


class TensorBoardMetrics(Callback):
    """Writes the run's latest step record (``state.last``) to TensorBoard and the progress bar."""

    def __init__(self, cfg: LoggingConfig, tokenizer: Any, state: RunState,
                 source_metrics: Callable[[], dict[str, float]] | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.state = state
        """The module's run state (step record, held-out metrics)."""
        self.source_metrics = source_metrics
        """Rank 0: the controller's counters, read after every step (``Runtime.controller_metrics``)."""
        self.generated = ThroughputWindow()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        rec = self.state.last
        if rec is None:
            return
        metrics = dict(rec.metrics)
        if trainer.global_rank == 0:
            gen_rate = self.generated.add(metrics.get("rollout/response_tokens", 0.0))
            if gen_rate is not None:
                metrics["perf/generator_tokens_per_s"] = gen_rate
            if self.source_metrics is not None:
                metrics.update(self.source_metrics())
        shown = dict(metrics)
        held_out = self.state.held_out  # the latest held-out accuracy, for the progress bar only
        if held_out is not None and "eval/accuracy" in held_out:
            shown["eval/accuracy"] = held_out["eval/accuracy"]
        for key, name in PROGRESS.items():  # batch_size: one value per step (Lightning cannot infer it
            if key in shown:                # from a step that takes ``dataloader_iter``)
                pl_module.log(name, shown[key], prog_bar=True, logger=False, rank_zero_only=True, batch_size=1)
        if trainer.global_rank != 0 or trainer.logger is None:
            return
        writer = trainer.logger.experiment
        step = rec.step + 1  # x axis = training steps completed (held-out eval uses the same)
        for tag, value in sorted(metrics.items()):
            if np.isfinite(value):
                writer.add_scalar(tag, value, step)
        every = self.cfg.histograms_every_n_steps
        if every > 0 and rec.step % every == 0 and rec.batch is not None:
            self._histograms(writer, rec, step)
        every = self.cfg.text_every_n_steps
        if every > 0 and rec.step % every == 0 and rec.batch is not None and rec.batch.groups:
            writer.add_text("samples/responses", self._samples(rec.batch.groups), step)

    def _histograms(self, writer: Any, rec: StepRecord, step: int) -> None:
        groups = rec.batch.groups if rec.batch is not None else []
        stale = token_staleness(groups, rec.step_version)
        if stale.size:
            writer.add_histogram("async/staleness", stale, step)
        if rec.behav_weights is not None and rec.behav_weights.numel():
            writer.add_histogram("actor/behav_weight", rec.behav_weights.numpy(), step)

    def _samples(self, groups: list[Any]) -> str:
        """Markdown: the first responses of the first groups, with reward and correctness."""
        parts = []
        for g in groups[: self.cfg.text_samples]:
            first = g.response("response_ids", 0)
            prompt = self.tokenizer.decode(np.asarray(g.prompt_ids).tolist(), skip_special_tokens=True)
            resp = self.tokenizer.decode(first.tolist(), skip_special_tokens=True)
            parts.append(f"**prompt** `{prompt[-300:]}`\n\n**response** (reward {float(g.rewards[0]):+.2f}, "
                         f"correct {bool(g.correct[0])}, {len(first)} tokens)\n\n    "
                         + resp.replace("\n", "\n    "))
        return "\n\n---\n\n".join(parts)
