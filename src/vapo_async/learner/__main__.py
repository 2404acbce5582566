"""``python -m vapo_async.learner [overrides]``: the training run (learner + controller + generators).

Setup -> run -> cleanup:
1. Setup: compose and check the config (an invalid override or value ends with a one-line error
   naming the key, exit code 2; a ``-m`` sweep checks every job first); route logging
   (``console.py``: progress bar and the project's lines on the console, the rest in
   ``RUN_DIR/logs/``); then ``prepare.py``: resolve the model (build/reuse the tiny base when
   ``model.path`` is null), the LightningModule, the TensorBoard logger under ``RUN_DIR/tb`` and
   the Trainer, and the callbacks (runtime, metrics, checkpoints, held-out eval), each handed the
   module's ``RunState``. Print the TensorBoard command.
2. Run: ``trainer.fit`` (from ``RUN_DIR/checkpoints/last.ckpt`` when it exists: learner/resume.py).
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
from vapo_async.learner.errors import ConfigError, one_line
from vapo_async.learner.prepare import (
    build_callbacks,
    build_trainer,
    cpu_threads,
    device_count,
    load_data,
    resolve_model,
)

log = logging.getLogger("vapo_async.learner")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONFIG_NAME = "learner"


def run(cfg: LearnerConfig, run_dir: Path) -> Any:
    """Set up and run training in ``run_dir``; returns the fitted module."""
    import lightning as L
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from vapo_async.common.orphans import arm

    arm()  # the evaluation engine's spawned vLLM processes die with the learner, even on SIGKILL

    from vapo_async.learner.checkpoint import LAST
    from vapo_async.learner.config import validate
    from vapo_async.learner.module import LearnerModule
    from vapo_async.learner.resume import should_resume

    # setup
    validate(cfg)
    ckpt = run_dir / "checkpoints" / LAST
    resume = should_resume(cfg, run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    threads = cpu_threads(cfg)
    if threads is not None:
        torch.set_num_threads(threads)
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab_size = int(AutoConfig.from_pretrained(model_path).vocab_size)
    module = LearnerModule(cfg, model_path, run_dir)
    trainer, bar = build_trainer(cfg, run_dir)
    rank0 = trainer.global_rank == 0
    train, held_out = load_data(cfg) if rank0 else ([], [])  # only rank 0 leases and evaluates
    runtime, callbacks = build_callbacks(cfg, run_dir, module, model_path, tokenizer, vocab_size, train, held_out)
    trainer.callbacks.extend(callbacks)
    if bar is not None:  # last, so that it shows what the callbacks above logged for this step
        trainer.callbacks.remove(bar)
        trainer.callbacks.append(bar)
    if rank0 and cfg.logging.print_tensorboard_command:
        print(f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}", flush=True)
    # run, then cleanup (also on errors)
    try:
        trainer.fit(module, ckpt_path=str(ckpt) if resume else None, weights_only=True)
    finally:
        runtime.shutdown()
        if module.publishing is not None:
            module.publishing.close()
    if rank0 and module.state.stop_signal is not None:
        log.warning("stopped by signal %d at step %d (policy version %d), last.ckpt saved; continue with the same "
                    "command (hydra.run.dir=%s)", module.state.stop_signal, module.state.step,
                    module.state.version, run_dir)
    elif rank0:
        log.info("finished at step %d (policy version %d); logs in %s", module.state.step, module.state.version,
                 run_dir / "logs")
    return module


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
        cfg = _typed(dcfg)
        if check:
            validate(cfg)
    except ConfigError:
        raise
    except Exception as e:  # reported as one line and exit code 2 by main()
        raise ConfigError(one_line(e)) from e
    return cfg


def _typed(dcfg: DictConfig) -> LearnerConfig:
    """The ``LearnerConfig`` object of a composed ``learner_schema`` config."""
    cfg = OmegaConf.to_object(dcfg)
    if not isinstance(cfg, LearnerConfig):
        raise ConfigError(f"the composed config is a {type(cfg).__name__}, not a LearnerConfig "
                          "(the primary config must build on learner_schema)")
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
        task = OmegaConf.to_container(dcfg.hydra.overrides.task, resolve=False)  # overrides as typed
        if not isinstance(task, list):
            raise ConfigError(f"hydra.overrides.task is a {type(task).__name__}, not a list")
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
        cfg = _typed(dcfg)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            check_sweep_job(cfg)
        module = run(cfg, run_dir)
    except ConfigError as e:  # Hydra would print a traceback and exit 1
        print(f"vapo_async.learner: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        logs.close()
    if module.state.stop_signal is not None:  # stopped by SIGTERM (learner/stopping.py): not finished
        from vapo_async.learner.stopping import STOP_EXIT_CODE

        sys.exit(STOP_EXIT_CODE)


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
