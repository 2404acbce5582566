"""The asynchronous runtime beside learner rank 0: the controller and the local generators.

A Lightning Callback, so that it follows the Trainer's lifecycle on every rank:
- ``setup``: rank 0 builds the ``Controller`` (not yet started) over the train prompts and hands it
  to the module as its group source;
- ``load_state_dict`` (resume): the controller's saved state is kept until ``on_train_start``;
- ``on_train_start``: on resume, makes sure the restored policy version is published (weights newer
  than the checkpoint are deleted; the restored version is re-published if it was pruned: a
  collective), then rank 0 restores and starts the controller and the local generators;
- ``teardown``/``on_exception``: generators get SIGTERM (they hand their leases back), then the
  controller stops. Generators started elsewhere keep running and reconnect to the next learner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from vapo_async.controller.server import Controller
from vapo_async.data import PromptRecord
from vapo_async.generator.launch import (
    GeneratorHandle,
    start_local_generators,
    stop_generators,
    tail,
)
from vapo_async.learner.config import LearnerConfig
from vapo_async.rewards import RewardConfig
from vapo_async.transport.messages import WeightAnnouncement

log = logging.getLogger("vapo_async.learner")


def hydra_value(v: Any) -> str:
    """``v`` (nested dicts, lists, scalars) as a Hydra command-line value that parses back to it."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, str):
        # Hydra's quoted strings: backslashes are literal except before a quote or the closing quote
        return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), v) + "'"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v)


def reward_overrides(reward: RewardConfig) -> list[str]:
    """Hydra overrides that give a generator the learner's reward settings."""
    out = []
    for f in dataclasses.fields(reward):
        value = getattr(reward, f.name)
        if f.name == "custom":
            if value is not None:
                out.append(f"reward.custom={hydra_value(value)}")
            continue
        if isinstance(value, list):
            out.append(f"reward.{f.name}=[{','.join(str(v) for v in value)}]")
        else:
            out.append(f"reward.{f.name}={'null' if value is None else value}")
    return out


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
                 prompts: list[PromptRecord]) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.run_dir = run_dir
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.controller: Controller | None = None
        self.generators: list[GeneratorHandle] = []
        self.prompts = prompts
        """Rank 0: the train split (loaded by the entry point, so a bad dataset fails before training)."""
        self._restored: dict[str, Any] | None = None

    # ---- Lightning hooks ----

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank != 0 or self.controller is not None:
            return
        cfg = self.cfg
        if not self.prompts:
            raise ValueError(f"data: the train split of {cfg.data.name!r} has no prompts")
        sampling = {"n": cfg.algo.group_size, "temperature": cfg.sampling.temperature,
                    "top_p": cfg.sampling.top_p, "max_tokens": cfg.sampling.max_tokens}
        ccfg = dataclasses.replace(cfg.controller, sampling=sampling,
                                   weights_root=str((self.run_dir / "weights").resolve()))
        self.controller = Controller(ccfg, self.prompts, cfg.algo.batch_groups, cfg.algo.eta, self.vocab_size)
        pl_module.source = self.controller  # type: ignore[assignment]
        pl_module.stream_health = self.check_generators  # type: ignore[assignment]

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict()} if self.controller is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("controller")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resumed = trainer.ckpt_path is not None
        latest = self._repair_weights(trainer, pl_module) if resumed else None
        if trainer.global_rank != 0:
            return
        assert self.controller is not None
        if self._restored is not None:
            state = dict(self._restored)
            state["latest"] = latest.to_header() if latest is not None else None
            self.controller.load_state_dict(state)
        self.controller.start()
        log.info("controller at %s (weights announced on %s)", self.controller.endpoint, self.controller.pub_endpoint)
        n = self.cfg.generators.local
        if n > 0:
            with _environment(self.cfg.generators.env):  # the launcher passes os.environ on
                self.generators = start_local_generators(
                    n, self.controller.endpoint, self._generator_overrides(latest),
                    log_dir=self.run_dir / "generators")

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
        if self.controller is not None:
            self.controller.stop()

    def check_generators(self) -> None:
        """Raise when every local generator has died (and no remote one is expected to help):
        called by the stream while it waits for rollouts."""
        if self.generators and not any(h.alive() for h in self.generators):
            h = self.generators[0]
            raise RuntimeError(f"all {len(self.generators)} local generators exited (generator 0: code "
                               f"{h.process.returncode}); last lines of {h.log_path}:\n{tail(h)}")

    def _generator_overrides(self, latest: WeightAnnouncement | None) -> list[str]:
        cfg = self.cfg
        ctx = cfg.generators.max_model_len or engine_context(self.prompts, self.tokenizer, cfg.sampling.max_tokens)
        model, version = (latest.path, latest.version) if latest is not None else (self.model_path, 0)
        out = [f"model={model}", f"model_version={version}", f"max_prompts={cfg.generators.max_prompts}",
               f"engine.max_model_len={ctx}", f"engine.seed={cfg.seed}", *reward_overrides(cfg.reward)]
        if cfg.generators.kv_cache_bytes is not None:
            out.append(f"engine.kv_cache_bytes={cfg.generators.kv_cache_bytes}")
        return out + list(cfg.generators.overrides)

    def _repair_weights(self, trainer: L.Trainer, pl_module: L.LightningModule) -> WeightAnnouncement | None:
        """Resume: delete versions newer than the checkpoint's and re-publish its version if it
        was pruned (collective). Returns rank 0's announcement of the restored version."""
        version = int(pl_module.version)  # type: ignore[arg-type]
        publishing = pl_module.publishing  # type: ignore[attr-defined]
        if version == 0:
            if trainer.global_rank == 0:
                publishing.remove_newer(0)
            return None
        missing = torch.zeros(1, dtype=torch.int64)
        latest = None
        if trainer.global_rank == 0:
            publishing.remove_newer(version)
            latest = publishing.existing(version)
            missing[0] = int(latest is None)
        if dist.is_available() and dist.is_initialized():
            missing = missing.to(pl_module.device)
            dist.broadcast(missing, src=0)
        if int(missing[0]):
            log.warning("weights of the restored version %d were pruned: publishing them again", version)
            latest = publishing.publish(pl_module.actor, version)
        return latest
