"""The ``trainer`` node of the learner's config: ``lightning.Trainer`` arguments, all of them.

The common ones are typed, documented fields of ``_TrainerCore``; every other argument of
``Trainer.__init__`` is added as a field with Lightning's default (``trainer.NAME=VALUE``), so a
typo is an error. The learner owns a few arguments itself (``OWNED_TRAINER_ARGS``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vapo_async.learner.errors import ConfigError

STRATEGIES = ("auto", "single", "ddp", "fsdp")
"""Values of ``trainer.strategy``."""


@dataclass
class _TrainerCore:
    """The ``lightning.Trainer`` arguments this project interprets (the rest: see TrainerConfig)."""

    accelerator: str = "auto"
    """cpu, gpu, auto."""
    devices: Any = 1
    """Devices (processes) per node: int, list or "auto"."""
    num_nodes: int = 1
    """Nodes (multi-node via torchrun or SLURM)."""
    strategy: str = "auto"
    """auto (single device, or fsdp on several), single, ddp (FSDP2 replicate-only mesh), fsdp
    (FSDP2 fully_shard per block through Lightning's ModelParallelStrategy)."""
    precision: Any = "32-true"
    """32-true, or bf16-mixed on GPUs (FSDP2 mixed precision: bf16 compute, fp32 reduce)."""
    max_steps: int = 200
    """Training steps (global batches), value-pretraining steps included."""
    log_every_n_steps: int = 1
    """Lightning's own logging period."""
    enable_progress_bar: bool = True
    """Show the progress bar (step, reward, accuracy)."""
    enable_model_summary: bool = False
    """Print Lightning's model summary."""
    num_sanity_val_steps: int = 0
    """No validation loop is used."""
    stop_grace_s: float = 30.0
    """After SIGTERM, the learner stops at the next step boundary (or at once while it waits for
    rollouts), saves ``last.ckpt`` and exits 143; if that takes longer than this, it stops the
    local generators and exits 143 at once, keeping the last complete checkpoint (learner/stopping.py).
    Not a Lightning argument."""


OWNED_TRAINER_ARGS = ("logger", "callbacks", "plugins", "default_root_dir", "max_epochs",
                      "enable_checkpointing", "use_distributed_sampler", "accumulate_grad_batches",
                      "gradient_clip_val", "gradient_clip_algorithm")
"""Trainer arguments the learner sets itself (manual optimisation, its own logger, callbacks and
run directory); setting them is an error."""


def _trainer_config_class() -> type:
    """``_TrainerCore`` plus every other ``lightning.Trainer.__init__`` argument as an ``Any``
    field with Lightning's default, so ``trainer.NAME=VALUE`` works for all of them and a typo is
    an error."""
    import lightning

    params = inspect.signature(lightning.Trainer.__init__).parameters
    core = {f.name for f in dataclasses.fields(_TrainerCore)}
    extra = [(n, Any, field(default=p.default)) for n, p in params.items()
             if n != "self" and n not in core and p.default is not inspect.Parameter.empty
             and isinstance(p.default, (int, float, str, bool, type(None)))]
    cls = dataclasses.make_dataclass("TrainerConfig", extra, bases=(_TrainerCore,))
    cls.__doc__ = ("``lightning.Trainer`` arguments: the documented ones of ``_TrainerCore`` plus every "
                   "other Trainer argument (see Lightning's Trainer docs).")
    return cls


if TYPE_CHECKING:  # the extra fields are Lightning's: checkers see the documented core
    TrainerConfig = _TrainerCore
else:
    TrainerConfig = _trainer_config_class()


def trainer_kwargs(trainer: Any) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` from the ``trainer`` node, without the ones the
    learner interprets itself (strategy, precision, max_steps) or owns (``OWNED_TRAINER_ARGS``)."""
    values = {f.name: getattr(trainer, f.name) for f in dataclasses.fields(trainer)}
    for key in OWNED_TRAINER_ARGS:
        if values.get(key) is not None and key in values:
            default = inspect.signature(_lightning_trainer().__init__).parameters[key].default
            if values[key] != default:
                raise ConfigError(f"trainer.{key}: set by the learner itself, cannot be overridden")
        values.pop(key, None)
    for key in ("strategy", "precision", "max_steps", "stop_grace_s"):
        values.pop(key)
    return values


def _lightning_trainer() -> type:
    import lightning

    return lightning.Trainer
