"""``python -m vapo_async.learner [overrides]``: the training run (learner + controller + generators).

Setup -> run -> cleanup:
1. Setup: compose and check the config (an invalid override or value ends with a one-line error
   naming the key, exit code 2; a ``-m`` sweep checks every job first); route logging
   (``console.py``: progress bar and the project's lines on the console, the rest in
   ``RUN_DIR/logs/``); resolve the model (build/reuse the tiny base when
   ``model.path`` is null); build the LightningModule, the callbacks (runtime, metrics, checkpoints,
   held-out eval), the TensorBoard logger under ``RUN_DIR/tb`` and the Trainer. Print the
   TensorBoard command.
2. Run: ``trainer.fit`` (from ``RUN_DIR/checkpoints/last.ckpt`` with ``resume=true``).
3. Cleanup: local generators and the controller stop (also on errors: the runtime callback's
   ``on_exception``/``teardown``); the weight writer thread is joined.

``hydra.run.dir=DIR`` places the run (default ``runs/<date>_<time>``): ``DIR/tb``,
``DIR/checkpoints/last.ckpt``, ``DIR/weights/v00000001/...``, ``DIR/generators/*.log``,
``DIR/logs/learner.log``, ``DIR/logs/eval_engine.log``.

Hydra's own flags work as with any ``@hydra.main`` app (the command line is parsed by Hydra's
parser): ``--cfg job|hydra|all`` (``-c``) with ``--resolve`` and ``--package``/``-p`` prints the
composed config, ``--info [all|config|defaults|defaults-tree|plugins|searchpath]``, ``--help``,
``--config-name``/``--config-dir``, and ``-m``/``--multirun`` sweeps (``trainer.max_steps=100,200``,
``range()``, ``glob()``): Hydra's basic launcher runs the jobs one after another in this process,
each in ``hydra.sweep.dir/N`` (default ``multirun/<date>/<time>/N``), one device each.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from vapo_async.learner.config import LearnerConfig, register_configs
from vapo_async.learner.errors import ConfigError

log = logging.getLogger("vapo_async.learner")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONFIG_NAME = "learner"


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


def run(cfg: LearnerConfig, run_dir: Path) -> Any:
    """Set up and run training in ``run_dir``; returns the fitted module."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from transformers import AutoConfig, AutoTokenizer

    from vapo_async.common.orphans import arm

    arm()  # the evaluation engine's spawned vLLM processes die with the learner, even on SIGKILL

    from vapo_async.learner.checkpoint import LAST, Checkpointing
    from vapo_async.learner.config import trainer_kwargs, validate
    from vapo_async.learner.console import StepProgressBar
    from vapo_async.learner.evaluation import HeldOutEval
    from vapo_async.learner.metrics import TensorBoardMetrics
    from vapo_async.learner.module import LearnerModule
    from vapo_async.learner.runtime import Runtime, engine_context

    validate(cfg)
    ckpt = run_dir / "checkpoints" / LAST
    if cfg.resume and not ckpt.exists():
        raise ConfigError(f"resume=true: no checkpoint at {ckpt} (hydra.run.dir must be the earlier run's)")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    threads = cpu_threads(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab_size = int(AutoConfig.from_pretrained(model_path).vocab_size)
    module = LearnerModule(cfg, model_path, run_dir)
    strategy, precision = build_strategy(cfg)
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version="", default_hp_metric=False)
    kwargs = trainer_kwargs(cfg.trainer)
    bar = StepProgressBar() if kwargs["enable_progress_bar"] else None  # given here: Lightning adds none
    trainer = L.Trainer(**kwargs, strategy=strategy, precision=precision, callbacks=[bar] if bar else None,
                        max_steps=cfg.trainer.max_steps, max_epochs=-1, logger=logger,
                        default_root_dir=str(run_dir), enable_checkpointing=False, use_distributed_sampler=False)
    rank0 = trainer.global_rank == 0
    train, held_out = load_data(cfg) if rank0 else ([], [])  # only rank 0 leases and evaluates
    runtime = Runtime(cfg, model_path, run_dir, vocab_size, tokenizer, train)
    trainer.callbacks.extend([
        runtime,
        TensorBoardMetrics(cfg.logging, tokenizer),
        Checkpointing(run_dir / "checkpoints", cfg.checkpoint.every_n_steps, cfg.checkpoint.fingerprint),
        HeldOutEval(cfg.eval, held_out, cfg.reward, cfg.sampling.max_tokens, model_path, tokenizer, cfg.seed,
                    max_model_len=engine_context(held_out, tokenizer, cfg.eval.max_tokens or cfg.sampling.max_tokens)),
    ])
    if bar is not None:  # last, so that it shows what the callbacks above logged for this step
        trainer.callbacks.remove(bar)
        trainer.callbacks.append(bar)
    if rank0 and cfg.logging.print_tensorboard_command:
        print(f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}", flush=True)
    try:
        trainer.fit(module, ckpt_path=str(ckpt) if cfg.resume else None, weights_only=True)
    finally:
        runtime.shutdown()
        if module.publishing is not None:
            module.publishing.close()
    if rank0:
        log.info("finished at step %d (policy version %d); logs in %s", module.step, module.version, run_dir / "logs")
    return module


def one_line(e: BaseException) -> str:
    """A single line naming the problem (Hydra/OmegaConf messages span several lines)."""
    parts = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        lines = [ln.strip() for ln in str(cur).splitlines() if ln.strip() and ln.strip() != "None"]
        if lines:
            parts.append(lines[0])
            parts += [ln for ln in lines[1:] if ln.startswith("full_key:")]
        cur = cur.__cause__ or cur.__context__
    text = " | ".join(list(dict.fromkeys(parts))[:3]) or type(e).__name__
    return text.replace("\n", " ")


def check_overrides(overrides: list[str]) -> None:
    """Compose the config with ``overrides`` and build the typed object; raise ConfigError with
    one line on any problem (unknown key, bad type, failed validation)."""
    check_command_line(list(overrides))


def check_command_line(argv: list[str]) -> None:
    """Compose what the command line ``argv`` asks for, as Hydra will, and raise ConfigError with
    one line on the first problem: the run's config (typed and validated), each job of a ``-m``
    sweep (likewise, plus ``check_sweep_job``), or the config ``--cfg`` prints (typed only:
    printing a config needs no valid run). ``--help``, ``--hydra-help``, ``--info`` and
    ``--shell-completion`` are left to Hydra. Raises SystemExit(2) with argparse's usage message
    on an unknown flag, as Hydra does."""
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info is not None or args.shell_completion:
        return
    name = args.config_name or CONFIG_NAME
    with _composer(args) as hydra:
        if args.cfg is not None:
            compose_config(args.overrides, hydra=hydra, config_name=name, check=False)
            return
        if not (args.multirun or hydra.get_mode(config_name=name, overrides=args.overrides) == RunMode.MULTIRUN):
            compose_config(args.overrides, hydra=hydra, config_name=name)
            return
        for i, job in enumerate(_sweep_jobs(hydra, name, args.overrides)):
            try:
                check_sweep_job(compose_config(job, hydra=hydra, config_name=name))
            except ConfigError as e:
                raise ConfigError(f"sweep job #{i} ({' '.join(job)}): {e}") from e


def check_sweep_job(cfg: LearnerConfig) -> None:
    """What a run must satisfy to be a job of a ``-m`` sweep: one process (Lightning cannot start a
    process per device for jobs run one after another inside this one)."""
    devices = device_count(cfg.trainer.accelerator, cfg.trainer.devices) * cfg.trainer.num_nodes
    if devices > 1:
        raise ConfigError(f"trainer.devices={cfg.trainer.devices} trainer.num_nodes={cfg.trainer.num_nodes}: "
                          "-m runs its jobs one after another inside this process, one device each; start a "
                          "several-device job as its own command")


@contextlib.contextmanager
def _composer(args: argparse.Namespace) -> Iterator[Any]:
    """Hydra's config composer for this command line, built as ``hydra.main`` builds it (the same
    search path, ``--config-path`` and ``--config-dir`` included); cleared on exit so that
    ``hydra.main`` can start its own."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
    )
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    calling_file, calling_module = detect_calling_file_or_module_from_task_function(_hydra_main.__wrapped__)
    search_path = create_automatic_config_search_path(calling_file, calling_module,
                                                      args.config_path or str(CONF_DIR))
    if args.config_dir is not None:
        conf_dir = os.path.abspath(args.config_dir)
        if not os.path.isdir(conf_dir):
            raise ConfigError(f"--config-dir={args.config_dir}: no such directory")
        search_path.prepend(provider="command-line", path=f"file://{conf_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    try:
        yield Hydra.create_main_hydra2(task_name="check", config_search_path=search_path)
    finally:
        GlobalHydra.instance().clear()


def compose_config(overrides: Sequence[str], *, hydra: Any = None, config_name: str = CONFIG_NAME,
                   check: bool = True) -> LearnerConfig:
    """The typed config of one run for ``overrides``, composed as ``python -m vapo_async.learner``
    composes it and (``check``) validated, without running anything. ``hydra``: the composer of a
    command line (``_composer``); None builds the default one. Any problem (unknown key, bad type,
    sweep syntax outside ``-m``, failed validation) is a ``ConfigError`` of one line."""
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    from vapo_async.learner.config import validate

    if hydra is None:
        with _composer(get_args_parser().parse_args([])) as default:
            return compose_config(overrides, hydra=default, config_name=config_name, check=check)
    try:
        dcfg = hydra.compose_config(config_name=config_name, overrides=list(overrides), run_mode=RunMode.RUN,
                                    with_log_configuration=False)
        with read_write(dcfg), open_dict(dcfg):
            del dcfg["hydra"]  # what the task function receives
        cfg: LearnerConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
        if check:
            validate(cfg)
    except ConfigError:
        raise
    except Exception as e:  # reported as one line and exit code 2 by main()
        raise ConfigError(one_line(e)) from e
    return cfg


def _sweep_jobs(hydra: Any, config_name: str, overrides: list[str]) -> list[list[str]]:
    """The overrides of each job of a ``-m`` sweep, in launch order, as Hydra's basic sweeper
    expands them (``a=1,2``, ``range()``, ``glob()``, ``hydra.sweeper.params``). Empty for another
    sweeper plugin: it picks jobs as it goes, and each is checked when it starts (``_hydra_main``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    try:
        dcfg = hydra.compose_config(config_name=config_name, overrides=list(overrides), run_mode=RunMode.MULTIRUN,
                                    with_log_configuration=False)
        sweeper = dcfg.hydra.sweeper
        if sweeper._target_ != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
            return []
        params = [f"{k}={v}" for k, v in (sweeper.params or {}).items()]
        task = list(OmegaConf.to_container(dcfg.hydra.overrides.task, resolve=False))  # type: ignore[arg-type]
        parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(params + task)
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception as e:
        raise ConfigError(one_line(e)) from e


register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base=None)
def _hydra_main(dcfg: DictConfig) -> None:
    """One run (each job of a ``-m`` sweep is one call): logging set up for its directory, run,
    logging given back."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from vapo_async.learner.console import open_run_logs

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    logs = open_run_logs(run_dir)
    try:
        cfg: LearnerConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
        if hydra_cfg.mode == RunMode.MULTIRUN:
            check_sweep_job(cfg)
        run(cfg, run_dir)
    except ConfigError as e:  # Hydra would print a traceback and exit 1
        print(f"vapo_async.learner: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        logs.close()


def main() -> None:
    """Entry point: check the command line (one-line errors), then hand over to Hydra."""
    from vapo_async.learner.model_presets import implied_overrides

    sys.argv[1:] = implied_overrides(sys.argv[1:])  # model.path=DIR alone means model=hf (Hydra reads argv)
    # A shell starts background jobs (`cmd &` in a script) with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: restore it, so SIGINT always stops training cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if "LOCAL_RANK" not in os.environ:  # Lightning's rank > 0 processes re-run a checked command
            check_command_line(sys.argv[1:])
        _hydra_main()
    except ConfigError as e:
        print(f"vapo_async.learner: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
