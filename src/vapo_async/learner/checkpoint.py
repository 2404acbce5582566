"""Checkpoints: ``RUN_DIR/checkpoints/last.ckpt`` every N steps and at the end; exact resume.

A Lightning checkpoint holds the actor and critic weights, the optimiser and LR-scheduler states
and the loop counters (``global_step`` = training steps). On top of that:
- the module's ``vapo`` section: the ``RunState`` (step, policy version, value-pretraining state,
  optimiser fingerprint) and the torch RNG state;
- the ``Runtime`` callback's state: the controller's (prompt cursor, leases, admission counters,
  version, exactly-once ledger);
- ``optimizer_sha256``: a sha256 over every rank's optimiser state tensors, computed when saving and
  again right after a resume; the learner logs whether they match (they must, bit for bit).

Saving is atomic: Lightning writes ``last.ckpt.tmp`` (a file, or a directory of shards with
``checkpoint.distributed``), then rank 0 renames it over ``last.ckpt``, so a crash mid-save leaves
the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.resume import LAST as LAST  # re-export: callers import it here
from vapo_async.learner.resume import write_resume_keys
from vapo_async.learner.state import RunState

log = logging.getLogger("vapo_async.learner")



def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_fingerprint(optimizers: list[torch.optim.Optimizer]) -> str:
    """sha256 of all ranks' optimiser states (collective): each rank hashes its local state
    tensors and step counts in parameter order; rank digests are combined in rank order."""
    h = hashlib.sha256()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in sorted(opt.state.get(p, {}).items()):
                    h.update(key.encode())
                    if isinstance(value, torch.Tensor):
                        h.update(_local(value).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                    else:
                        h.update(repr(value).encode())
    digest = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        parts = [torch.zeros(32, dtype=torch.uint8, device=backend_device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, digest.to(backend_device))
        return hashlib.sha256(b"".join(bytes(p.cpu().numpy()) for p in parts)).hexdigest()
    return hashlib.sha256(bytes(digest.numpy())).hexdigest()


def raw_optimizers(module: L.LightningModule) -> list[torch.optim.Optimizer]:
    """The module's optimisers without Lightning's wrappers."""
    opts = module.optimizers()
    opts = opts if isinstance(opts, list) else [opts]
    return [getattr(o, "optimizer", o) for o in opts]


class Checkpointing(Callback):
    """Save ``last.ckpt`` every ``every_n_steps`` training steps and when training ends."""

    def __init__(self, dirpath: Path, every_n_steps: int, fingerprint: bool, state: RunState,
                 cfg: LearnerConfig | None = None) -> None:
        self.dirpath = Path(dirpath)
        self.cfg = cfg
        """Written beside each checkpoint as ``run.json`` (``resume.RESUME_KEYS``); None writes none."""
        self.every = every_n_steps
        self.fingerprint = fingerprint
        self.state = state
        """The module's run state (saved through the module's ``vapo`` section)."""
        self.saved_step = -1

    @property
    def last(self) -> Path:
        """``RUN_DIR/checkpoints/last.ckpt``."""
        return self.dirpath / LAST

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = self.state
        saved = state.restored_optimizer_sha256
        if trainer.ckpt_path is None or not self.fingerprint:
            return
        now = optimizer_fingerprint(raw_optimizers(pl_module))
        ok = saved == now
        msg = (f"resumed from {trainer.ckpt_path}: step {state.step}, version {state.version}; "
               f"optimizer state sha256 {now[:16]} {'matches' if ok else 'DIFFERS FROM'} the checkpoint's "
               f"{(saved or 'none')[:16]}")
        if trainer.global_rank == 0:
            (log.info if ok else log.error)(msg)
            print(msg, flush=True)
            if trainer.logger is not None:
                trainer.logger.experiment.add_text("resume/optimizer_sha256", f"{now} ({'match' if ok else 'MISMATCH'})",
                                                   state.step)
                trainer.logger.experiment.add_scalar("resume/optimizer_state_match", float(ok), state.step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.every > 0 and self.state.step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.state.step != self.saved_step:
            self.save(trainer)

    def save(self, trainer: L.Trainer) -> None:
        """Collective: write ``last.ckpt.tmp`` and rename it over ``last.ckpt`` (rank 0)."""
        if self.fingerprint:  # saved in the module's ``vapo`` section, compared after a resume
            self.state.optimizer_sha256 = optimizer_fingerprint(raw_optimizers(trainer.lightning_module))
        tmp = self.dirpath / (LAST + ".tmp")
        if trainer.global_rank == 0:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        trainer.strategy.barrier("vapo-ckpt-pre")
        trainer.save_checkpoint(tmp, weights_only=False)
        trainer.strategy.barrier("vapo-ckpt-written")
        if trainer.global_rank == 0:
            if self.cfg is not None:
                write_resume_keys(self.dirpath, self.cfg)
            if self.last.is_dir():
                old = self.dirpath / (LAST + ".old")
                _remove(old)
                os.rename(self.last, old)
                os.rename(tmp, self.last)
                shutil.rmtree(old)
            else:
                os.replace(tmp, self.last)
        trainer.strategy.barrier("vapo-ckpt-renamed")
        self.saved_step = self.state.step


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
