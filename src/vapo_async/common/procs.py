"""Ending processes this one started: signal -> wait -> SIGKILL, on ``psutil.wait_procs``.

    codes = stop_processes([popen], signal.SIGTERM, timeout_s=30, group=True)

The one place for the "SIGTERM, wait, SIGKILL (``killpg``)" sequence of the local generators
(``learner/launch.py``) and the benchmark harnesses. ``stop_processes`` sends the first signal to
each process itself (a generator hands its leases back on SIGTERM, a learner stops on SIGINT),
waits for all of them together, then SIGKILLs what is left. With ``group=True`` each process leads
its own process group (``start_new_session=True``): the SIGKILL goes to the whole group, and what
is left of a group after its leader exited (vLLM's engine core, a reward worker) is SIGKILLed too,
so that nothing outlives the process that started it.

A ``subprocess.Popen`` given here gets its ``returncode`` set: psutil reaps it, so ``Popen.wait``
could no longer read the code itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any, cast

import psutil

log = logging.getLogger(__name__)


def running(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` still running (gone and zombie ones left out)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid``, zombies included (the group lasts until they are
    reaped: ``os.killpg(pgid, 0)`` succeeds while one is left)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def kill_group(pgid: int, wait_s: float = 5.0) -> list[psutil.Process]:
    """SIGKILL every process of group ``pgid`` and wait up to ``wait_s`` until the group is gone
    (its members dead and reaped); returns the members left then (logged)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty
        return []
    _, alive = psutil.wait_procs(group_members(pgid), timeout=wait_s)
    if alive:
        log.warning("process group %d still has members %.0f s after SIGKILL: %s", pgid, wait_s,
                    [p.pid for p in alive])
    return alive


def _handle(proc: subprocess.Popen[Any] | psutil.Process) -> psutil.Process | None:
    """A psutil handle of ``proc``; None for a ``Popen`` already reaped (its code is known)."""
    if isinstance(proc, psutil.Process):
        return proc
    if proc.poll() is not None:
        return None
    return psutil.Process(proc.pid)  # our unreaped child: it exists (as a zombie at worst)


def stop_processes(procs: Sequence[subprocess.Popen[Any] | psutil.Process], sig: int = signal.SIGTERM,
                   timeout_s: float = 30.0, *, group: bool = False,
                   kill_wait_s: float = 5.0) -> list[int | None]:
    """Send ``sig`` to each of ``procs`` still running, wait up to ``timeout_s`` for all of them,
    SIGKILL the ones left and wait up to ``kill_wait_s`` more. With ``group`` each process must
    lead its own process group: the SIGKILL goes to the group (``os.killpg``), and the rest of
    every group is SIGKILLed once its leader is gone. Returns the exit codes in order, as
    ``Popen.returncode`` gives them (``-N``: ended by signal N); None for a process that is not a
    child of this one (its code cannot be read) or that outlived SIGKILL."""
    handles = [_handle(p) for p in procs]
    live = [h for h in handles if h is not None]
    for h in live:
        try:
            h.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(live, timeout=timeout_s)
    for h in alive:
        log.warning("process %d did not exit within %.0f s of signal %d: SIGKILL%s", h.pid, timeout_s,
                    sig, " to its process group" if group else "")
        try:
            if group:
                os.killpg(h.pid, signal.SIGKILL)
            else:
                h.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    psutil.wait_procs(alive, timeout=kill_wait_s)
    if group:
        for h in live:
            kill_group(h.pid, kill_wait_s)  # e.g. an engine core that outlived its generator
    codes: list[int | None] = []
    for proc, h in zip(procs, handles, strict=True):
        if h is None:  # a Popen reaped before: it knows its code
            code = cast("subprocess.Popen[Any]", proc).returncode
        else:
            code = getattr(h, "returncode", None)  # set by psutil.wait_procs once the process is gone
            if isinstance(proc, subprocess.Popen) and proc.returncode is None:
                proc.returncode = code
        codes.append(None if code is None else int(code))
    return codes
