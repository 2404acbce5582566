"""The LightningModule: actor + critic, manual optimisation, one global batch per training step.

Thin on purpose: the maths lives in ``update.py`` (which calls ``vapo_async.algo``), batch
assembly in ``stream.py``/``batching.py``, weight publishing in ``publish.py``, TensorBoard output
in ``metrics.py`` and the controller/generators in ``runtime.py``.

A training step (every rank):
  pull this rank's share of a global batch -> recompute pi_prox and values -> advantages ->
  PPO epochs over mini-batches (critic only during value pretraining) -> if the actor changed:
  version += 1 and publish the weights -> tell the controller the step is done.

Departures (documented choices): AdamW without weight decay (the papers give none); value pretraining (VAPO technique 1) may stop before
``value_warmup_steps`` once the explained variance of a batch reaches
``algo.value_warmup_ev_threshold`` (the paper leaves the stopping rule manual); Lightning's
``global_step`` counts training steps here, not optimizer steps (there are several per step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from vapo_async.learner.batching import MicroBatch, collate, padding_micro_batch
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.models import load_actor, load_critic, shard
from vapo_async.learner.publish import WeightPublishing
from vapo_async.learner.stream import GroupSource, LocalBatch, RolloutStream, StreamConfig
from vapo_async.learner.update import (
    Prepared,
    batch_is_finite,
    compute_advantages,
    mismatch,
    ppo_updates,
    recompute,
)

log = logging.getLogger("vapo_async.learner")
WEIGHT_DECAY = 0.0
"""AdamW weight decay (the papers do not state one; RL fine-tuning commonly uses none)."""


class _Ticks(IterableDataset):
    """An endless stream of placeholders: the real batch comes from the controller inside the step
    (so that Lightning's one-batch prefetch cannot pull rollouts ahead of admission control)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield torch.zeros(1)


@dataclass
class StepRecord:
    """What one training step did, for the metrics callback (rank 0 holds the rollout parts)."""

    step: int
    step_version: int
    """Policy version when the batch was pulled (staleness is measured against it)."""
    warmup: bool
    metrics: dict[str, float] = field(default_factory=dict)
    batch: LocalBatch | None = None
    behav_weights: torch.Tensor | None = None
    """(N,) pi_prox / pi_behav of this rank's response tokens (histogram)."""


def advance_global_step(trainer: L.Trainer) -> None:
    """Count one training step in Lightning's ``global_step`` (drives max_steps, logging and
    checkpoint names). Lightning counts ``LightningOptimizer.step`` calls in manual optimisation;
    this module steps the raw optimizers several times per training step and counts once here."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()


class LearnerModule(L.LightningModule):
    """Actor/critic learner for every preset (vapo, ppo, grpo, dapo) and VAPO ablation switch."""

    def __init__(self, cfg: LearnerConfig, model_path: str, run_dir: str | Path) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.algo = cfg.algo
        self.model_path = str(model_path)
        self.run_dir = Path(run_dir)
        self.step = 0
        """Training steps done (= global_step)."""
        self.version = 0
        """Policy version of the current actor weights (0 = the base model)."""
        self._mismatch_high = False
        """The last ``mismatch/kl`` was above ``logging.mismatch_warn_kl`` (warn once per crossing)."""
        self.warmup_stopped_at: int | None = None
        """Step at which value pretraining ended early on the explained-variance threshold."""
        self.source: GroupSource | None = None
        """Rank 0: the controller (set by the runtime callback)."""
        self.stream_health: Callable[[], None] | None = None
        """Rank 0: raises while waiting for rollouts when none can come (set by the runtime)."""
        self.stream: RolloutStream | None = None
        self.publishing: WeightPublishing | None = None
        self.last: StepRecord | None = None
        self.optimizer_sha256: str | None = None
        """Fingerprint of the optimiser states at the last save (see checkpoint.py)."""
        self.restored_optimizer_sha256: str | None = None
        self.actor: torch.nn.Module | None = None
        self.critic: torch.nn.Module | None = None
        self._ref: list[torch.nn.Module] = []

    # ---- models and optimisers ----

    def configure_model(self) -> None:
        if self.actor is not None:
            return
        mc = self.cfg.model
        self.actor = load_actor(self.model_path, mc.gradient_checkpointing)
        if self.algo.use_critic:
            self.critic = load_critic(self.model_path, mc.critic_path, mc.gradient_checkpointing)
        if self.algo.kl_coef > 0:  # frozen copy of the initial policy (not a submodule: not saved)
            self._ref = [load_actor(self.model_path).requires_grad_(False).eval()]
        mesh = self._mesh()
        if mesh is not None:
            mp = torch.bfloat16 if str(self.cfg.trainer.precision).startswith("bf16") else None
            for m in (self.actor, self.critic, self.ref):
                if m is not None:
                    shard(m, mesh, mixed_precision=mp)

    @property
    def ref(self) -> torch.nn.Module | None:
        """The frozen reference policy of the KL term (None when algo.kl_coef = 0)."""
        return self._ref[0] if self._ref else None

    def _mesh(self) -> Any:
        """FSDP2 mesh from Lightning's ModelParallelStrategy: 1-D data-parallel (fsdp) or the 2-D
        (data_parallel, tensor_parallel=1) mesh, i.e. replicate-only HSDP (ddp); None otherwise."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, ModelParallelStrategy):
            return None
        mesh = strategy.device_mesh
        return mesh if self.cfg.trainer.strategy == "ddp" else mesh["data_parallel"]

    def configure_optimizers(self) -> Any:
        a = self.algo
        assert self.actor is not None
        # separate AdamW optimisers (the critic moves faster: PAPER.md, vanilla PPO baseline)
        opts = [torch.optim.AdamW(self.actor.parameters(), lr=a.actor_lr, weight_decay=WEIGHT_DECAY)]
        if self.critic is not None:
            opts.append(torch.optim.AdamW(self.critic.parameters(), lr=a.critic_lr, weight_decay=WEIGHT_DECAY))
        # warm-up then constant (PAPER.md: vanilla PPO / DAPO schedules); counted in training steps
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, _warmup(a.warmup_steps)) for o in opts]
        return opts, scheds

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Ticks(), batch_size=None)

    # ---- lifecycle ----

    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        a = self.algo
        overlong = self.cfg.reward.overlong_band(self.cfg.sampling.max_tokens) if a.overlong_shaping else None
        scfg = StreamConfig(
            batch_groups=a.batch_groups, group_size=a.group_size, eta=a.eta, n_minibatches=a.mini_batches,
            micro_batch_tokens=self.cfg.batching.micro_batch_tokens,
            micro_batch_overhead_tokens=self.cfg.batching.overhead_for(self.trainer.strategy.root_device.type),
            dynamic_sampling=a.dynamic_sampling,
            max_sampling_rounds=self.cfg.batching.max_sampling_rounds,
            group_advantage=a.advantage_estimator == "group", overlong=overlong,
            timeout_s=self.cfg.batching.batch_timeout_s, seed=self.cfg.seed)
        self.stream = RolloutStream(scfg, self.source if self.global_rank == 0 else None,
                                    self.global_rank, self.trainer.world_size, self.device, self.stream_health)
        self.publishing = WeightPublishing(self.run_dir / "weights", self.model_path,
                                           self.cfg.checkpoint.keep_weights, self.global_rank)

    def on_train_start(self) -> None:
        assert self.stream is not None
        self.stream.device = self.device  # the strategy has moved the module by now
        if self.ref is not None and self._mesh() is None:
            self.ref.to(self.device)

    @property
    def in_value_warmup(self) -> bool:
        """Value pretraining: only the critic trains and nothing is published."""
        return (self.critic is not None and self.step < self.algo.value_warmup_steps
                and self.warmup_stopped_at is None)

    # ---- the step ----

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        assert self.stream is not None and self.publishing is not None and self.actor is not None
        t0 = time.monotonic()
        warmup = self.in_value_warmup
        local = self.stream.next(self.step, self.version)
        t1 = time.monotonic()
        rec = StepRecord(self.step, self.version, warmup, batch=local)
        metrics = rec.metrics
        actor_changed = trained = False
        if not local.empty:
            actor_changed = self._train_on(local, warmup, rec)
            trained = rec.metrics.get("train/skipped_nonfinite_batch") == 0.0
        t2 = time.monotonic()
        ann = None
        if actor_changed:
            self.version += 1
            ann = self.publishing.publish(self.actor, self.version)
        self.stream.finish(ann)
        t3 = time.monotonic()
        if trained:  # the warm-up counts steps that trained (a skipped batch changed nothing)
            for sched in self._schedulers(warmup):
                sched.step()
        self._maybe_end_warmup(warmup, metrics)
        metrics.update(local.stats)
        tokens = metrics.get("batch/tokens", 0.0) * self.algo.ppo_epochs
        metrics.update({
            "train/step": float(self.step), "train/version": float(self.version),
            "train/value_warmup": float(warmup), "perf/step_s": t3 - t0, "perf/wait_s": t1 - t0,
            "perf/update_s": t2 - t1, "perf/publish_s": t3 - t2,
            "perf/learner_idle_fraction": (t1 - t0) / max(t3 - t0, 1e-9),
            "perf/learner_tokens_per_s": tokens / max(t2 - t1, 1e-9),
        })
        self.step += 1
        self.last = rec
        advance_global_step(self.trainer)

    def _train_on(self, local: LocalBatch, warmup: bool, rec: StepRecord) -> bool:
        """Recompute, advantages and PPO updates on this rank's share; True if the actor changed."""
        assert self.actor is not None
        mbs = self._micro_batches(local)
        temperature = self.cfg.sampling.temperature
        prep = recompute(self.actor, self.critic, mbs, temperature, self.ref)
        rec.metrics.update(compute_advantages(prep, self.algo))
        if not batch_is_finite(prep):
            log.warning("step %d: non-finite recomputed log-probs/values/advantages: batch skipped", self.step)
            rec.metrics["train/skipped_nonfinite_batch"] = 1.0
            return False
        rec.metrics["train/skipped_nonfinite_batch"] = 0.0
        rec.metrics.update(self._mismatch(prep))
        weights = [torch.exp(p.logp_prox - p.mb.logp_behav)[p.mask > 0] for p in prep]
        rec.behav_weights = torch.cat(weights).float().cpu() if weights else None
        opts = self._optimizers()
        counters = ppo_updates(
            self.actor, self.critic, None if warmup else opts[0],
            opts[1] if self.critic is not None else None, prep,
            [local.slots(m) for m in range(len(local.n_micro))], local.norms, self.algo, temperature,
            train_actor=not warmup, backward=self.manual_backward, seed=self.cfg.seed * 7919 + self.step)
        rec.metrics.update(counters.reduce())
        return counters.actor_steps > 0

    def _mismatch(self, prep: list[Prepared]) -> dict[str, float]:
        """``mismatch/*`` of this step's fresh tokens, and one warning each time the KL rises past
        ``logging.mismatch_warn_kl`` (collective)."""
        out = mismatch(prep, self.version, self.algo.behav_cap)
        kl, limit = out.get("mismatch/kl"), self.cfg.logging.mismatch_warn_kl
        if kl is not None and (kl > limit) != self._mismatch_high:
            self._mismatch_high = kl > limit
            if self._mismatch_high:
                log.warning("step %d: generator/learner log-prob mismatch KL %.3g > logging.mismatch_warn_kl=%g at "
                            "equal policy version (max |dlogp| %.3g): check engine.dtype, the sampler, the weights",
                            self.step, kl, limit, out["mismatch/abs_logp_max"])
            else:
                log.info("step %d: mismatch KL back to %.3g (<= %g)", self.step, kl, limit)
        return out

    def _micro_batches(self, local: LocalBatch) -> list[MicroBatch]:
        """One micro-batch per flat slot (a padding one where this rank has no sequence)."""
        pad_id = self._pad_id()
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(local.micro_slot.tolist()):
            by_slot.setdefault(s, []).append(i)
        out = []
        for slot in range(sum(local.n_micro)):
            idx = by_slot.get(slot)
            mb = collate(local.seqs, idx, pad_id) if idx else padding_micro_batch(pad_id)
            out.append(mb.to(self.device))
        return out

    def _pad_id(self) -> int:
        assert self.actor is not None
        cfg = self.actor.config
        return int(cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        return [o.optimizer for o in opts]

    def _schedulers(self, warmup: bool) -> list[Any]:
        """The schedulers to advance this step (the actor's only once it trains)."""
        scheds = self.lr_schedulers()
        scheds = scheds if isinstance(scheds, list) else [scheds]
        return scheds[1:] if warmup else scheds

    def _maybe_end_warmup(self, warmup: bool, metrics: dict[str, float]) -> None:
        threshold = self.algo.value_warmup_ev_threshold
        ev = metrics.get("critic/explained_variance")
        if warmup and threshold is not None and ev is not None and ev >= threshold:
            self.warmup_stopped_at = self.step + 1
            metrics["critic/warmup_stopped_at"] = float(self.step + 1)
            log.warning("value pretraining stopped after %d steps: explained variance %.3f >= %.3f",
                        self.step + 1, ev, threshold)

    # ---- checkpoint ----

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vapo"] = {
            "step": self.step, "version": self.version, "warmup_stopped_at": self.warmup_stopped_at,
            "torch_rng": torch.get_rng_state(),
            "optimizer_sha256": self.optimizer_sha256,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("vapo")
        if state is None:
            raise ValueError("checkpoint has no 'vapo' section: not written by vapo_async.learner")
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.warmup_stopped_at = state["warmup_stopped_at"]
        torch.set_rng_state(state["torch_rng"])
        self.restored_optimizer_sha256 = state.get("optimizer_sha256")


def _warmup(steps: int) -> Any:
    """LR multiplier: linear warm-up over ``steps`` scheduler steps, then constant 1."""
    def factor(k: int) -> float:
        return min(1.0, (k + 1) / steps) if steps > 0 else 1.0
    return factor
