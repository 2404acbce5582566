"""What a person running the learner sees, and where everything else goes.

Console (stderr) of learner rank 0:
- one progress bar: training steps done out of ``trainer.max_steps``, with the latest reward,
  accuracy, policy version, staleness, generated tokens/s and held-out accuracy (the values
  ``metrics.TensorBoardMetrics`` puts on the bar, named in ``metrics.PROGRESS``);
- the project's own log lines from INFO up (``vapo_async.*``; Hydra's sweep lines too);
- WARNING and up from every other logger (Lightning, torch, Python warnings), except vLLM's, which
  reach the console from ERROR up: its warnings advise on its own serving set-up (Triton, tcmalloc
  in LD_PRELOAD, eager mode) and repeat at every engine start.
Other ranks show WARNING and up.

``RUN_DIR/logs/`` keeps the rest:
- ``learner.log``: every record at INFO and up from every logger of the learner process (vLLM's
  start-up of the evaluation engine, Lightning's "GPU available"/tips/"``Trainer.fit`` stopped"
  lines...); other ranks write ``learner-rank{R}.log``;
- ``eval_engine.log``: all output of the processes the learner spawns with multiprocessing, i.e.
  the in-learner evaluation engine's EngineCore and Worker (vLLM's log, NUMA and Triton notices,
  progress bars, C-level warnings), which would otherwise write to the learner's terminal.
Local generators log to ``RUN_DIR/generators/`` (``learner/launch.py``).

Set-up -> run -> close per run (``RunLogs``), so the jobs of a ``-m`` sweep each get their own files.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing.spawn
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import lightning as L
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from tqdm import tqdm

from vapo_async.learner.metrics import PROGRESS

log = logging.getLogger("vapo_async.learner")

CONSOLE_INFO = ("vapo_async", "hydra")
"""Loggers whose INFO records reach the console of rank 0."""
CONSOLE_MIN = {"vllm": logging.ERROR}
"""Loggers whose records reach the console only from this level up (see the module docstring)."""
OWN_HANDLERS = ("lightning", "lightning.pytorch", "lightning.fabric")
"""Loggers that attach their own stderr handler when imported before logging is configured (they
are imported with the config classes); their records go to the run's handlers instead."""
CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(processName)s %(threadName)s]: %(message)s"
CHILD_LOG = "eval_engine.log"

_child_output: str | None = None
"""File the spawned children of this process write their stdout/stderr to (None: inherited)."""
_spawn_wrapper: Callable[..., list[str]] | None = None
"""The wrapper ``_redirect_spawned_children`` installed (found in the wrapper chain: idempotent)."""
_REDIRECT = ("import os; _fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644); "
             "os.dup2(_fd, 1); os.dup2(_fd, 2); os.close(_fd); del _fd; ")


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class ConsoleFilter(logging.Filter):
    """Which records the console shows (see the module docstring)."""

    def __init__(self, show_info: bool) -> None:
        super().__init__()
        self.show_info = show_info

    def filter(self, record: logging.LogRecord) -> bool:
        for prefix, level in CONSOLE_MIN.items():
            if _under(record.name, prefix):
                return record.levelno >= level
        if self.show_info and any(_under(record.name, p) for p in CONSOLE_INFO):
            return record.levelno >= logging.INFO
        return record.levelno >= logging.WARNING


class ConsoleHandler(logging.StreamHandler[TextIO]):
    """Writes through ``tqdm.write``, so a line lands above the progress bar, not through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's policy: report on stderr, never raise into the caller
            self.handleError(record)


def process_label() -> str | None:
    """None for the first learner process; its rank for the others (torchrun's RANK, SLURM's
    SLURM_PROCID, or Lightning's launcher's LOCAL_RANK, as NODE_RANK.LOCAL_RANK past node 0)."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    if rank is None:
        node, local = os.environ.get("NODE_RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        rank = local if node == "0" else f"{node}.{local}"
    return None if rank == "0" else rank


@dataclass
class RunLogs:
    """The logging set-up of one run; ``close`` gives back the one found before."""

    dir: Path
    file: Path
    """This process's log (``learner.log`` on the first process)."""
    handlers: list[logging.Handler]
    saved_handlers: list[logging.Handler] = field(default_factory=list)
    saved_level: int = logging.WARNING

    def close(self) -> None:
        global _child_output
        root = logging.getLogger()
        for h in self.handlers:
            root.removeHandler(h)
            h.close()
        for h in self.saved_handlers:
            root.addHandler(h)
        root.setLevel(self.saved_level)
        logging.captureWarnings(False)
        _child_output = None


def open_run_logs(run_dir: Path, stream: TextIO | None = None) -> RunLogs:
    """Route this process's logging as the module docstring says, for the run in ``run_dir``."""
    global _child_output
    label = process_label()
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / ("learner.log" if label is None else f"learner-rank{label}.log")
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(FILE_FORMAT))
    to_console = ConsoleHandler(stream or sys.stderr)
    to_console.addFilter(ConsoleFilter(show_info=label is None))
    to_console.setFormatter(logging.Formatter(CONSOLE_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    logs = RunLogs(log_dir, path, [to_file, to_console], list(root.handlers), root.level)
    for h in logs.saved_handlers:  # Hydra's console handler (its own format, all INFO)
        root.removeHandler(h)
    for h in logs.handlers:
        root.addHandler(h)
    root.setLevel(logging.INFO)
    for name in OWN_HANDLERS:
        _propagate_only(name)
    _transformers_to_root()
    logging.captureWarnings(True)  # warnings.warn -> "py.warnings": console (WARNING) and the file
    _child_output = str(log_dir / (CHILD_LOG if label is None else f"eval_engine-rank{label}.log"))
    _redirect_spawned_children()
    return logs


def _propagate_only(name: str) -> None:
    """Drop a logger's own handlers; its records propagate to the root's."""
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.propagate = True


def _transformers_to_root() -> None:
    """transformers logs through its own stderr handler and draws a bar per model load; here its
    records propagate to the run's handlers and the step bar is the only bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def _redirect_spawned_children() -> None:
    """Children spawned with multiprocessing (vLLM's EngineCore, which spawns its Worker) write
    their stdout/stderr to ``_child_output``: they inherit this process's terminal otherwise, and
    part of what they print (C-level warnings, progress bars, records logged before vLLM configures
    logging) never passes through Python logging. Wraps ``multiprocessing.spawn.get_command_line``
    as ``common.orphans.arm`` does (idempotent; reads ``_child_output`` at each spawn)."""
    global _spawn_wrapper
    fn: Any = multiprocessing.spawn.get_command_line
    while fn is not None:
        if fn is _spawn_wrapper:
            return
        fn = getattr(fn, "__wrapped__", None)
    original: Callable[..., list[str]] = multiprocessing.spawn.get_command_line

    def get_command_line(**kwds: object) -> list[str]:
        cmd = list(original(**kwds))
        if _child_output is None or "-c" not in cmd:  # no run, or a frozen executable
            return cmd
        i = cmd.index("-c") + 1
        cmd[i] = _REDIRECT.format(path=_child_output) + cmd[i]
        return cmd

    functools.update_wrapper(get_command_line, original, assigned=(), updated=())  # sets __wrapped__ only
    _spawn_wrapper = get_command_line
    multiprocessing.spawn.get_command_line = get_command_line


def route_vllm_logging() -> None:
    """Call before building a vLLM engine in this process: vLLM's records here go to the run's
    handlers (``learner.log``; the console from ERROR up), not to the stdout handler vLLM attaches
    to its "vllm" logger. vLLM attaches it while building an engine unless the logging config it
    is given equals the one it applied last (``vllm.logger.configure_logging_if_needed``), so the
    default config is recorded as applied; the engine's own processes still apply it, and their
    output goes to ``eval_engine.log``."""
    import vllm.logger
    from vllm.config.logging import LoggingConfig

    if not hasattr(vllm.logger, "_last_configured_logging_config"):
        log.warning("vllm %s: vllm.logger._last_configured_logging_config is gone; the evaluation "
                    "engine's start-up log goes to the console", getattr(vllm, "__version__", "?"))
        return
    vllm.logger._last_configured_logging_config = LoggingConfig()
    _propagate_only("vllm")
    if _child_output is not None:
        log.info("evaluation engine output: %s", _child_output)


def describe(metrics: Mapping[str, Any]) -> str:
    """The bar's text after the count: ``reward +0.125 acc 43.8% v 12 stale 0.50 tok/s 1234``."""
    formats: dict[str, Callable[[float], str]] = {
        "reward": lambda x: f"{x:+.3f}", "acc": lambda x: f"{100 * x:.1f}%", "v": lambda x: f"{x:.0f}",
        "stale": lambda x: f"{x:.2f}", "tok/s": lambda x: f"{x:.0f}", "eval": lambda x: f"{100 * x:.1f}%",
    }
    parts = []
    for name in PROGRESS.values():
        if name in metrics:
            show = formats.get(name, lambda x: f"{x:.3g}")
            parts.append(f"{name} {show(float(metrics[name]))}")
    return " ".join(parts)


class StepProgressBar(ProgressBar):
    """One line for the whole run: steps done / ``trainer.max_steps`` and ``describe(...)`` of the
    values logged to the progress bar this step. Goes after the callbacks that log them."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.enabled = True
        self.bar: tqdm[Any] | None = None

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        tqdm.write(sep.join(map(str, args)), file=self.stream or sys.stderr)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:
            self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="steps", unit="step",
                            file=self.stream or sys.stderr, dynamic_ncols=True, leave=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(describe(trainer.progress_bar_metrics), refresh=False)
            self.bar.update(trainer.global_step - self.bar.n)
            if 0 <= trainer.max_steps <= trainer.global_step:  # done: the shutdown lines come below the bar
                self._close()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
