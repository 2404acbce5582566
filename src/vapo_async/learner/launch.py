"""Start and stop local generator processes (the learner's ``generators.local=N``).

    handles = start_local_generators(2, ctl.endpoint, ["model=/path/base", "sampling.max_tokens=128"],
                                     log_dir=run_dir / "generators")
    ...
    codes = stop_generators(handles)          # SIGTERM (leases handed back), SIGKILL after a timeout

Each generator is ``python -m vapo_async.generator controller=ENDPOINT generator_id=local-i ...``
in its own session (process group), logging to ``log_dir/generator-i.log``. On a GPU node the
learner passes one ``placement.EnginePlacement`` per generator: its devices become the process's
``CUDA_VISIBLE_DEVICES`` and its memory share ``engine.gpu_memory_utilization``. Its vLLM engine
core is a child in the same group; ``stop_generators`` kills whatever is left of the group after
the generator exits, so no engine outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from vapo_async.common.overrides import as_overrides
from vapo_async.common.procs import stop_processes
from vapo_async.learner.placement import EnginePlacement, generator_env

log = logging.getLogger(__name__)


@dataclass
class GeneratorHandle:
    """A started generator process."""

    index: int
    generator_id: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: TextIO
    started_at: float = 0.0
    """``time.monotonic()`` at start."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """The process has not exited."""
        return self.process.poll() is None


def _env(placement: EnginePlacement | None = None) -> dict[str, str]:
    """The current environment with this package importable (also when it is not installed), and
    the devices of ``placement``."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    if placement is not None:
        env.update(generator_env(placement, os.environ))
    return env


def start_local_generators(n: int, controller_endpoint: str,
                           overrides: Sequence[str] | Mapping[str, Any] | None = None,
                           log_dir: str | Path = "generators", id_prefix: str = "local",
                           placements: Sequence[EnginePlacement] | None = None) -> list[GeneratorHandle]:
    """Start ``n`` generator processes connected to ``controller_endpoint``. ``overrides`` are
    Hydra overrides of ``conf/generator.yaml`` (``["model=DIR"]`` or ``{"model": DIR}``);
    ``placements`` (one per generator, or None: vLLM's own device choice) their devices and shares."""
    if n < 0:
        raise ValueError(f"number of generators must be >= 0, got {n}")
    if placements is not None and len(placements) != n:
        raise ValueError(f"{len(placements)} placements for {n} generators")
    return [launch_generator(i, controller_endpoint, overrides, log_dir, id_prefix,
                             placements[i] if placements is not None else None) for i in range(n)]


def launch_generator(i: int, controller_endpoint: str, overrides: Sequence[str] | Mapping[str, Any] | None,
                     log_dir: str | Path, id_prefix: str = "local",
                     placement: EnginePlacement | None = None) -> GeneratorHandle:
    """Start generator ``i`` (``ID_PREFIX-i``, log ``log_dir/generator-i.log``, appended to)."""
    out = Path(log_dir)
    out.mkdir(parents=True, exist_ok=True)
    gid = f"{id_prefix}-{i}"
    cmd = [sys.executable, "-m", "vapo_async.generator", f"controller={controller_endpoint}",
           f"generator_id={gid}", *as_overrides(overrides), *(placement.overrides() if placement is not None else [])]
    path = out / f"generator-{i}.log"
    f = open(path, "a")  # noqa: SIM115 - closed by stop_generators
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=_env(placement), start_new_session=True)
    where = "" if placement is None else \
        f" on cuda:{','.join(map(str, placement.devices))} (share {placement.gpu_memory_utilization:.2f})"
    log.info("started generator %s (pid %d)%s, log %s", gid, proc.pid, where, path)
    return GeneratorHandle(i, gid, proc, path, f, time.monotonic())


def rotate_log(path: Path, keep: int = 5) -> None:
    """``generator-i.log`` -> ``.log.1`` -> ``.log.2`` ... (the oldest beyond ``keep`` removed)."""
    for k in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{k}")
        if k == keep:
            older.unlink(missing_ok=True)
        elif older.exists():
            older.rename(path.with_name(f"{path.name}.{k + 1}"))
    if path.exists():
        path.rename(path.with_name(f"{path.name}.1"))


def stop_generators(handles: Sequence[GeneratorHandle], timeout_s: float = 30.0) -> list[int | None]:
    """SIGTERM every generator (each hands its leases back and exits 0), wait up to ``timeout_s``,
    SIGKILL the process groups of those left, and kill leftovers of every group (an engine core
    that outlived its generator). Returns the exit codes."""
    codes = stop_processes([h.process for h in handles], signal.SIGTERM, timeout_s, group=True)
    for h in handles:
        h._log_file.close()
    return codes


def tail(handle: GeneratorHandle, lines: int = 30) -> str:
    """The last ``lines`` lines of a generator's log (for error messages)."""
    try:
        return "\n".join(handle.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<log {handle.log_path} unreadable: {e}>"
