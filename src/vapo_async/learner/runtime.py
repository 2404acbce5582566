"""The asynchronous runtime beside learner rank 0: the controller and the local generators.

A Lightning Callback, so that it follows the Trainer's lifecycle on every rank:
- ``setup``: rank 0 builds the ``Controller`` (not yet started) over the train prompts and gives
  it to the learner's data (``RolloutBatches``, handed over by ``__main__.run``) as its source;
- ``load_state_dict`` (resume): the controller's saved state is kept until ``on_train_start``;
- ``on_train_start``: asks the module to make sure the current policy version is published
  (``LearnerModule.publish_current``, a collective: version 0, the base model, on a fresh run, so
  that generators holding no model can start; a resumed run's restored version again if it was
  pruned). Then rank 0 announces that version, starts the controller and the local generators;
- ``teardown``/``on_exception``: generators get SIGTERM (they hand their leases back), then the
  controller stops. Generators started elsewhere keep running and reconnect to the next learner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from vapo_async.controller.server import Controller
from vapo_async.data import PromptRecord
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.launch import (
    GeneratorHandle,
    launch_generator,
    start_local_generators,
    stop_generators,
)
from vapo_async.learner.module import LearnerModule
from vapo_async.learner.placement import EnginePlacement
from vapo_async.learner.rollouts import RolloutBatches
from vapo_async.learner.supervise import GeneratorSupervisor
from vapo_async.transport.messages import WeightAnnouncement

log = logging.getLogger("vapo_async.learner")


def engine_context(prompts: list[PromptRecord], tokenizer: Any, max_tokens: int) -> int:
    """Longest prompt (tokens) + max_tokens, rounded up to a multiple of 64."""
    longest = max((len(tokenizer.encode(p.prompt)) for p in prompts), default=0)
    return int(math.ceil((longest + max_tokens + 1) / 64) * 64)


@contextlib.contextmanager
def _environment(items: list[str]) -> Iterator[None]:
    """``os.environ`` with ``KEY=VALUE`` items added, restored afterwards."""
    saved = dict(os.environ)
    os.environ.update(dict(item.split("=", 1) for item in items))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Runtime(Callback):
    """Controller and local generators (rank 0); weight-version repair on resume (all ranks)."""

    def __init__(self, cfg: LearnerConfig, model_path: str, run_dir: Path, vocab_size: int, tokenizer: Any,
                 prompts: list[PromptRecord], rollouts: RolloutBatches) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.run_dir = run_dir
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.controller: Controller | None = None
        self.generators: list[GeneratorHandle] = []
        self.supervisor: GeneratorSupervisor | None = None
        """Rank 0: restarts dead local generators (learner/supervise.py)."""
        self._placements: list[EnginePlacement] | None = None
        self.prompts = prompts
        """Rank 0: the train split (loaded by the entry point, so a bad dataset fails before training)."""
        self.rollouts = rollouts
        """The learner's training data: rank 0's gets the controller as its source."""
        self._restored: dict[str, Any] | None = None
        self.flush_weights: Callable[[], None] | None = None
        """The module's ``publishing.flush`` (set at train start): checkpoints wait for it."""

    # ---- Lightning hooks ----

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank != 0 or self.controller is not None:
            return
        cfg = self.cfg
        if not self.prompts:
            raise ValueError(f"data: the train split of {cfg.data.name!r} has no prompts")
        sampling = {"n": cfg.algo.group_size, "temperature": cfg.sampling.temperature,
                    "top_p": cfg.sampling.top_p, "max_tokens": cfg.sampling.max_tokens}
        if cfg.sampling.seed is not None:  # older generators refuse unknown keys: sent only when set
            sampling["seed"] = cfg.sampling.seed
        # the generator contract (welcome): sampling, context and reward settings, one source for all
        ccfg = dataclasses.replace(cfg.controller, sampling=sampling, max_model_len=self.context(),
                                   reward=dataclasses.asdict(cfg.reward),
                                   weights_root=str((self.run_dir / "weights").resolve()))
        self.controller = Controller(ccfg, self.prompts, cfg.algo.batch_groups, cfg.algo.eta, self.vocab_size)
        self.rollouts.source = self.controller
        self.rollouts.health = self.check_generators

    def state_dict(self) -> dict[str, Any]:
        """The controller's state for the checkpoint, after the weight writer has published the
        newest version (its step report then reached the controller: admission matches the step)."""
        if self.flush_weights is not None:
            self.flush_weights()
        return {"controller": self.controller.state_dict()} if self.controller is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("controller")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, LearnerModule):
            raise TypeError(f"Runtime drives a LearnerModule, not a {type(pl_module).__name__}")
        latest = pl_module.publish_current(resumed=trainer.ckpt_path is not None)
        self.flush_weights = pl_module.publishing.flush if pl_module.publishing is not None else None
        if trainer.global_rank != 0:
            return
        assert self.controller is not None and latest is not None
        if self._restored is not None:
            state = dict(self._restored)
            state["latest"] = latest.to_header()
            self.controller.load_state_dict(state)
        else:
            self.controller.announce(latest)  # version 0: generators without a model start from it
        self.controller.start()
        log.info("controller at %s (weights announced on %s)", self.controller.endpoint, self.controller.pub_endpoint)
        from vapo_async.learner.placement import cuda_devices, plan_for_learner

        placement = plan_for_learner(self.cfg, cuda_devices())  # over-committed GPU memory: refused here
        if placement.uses:
            log.info("GPU placement: %s", placement.describe())
        n = self.cfg.generators.local
        if n > 0:
            self._placements = placement.generators or None
            with _environment(self.cfg.generators.env):  # the launcher passes os.environ on
                self.generators = start_local_generators(
                    n, self.controller.endpoint, self._generator_overrides(latest),
                    log_dir=self.run_dir / "generators", placements=self._placements)
            g = self.cfg.generators
            self.supervisor = GeneratorSupervisor(self.generators, self._relaunch, g.restart_backoff_s, g.max_restarts)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.check_generators()  # restarts are due also while the learner is busy

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.shutdown()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.shutdown()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.shutdown()

    # ---- helpers ----

    def shutdown(self) -> None:
        """Stop local generators (SIGTERM, then SIGKILL) and the controller (idempotent)."""
        if self.generators:
            codes = stop_generators(self.generators, self.cfg.generators.stop_timeout_s)
            log.info("local generators exited with %s", codes)
            self.generators = []
        self.supervisor = None
        if self.controller is not None:
            self.controller.stop()

    def check_generators(self) -> None:
        """Rank 0: restart dead local generators when due; raise ``GeneratorFailure`` when they
        cannot be kept running (learner/supervise.py). Called by the stream while it waits for
        rollouts and after every step; nothing while the run stops (the same signal may have
        stopped the generators)."""
        if self.supervisor is not None and self.rollouts.state.stop_signal is None:
            self.supervisor.check()

    def _relaunch(self, i: int) -> GeneratorHandle:
        assert self.controller is not None
        with _environment(self.cfg.generators.env):
            # no model=: the restarted generator takes the current version from its welcome and links
            # it into its own cache before loading, so the learner's pruning of older versions cannot
            # remove the files under it (a model=RUN/weights/vN given here could be pruned while a
            # slow engine starts: the first kill soak lost a restart to that)
            return launch_generator(i, self.controller.endpoint, self._generator_overrides(None, with_model=False),
                                    self.run_dir / "generators",
                                    placement=self._placements[i] if self._placements else None)

    def context(self) -> int:
        """Rank 0: the context generator engines must offer (``generators.max_model_len``, or the
        longest train prompt + ``sampling.max_tokens``); sent in the controller's welcome."""
        cfg = self.cfg
        return cfg.generators.max_model_len or engine_context(self.prompts, self.tokenizer, cfg.sampling.max_tokens)

    def _generator_overrides(self, latest: WeightAnnouncement | None, with_model: bool = True) -> list[str]:
        # sampling, context and reward settings reach every generator in the welcome
        cfg = self.cfg
        model, version = (latest.path, latest.version) if latest is not None and latest.version > 0 \
            else (self.model_path, 0)
        out = [f"model={model}", f"model_version={version}"] if with_model else []
        out += [f"max_prompts={cfg.generators.max_prompts}", f"engine.seed={cfg.seed}",
                f"engine.tensor_parallel_size={cfg.generators.tensor_parallel_size}"]
        if cfg.generators.kv_cache_bytes is not None:
            out.append(f"engine.kv_cache_bytes={cfg.generators.kv_cache_bytes}")
        return out + list(cfg.generators.overrides)

    def controller_metrics(self) -> dict[str, float]:
        """Rank 0: the controller's ``controller/*`` and ``transport/*`` counters and
        ``generators/restarts`` (else empty)."""
        out = self.controller.metrics() if self.controller is not None else {}
        if self.supervisor is not None:
            out["generators/restarts"] = float(self.supervisor.restarts)
        return out
