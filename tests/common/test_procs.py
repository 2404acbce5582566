"""``common.procs.stop_processes`` on real processes: one that leaves on SIGTERM, one that ignores
it and must be SIGKILLed, and a process group whose leader leaves a child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from vapo_async.common.procs import group_members, kill_group, running, stop_processes

EXIT_ON_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))"
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
READY = "; print('ready', flush=True); time.sleep(120)"
# a leader that leaves on SIGTERM and has started a child that ignores it (both in the leader's group)
LEADER = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
          f"c = subprocess.Popen([sys.executable, '-c', {IGNORE_TERM + READY!r}], stdout=subprocess.PIPE); "
          "c.stdout.readline(); print(c.pid, flush=True); time.sleep(120)")


def _default_sigint() -> None:
    """A shell starts background jobs with SIGINT ignored, and children inherit that; Python then
    installs no KeyboardInterrupt handler. The processes here get the default, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(code: str, new_session: bool = False) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=new_session, preexec_fn=_default_sigint)
    assert proc.stdout is not None
    proc.stdout.readline()  # its signal handlers are in place
    return proc


def test_a_process_that_leaves_on_sigterm_is_not_killed() -> None:
    proc = _start(EXIT_ON_TERM + READY)
    t0 = time.monotonic()
    assert stop_processes([proc], signal.SIGTERM, timeout_s=30) == [3]  # its own exit code: it left
    assert time.monotonic() - t0 < 10  # no wait for the timeout
    assert proc.returncode == 3 and proc.wait() == 3  # the Popen knows the code psutil reaped
    assert not psutil.pid_exists(proc.pid)


def test_a_process_that_ignores_sigterm_is_sigkilled_after_the_timeout() -> None:
    proc = _start(IGNORE_TERM + READY)
    t0 = time.monotonic()
    assert stop_processes([proc], signal.SIGTERM, timeout_s=1.0) == [-signal.SIGKILL]
    assert time.monotonic() - t0 >= 1.0  # it was given the timeout first
    assert proc.returncode == -signal.SIGKILL
    assert not psutil.pid_exists(proc.pid)


def test_several_at_once_share_one_timeout_and_keep_their_order() -> None:
    procs = [_start(IGNORE_TERM + READY), _start(EXIT_ON_TERM + READY), _start(IGNORE_TERM + READY)]
    t0 = time.monotonic()
    assert stop_processes(procs, signal.SIGTERM, timeout_s=1.0) == [-9, 3, -9]
    assert time.monotonic() - t0 < 10  # one wait for all, not one per process


def test_the_group_of_a_leader_is_killed_with_it() -> None:
    """The leader leaves on SIGTERM (exit 0) but its child ignores SIGTERM: ``group=True`` SIGKILLs
    the rest of the group; without it the child would be left running."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout is not None
    child = psutil.Process(int(leader.stdout.readline()))
    assert os.getpgid(child.pid) == leader.pid and child.ppid() == leader.pid
    assert stop_processes([leader], signal.SIGTERM, timeout_s=30, group=True) == [0]
    assert running([child]) == []
    assert group_members(leader.pid) == []  # dead and reaped
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)
    assert kill_group(leader.pid) == []  # nothing left to kill


def test_a_leader_that_ignores_sigterm_takes_its_group_down_with_sigkill() -> None:
    leader = subprocess.Popen([sys.executable, "-c", LEADER.replace("lambda *a: sys.exit(0)", "signal.SIG_IGN")],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert leader.stdout is not None
    child = psutil.Process(int(leader.stdout.readline()))
    assert stop_processes([leader], signal.SIGTERM, timeout_s=1.0, group=True) == [-signal.SIGKILL]
    assert running([child]) == [] and group_members(leader.pid) == []


def test_other_processes_exited_and_foreign_ones() -> None:
    """A Popen that already ended keeps its code; a psutil handle of a process that is not our
    child is stopped too, its code unknown (None)."""
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    done.wait()
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout is not None
    grandchild = psutil.Process(int(leader.stdout.readline()))  # the leader's child, not ours
    try:
        assert stop_processes([done, grandchild], signal.SIGTERM, timeout_s=0.5) == [5, None]
        assert running([grandchild]) == []
    finally:
        stop_processes([leader], signal.SIGKILL, group=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_the_one_asked_for(sig: int) -> None:
    proc = _start("import time" + READY)  # default handlers (Python ends on SIGINT by re-raising it)
    assert stop_processes([proc], sig, timeout_s=30) == [-sig]
