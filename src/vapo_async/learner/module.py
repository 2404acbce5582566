"""The LightningModule: actor + critic, manual optimisation, one global batch per training step.

Thin on purpose: the maths lives in ``update.py`` (which calls ``vapo_async.algo``), batch
assembly in ``stream.py``/``batching.py``, weight publishing in ``publish.py``, TensorBoard output
in ``metrics.py`` and the controller/generators in ``runtime.py``.

A training step (every rank):
  pull this rank's share of a global batch -> recompute pi_prox and values -> advantages ->
  PPO epochs over mini-batches (critic only during value pretraining) -> if the actor changed:
  version += 1 and snapshot the weights (written in the background) -> tell the controller the
  step is done once that version is announced (``reports.py``).

Departures (documented choices): AdamW without weight decay (the papers give none); value pretraining (VAPO technique 1) may stop before
``value_warmup_steps`` once the explained variance of a batch reaches
``algo.value_warmup_ev_threshold`` (the paper leaves the stopping rule manual); Lightning's
``global_step`` counts training steps here, not optimizer steps (there are several per step).

Lightning, and where this module steps around it:
- Data: ``train_dataloader`` is a real DataLoader over ``rollouts.RolloutBatches``, an endless
  IterableDataset of this rank's batches, and ``training_step`` takes Lightning's
  ``dataloader_iter``, so that the batch is pulled when the step starts and never prefetched (see
  rollouts.py: a prefetch would deadlock admission control at ``algo.eta = 0``). Lightning marks
  that signature experimental and warns at every fit; those two warnings are filtered here.
  Lightning cannot infer a batch size from such a step: ``self.log`` calls pass ``batch_size=1``.
- State: the run's counters live in one ``state.RunState``; the callbacks get the same object
  from ``__main__.run`` and read it (none reads attributes of this module).
- Workaround, ``advance_global_step``: Lightning's manual optimisation counts
  ``LightningOptimizer.step`` calls as ``global_step``, while one training step here takes a
  variable number of raw optimizer steps (PPO epochs x mini-batches, actor and critic, none on a
  skipped batch) and ``trainer.max_steps``, the checkpoint's ``global_step`` and the progress bar
  must count training steps. Lightning has no public call that counts a step, so this module
  increments the manual-optimisation step counter (``fit_loop.epoch_loop.manual_optimization.
  optim_step_progress``) once per training step; it is saved and restored with the loops' state.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from vapo_async.learner.attention import set_packed_attention
from vapo_async.learner.batching import MicroBatch, collate, padding_micro_batch
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.models import compile_blocks, load_actor, load_critic, shard
from vapo_async.learner.publish import WeightPublishing
from vapo_async.learner.rollouts import RolloutBatches
from vapo_async.learner.state import RunState, StepRecord
from vapo_async.learner.stream import GroupSource, LocalBatch, StreamConfig
from vapo_async.learner.update import (
    Prepared,
    batch_is_finite,
    compute_advantages,
    limit_critic_staleness,
    mismatch,
    ppo_updates,
    recompute,
)
from vapo_async.transport.messages import WeightAnnouncement

log = logging.getLogger("vapo_async.learner")
WEIGHT_DECAY = 0.0
"""AdamW weight decay (the papers do not state one; RL fine-tuning commonly uses none)."""

# Lightning's two notes at every fit that the dataloader_iter signature is experimental (chosen on
# purpose, see above; the step takes exactly one batch, and no callback reads batch_idx)
warnings.filterwarnings("ignore", message="Found `dataloader_iter` argument in the `training_step`")
warnings.filterwarnings("ignore", message="You are using the `dataloader_iter` step flavor")


def advance_global_step(trainer: L.Trainer) -> None:
    """Count one training step in Lightning's ``global_step`` (drives max_steps, the progress bar
    and the checkpoint's ``global_step``). The one workaround of this module: the reason is in
    the module docstring."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()


class LearnerModule(L.LightningModule):
    """Actor/critic learner for every preset (vapo, ppo, grpo, dapo) and VAPO ablation switch."""

    def __init__(self, cfg: LearnerConfig, model_path: str, run_dir: str | Path,
                 source: GroupSource | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.algo = cfg.algo
        self.model_path = str(model_path)
        self.run_dir = Path(run_dir)
        self.state = RunState()
        """The run's counters and latest records (handed to the callbacks by ``__main__.run``)."""
        self.rollouts = RolloutBatches(self.state, source)
        """The training data. Rank 0 needs a ``source`` before ``setup``: ``source`` here
        (offline, tests) or the controller, which the ``Runtime`` callback gives it."""
        self._mismatch_high = False
        """The last ``mismatch/kl`` was above ``logging.mismatch_warn_kl`` (warn once per crossing)."""
        self.publishing: WeightPublishing | None = None
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
        bc = self.cfg.batching
        if bc.packing:
            set_packed_attention((self.actor, self.critic, self.ref),
                                 bc.packed_attention_for(self.trainer.strategy.root_device.type))
        mesh = self._mesh()
        if mesh is not None:
            mp = torch.bfloat16 if str(self.cfg.trainer.precision).startswith("bf16") else None
            for m in (self.actor, self.critic, self.ref):
                if m is not None:
                    shard(m, mesh, mixed_precision=mp)
        if mc.compile:
            for m in (self.actor, self.critic):
                if m is not None:
                    compile_blocks(m)

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

    def train_dataloader(self) -> DataLoader[LocalBatch]:
        return self.rollouts.loader()

    # ---- lifecycle ----

    def setup(self, stage: str) -> None:
        if self.rollouts.stream is not None:
            return
        a = self.algo
        overlong = self.cfg.reward.overlong_band(self.cfg.sampling.max_tokens) if a.overlong_shaping else None
        scfg = StreamConfig(
            batch_groups=a.batch_groups, group_size=a.group_size, eta=a.eta, n_minibatches=a.mini_batches,
            micro_batch_tokens=self.cfg.batching.micro_batch_tokens,
            micro_batch_overhead_tokens=self.cfg.batching.overhead_for(self.trainer.strategy.root_device.type),
            packing=self.cfg.batching.packing, pack_row_tokens=self.cfg.batching.pack_row_tokens,
            dynamic_sampling=a.dynamic_sampling,
            max_sampling_rounds=self.cfg.batching.max_sampling_rounds,
            group_advantage=a.advantage_estimator == "group", overlong=overlong,
            timeout_s=self.cfg.batching.batch_timeout_s, seed=self.cfg.seed)
        self.rollouts.open(scfg, self.global_rank, self.trainer.world_size, self.device)
        w = self.cfg.weights
        self.publishing = WeightPublishing(
            self.run_dir / "weights", self.model_path, self.cfg.checkpoint.keep_weights, self.global_rank,
            self.trainer.world_size, w.torch_dtype(self.cfg.trainer.precision), w.hash, w.fsync,
            int(w.shard_gib * (1 << 30)), w.finalize_timeout_s, w.delta_level if w.delta else None)
        self.publishing.on_published = self._on_published

    def _on_published(self, ann: WeightAnnouncement) -> None:
        """Rank 0, on the weight writer's thread: a submitted version is complete on disk."""
        self.state.weights = ann
        self.rollouts.published(ann)

    def on_train_start(self) -> None:
        assert self.rollouts.stream is not None and self.publishing is not None
        # the start version exists for generators (published by the Runtime, or the base model offline)
        self.publishing.announced = max(self.publishing.announced, self.state.version)
        self.rollouts.stream.device = self.device  # the strategy has moved the module by now
        if self.ref is not None and self._mesh() is None:
            self.ref.to(self.device)

    @property
    def in_value_warmup(self) -> bool:
        """Value pretraining: only the critic trains and nothing is published."""
        return (self.critic is not None and self.state.step < self.algo.value_warmup_steps
                and self.state.warmup_stopped_at is None)

    # ---- the step ----

    def training_step(self, dataloader_iter: Iterator[tuple[LocalBatch, int, int]]) -> None:
        assert self.publishing is not None and self.actor is not None
        state = self.state
        t0 = time.monotonic()
        warmup = self.in_value_warmup
        if self.global_rank == 0:  # never more than eta versions ahead of the announced weights
            self.publishing.wait_published(state.version - self.algo.eta, lambda: state.stop_signal is not None)
        try:
            local, _, _ = next(dataloader_iter)  # pulled now, for this step and version (rollouts.py)
        except StopIteration:  # a stop was requested (rollouts.py): Lightning's loop ends, callbacks run
            self.trainer.should_stop = True
            raise
        t1 = time.monotonic()
        rec = StepRecord(state.step, state.version, warmup, batch=local)
        metrics = rec.metrics
        actor_changed = trained = False
        if not local.empty:
            actor_changed = self._train_on(local, warmup, rec)
            trained = rec.metrics.get("train/skipped_nonfinite_batch") == 0.0
        t2 = time.monotonic()
        if actor_changed:  # the training thread pays only the copy to host (learner/publish.py)
            state.version += 1
            self.publishing.submit(self.actor, state.version)
        self.rollouts.finish(state.version if actor_changed else None)
        t3 = time.monotonic()
        if trained:  # the warm-up counts steps that trained (a skipped batch changed nothing)
            for sched in self._schedulers(warmup):
                sched.step()
        self._maybe_end_warmup(warmup, metrics)
        metrics.update(local.stats)
        tokens = metrics.get("batch/tokens", 0.0) * self.algo.ppo_epochs
        metrics.update({
            "train/step": float(state.step), "train/version": float(state.version),
            "train/value_warmup": float(warmup), "perf/step_s": t3 - t0, "perf/wait_s": t1 - t0,
            "perf/update_s": t2 - t1, "perf/publish_s": t3 - t2,
            **self._weights_metrics(),
            "perf/learner_idle_fraction": (t1 - t0) / max(t3 - t0, 1e-9),
            "perf/learner_tokens_per_s": tokens / max(t2 - t1, 1e-9),
        })
        state.step += 1
        state.last = rec
        advance_global_step(self.trainer)

    def _weights_metrics(self) -> dict[str, float]:
        """``weights/*``: the background writer (rank 0's view)."""
        assert self.publishing is not None
        st, last = self.publishing.stats, self.publishing.last
        return {"weights/write_s": st.last_write_s, "weights/skipped": float(st.skipped),
                "weights/abandoned": float(st.abandoned),
                "weights/lag_versions": float(self.state.version - (last.version if last else 0))}

    def _train_on(self, local: LocalBatch, warmup: bool, rec: StepRecord) -> bool:
        """Recompute, advantages and PPO updates on this rank's share; True if the actor changed."""
        assert self.actor is not None
        mbs = self._micro_batches(local)
        temperature = self.cfg.sampling.temperature
        prep = recompute(self.actor, self.critic, mbs, temperature, self.ref)
        rec.metrics.update(compute_advantages(prep, self.algo))
        if not batch_is_finite(prep):
            log.warning("step %d: non-finite recomputed log-probs/values/advantages: batch skipped", self.state.step)
            rec.metrics["train/skipped_nonfinite_batch"] = 1.0
            return False
        rec.metrics["train/skipped_nonfinite_batch"] = 0.0
        rec.metrics.update(self._mismatch(prep))
        limit_critic_staleness(prep, self.state.version, self.algo.critic_max_staleness)
        weights = [torch.exp(p.logp_prox - p.mb.logp_behav)[p.mask > 0] for p in prep]
        rec.behav_weights = torch.cat(weights).float().cpu() if weights else None
        opts = self._optimizers()
        counters = ppo_updates(
            self.actor, self.critic, None if warmup else opts[0],
            opts[1] if self.critic is not None else None, prep,
            [local.slots(m) for m in range(len(local.n_micro))], local.norms, self.algo, temperature,
            train_actor=not warmup, backward=self.manual_backward, seed=self.cfg.seed * 7919 + self.state.step)
        rec.metrics.update(counters.reduce())
        return counters.actor_steps > 0

    def _mismatch(self, prep: list[Prepared]) -> dict[str, float]:
        """``mismatch/*`` of this step's fresh tokens, and one warning each time the KL rises past
        ``logging.mismatch_warn_kl`` (collective)."""
        out = mismatch(prep, self.state.version, self.algo.behav_cap)
        kl, limit = out.get("mismatch/kl"), self.cfg.logging.mismatch_warn_kl
        if kl is not None and (kl > limit) != self._mismatch_high:
            self._mismatch_high = kl > limit
            if self._mismatch_high:
                log.warning("step %d: generator/learner log-prob mismatch KL %.3g > logging.mismatch_warn_kl=%g at "
                            "equal policy version (max |dlogp| %.3g): check engine.dtype, the sampler, the weights",
                            self.state.step, kl, limit, out["mismatch/abs_logp_max"])
            else:
                log.info("step %d: mismatch KL back to %.3g (<= %g)", self.state.step, kl, limit)
        return out

    def _micro_batches(self, local: LocalBatch) -> list[MicroBatch]:
        """One micro-batch per flat slot (a padding one where this rank has no sequence)."""
        pad_id = self._pad_id()
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(local.micro_slot.tolist()):
            by_slot.setdefault(s, []).append(i)
        rows = local.micro_row.tolist()
        out = []
        for slot in range(sum(local.n_micro)):
            idx = by_slot.get(slot)
            if not idx:
                mb = padding_micro_batch(pad_id)
            else:
                mb = collate(local.seqs, idx, pad_id, [rows[i] for i in idx] if self.cfg.batching.packing else None)
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
            done = self.state.step + 1
            self.state.warmup_stopped_at = done
            metrics["critic/warmup_stopped_at"] = float(done)
            log.warning("value pretraining stopped after %d steps: explained variance %.3f >= %.3f",
                        done, ev, threshold)

    # ---- checkpoint ----

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vapo"] = {**self.state.to_checkpoint(), "torch_rng": torch.get_rng_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        section = checkpoint.get("vapo")
        if section is None:
            raise ValueError("checkpoint has no 'vapo' section: not written by vapo_async.learner")
        self.state.restore(section)
        torch.set_rng_state(section["torch_rng"])

    # ---- weights of the current version ----

    def publish_current(self, resumed: bool) -> WeightAnnouncement | None:
        """Make sure the current policy version is published (a collective; the ``Runtime`` calls
        it at train start) and record its announcement in ``state.weights``; returns rank 0's
        announcement. A fresh run publishes version 0 (the base), so that generators that hold no
        model (another host, no shared filesystem) can start the run; it refuses a run directory
        that holds an earlier run's weights. A resumed run deletes versions newer than its
        checkpoint's and publishes that version again if it was pruned."""
        assert self.publishing is not None and self.actor is not None
        publishing, version = self.publishing, self.state.version
        flags = torch.zeros(2, dtype=torch.int64)  # (missing, earlier run's weights present)
        latest = None
        if self.global_rank == 0:
            if resumed:
                publishing.remove_newer(version)
            else:
                flags[1] = int(bool(publishing.versions()))
            latest = publishing.existing(version)
            flags[0] = int(latest is None)
        if dist.is_available() and dist.is_initialized():
            flags = flags.to(self.device)
            dist.broadcast(flags, src=0)
        if int(flags[1]):
            raise RuntimeError(f"{self.run_dir / 'weights'} holds weight versions of an earlier run: resume it "
                               "(resume=true) or start this one in a new hydra.run.dir")
        if int(flags[0]):
            if resumed:
                log.warning("weights of the restored version %d were pruned: publishing them again", version)
            latest = publishing.publish(self.actor, version)
        self.state.weights = latest
        return latest


def _warmup(steps: int) -> Any:
    """LR multiplier: linear warm-up over ``steps`` scheduler steps, then constant 1."""
    def factor(k: int) -> float:
        return min(1.0, (k + 1) / steps) if steps > 0 else 1.0
    return factor
