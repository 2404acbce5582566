"""Setup of a training run, before ``trainer.fit``: the model directory, the data, threads, the
Lightning strategy and Trainer, and the callbacks, each handed the module's ``RunState``.

``__main__.run`` calls these in order (setup -> run -> cleanup); nothing here starts a process
or a socket (the ``Runtime`` callback does, at train start).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.errors import ConfigError, one_line

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from vapo_async.learner.console import StepProgressBar
    from vapo_async.learner.module import LearnerModule
    from vapo_async.learner.runtime import Runtime


def resolve_model(cfg: LearnerConfig) -> str:
    """The base model directory: ``model.path``, or the tiny base built/reused from ``model.tiny``."""
    if cfg.model.path is None:
        from vapo_async.data.tiny_base import ensure_tiny_base

        return str(ensure_tiny_base(cfg.model.tiny_base_config()))
    path = Path(cfg.model.path).expanduser()
    if not path.exists() and cfg.model.path.count("/") == 1:  # a hub id: the local snapshot (cached or fetched)
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(cfg.model.path))
        except Exception as e:  # offline, unknown id, ...: one line naming the key
            raise ConfigError(f"model.path={cfg.model.path}: no local directory and the hub download failed "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path}: not a Hugging Face model directory (no config.json)")
    return str(path)


def load_data(cfg: LearnerConfig) -> tuple[list[Any], list[Any]]:
    """(train prompts, held-out prompts for ``eval``); a missing or malformed dataset is a
    ConfigError naming the file and line."""
    from vapo_async.data import DatasetError, load_prompts

    try:
        train = load_prompts(cfg.data, "train")
        held_out = load_prompts(cfg.eval.data or cfg.data, "eval")[: cfg.eval.n_prompts] \
            if cfg.eval.every_n_steps > 0 else []
    except (DatasetError, OSError) as e:
        raise ConfigError(f"data: {one_line(e)}") from e
    if not train:
        raise ConfigError(f"data.name={cfg.data.name}: the train split has no prompts")
    if cfg.eval.every_n_steps > 0 and not held_out:
        source = cfg.eval.data or cfg.data
        raise ConfigError(f"eval.every_n_steps={cfg.eval.every_n_steps} but {source.name} has no eval split "
                          "(set eval.data to a dataset with one, or eval.every_n_steps=0)")
    return train, held_out


def device_count(accelerator: str, devices: Any) -> int:
    """Processes per node that ``trainer.devices`` asks for (list, int, "auto" or -1)."""
    import torch

    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return max(torch.cuda.device_count(), 1) if gpu else 1


def cpu_threads(cfg: LearnerConfig) -> int | None:
    """torch threads per learner process (``threads``; see its docstring for the automatic value)."""
    import torch

    if cfg.threads is not None:
        return cfg.threads
    gpu = cfg.trainer.accelerator in ("gpu", "cuda") or (cfg.trainer.accelerator == "auto" and torch.cuda.is_available())
    if gpu:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - cfg.generators.local) // device_count("cpu", cfg.trainer.devices))


def build_strategy(cfg: LearnerConfig) -> tuple[Any, str]:
    """(Lightning strategy, Lightning precision) for ``trainer.strategy`` / ``trainer.precision``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    t = cfg.trainer
    devices = device_count(t.accelerator, t.devices)
    name = t.strategy
    if name == "auto":
        name = "single" if devices * t.num_nodes == 1 else "fsdp"
    if name == "single":
        return "auto", str(t.precision)
    strategy = ModelParallelStrategy(data_parallel_size=devices * t.num_nodes, tensor_parallel_size=1,
                                     save_distributed_checkpoint=cfg.checkpoint.distributed)
    # FSDP2 applies bf16 itself (MixedPrecisionPolicy in models.shard); Lightning keeps fp32
    precision = "32-true" if str(t.precision).startswith("bf16") else str(t.precision)
    return strategy, precision


def build_trainer(cfg: LearnerConfig, run_dir: Path) -> tuple[L.Trainer, StepProgressBar | None]:
    """The Trainer (TensorBoard logger under ``run_dir/tb``, no Lightning checkpointing: see
    ``checkpoint.py``) and its progress bar (None when disabled)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from vapo_async.learner.console import StepProgressBar
    from vapo_async.learner.trainer_config import trainer_kwargs

    strategy, precision = build_strategy(cfg)
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False)
    kwargs = trainer_kwargs(cfg.trainer)
    bar = StepProgressBar() if kwargs["enable_progress_bar"] else None  # given here: Lightning adds none
    trainer = L.Trainer(**kwargs, strategy=strategy, precision=precision, callbacks=[bar] if bar else None,
                        max_steps=cfg.trainer.max_steps, max_epochs=-1, logger=logger,
                        default_root_dir=str(run_dir), enable_checkpointing=False, use_distributed_sampler=False)
    return trainer, bar


def build_callbacks(cfg: LearnerConfig, run_dir: Path, module: LearnerModule, model_path: str, tokenizer: Any,
                    vocab_size: int, train: list[Any], held_out: list[Any]) -> tuple[Runtime, list[Callback]]:
    """(the runtime, every callback in hook order): the runtime first (it starts the controller
    the others report on), then metrics, checkpoints, the held-out evaluation and the SIGTERM stop. Each gets what
    it reads explicitly: the module's ``state`` and, for the runtime, its ``rollouts``."""
    from vapo_async.learner.checkpoint import Checkpointing
    from vapo_async.learner.evaluation import HeldOutEval
    from vapo_async.learner.metrics import TensorBoardMetrics
    from vapo_async.learner.runtime import Runtime, engine_context
    from vapo_async.learner.stopping import GracefulStop

    state = module.state
    runtime = Runtime(cfg, model_path, run_dir, vocab_size, tokenizer, train, module.rollouts)
    eval_context = engine_context(held_out, tokenizer, cfg.eval.max_tokens or cfg.sampling.max_tokens)
    return runtime, [
        runtime,
        TensorBoardMetrics(cfg.logging, tokenizer, state, source_metrics=runtime.controller_metrics),
        Checkpointing(run_dir / "checkpoints", cfg.checkpoint.every_n_steps, cfg.checkpoint.fingerprint, state, cfg),
        HeldOutEval(cfg.eval, held_out, cfg.reward, cfg.sampling.max_tokens, model_path, tokenizer, cfg.seed,
                    state, max_model_len=eval_context),
        GracefulStop(state, cfg.trainer.stop_grace_s, on_deadline=runtime.shutdown),
    ]
