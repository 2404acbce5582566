"""Answer equivalence with a hard time bound, safe to call from any thread.

``Verifier.check(gold, pred)`` runs in three tiers:
1. in the calling thread: clean both answers (``normalize.clean_answer``); identical strings and
   plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``) are decided exactly (microseconds);
2. input caps: an answer longer than ``max_answer_chars``, with unbalanced braces or with braces
   nested deeper than ``max_brace_depth`` is rejected (scored wrong) without parsing;
3. everything else goes to math-verify in a worker process (``worker.py``) with its own timeouts
   off; the caller waits at most ``timeout_s`` for the answer, then kills the worker (a stuck sympy
   call cannot be interrupted inside a thread) and counts the sample as wrong. A replacement worker
   is spawned at once; its start-up (~0.5 s) is not part of ``timeout_s``.

Verdicts of tier 3 are cached per (gold, pred) pair, and concurrent checks of the same pair wait
for the one in flight, so a group of G identical unusual answers costs one parse. Callers beyond
``workers`` concurrent slow-path checks queue for a worker.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from .normalize import brace_depth, clean_answer, numbers_equal, parse_number

log = logging.getLogger(__name__)

# Ground truths come from datasets; caps for them are generous and a rejection is logged.
MAX_GOLD_CHARS = 4096
MAX_GOLD_BRACE_DEPTH = 64


class RewardError(RuntimeError):
    """The scoring machinery itself failed (e.g. a math-verify worker could not start)."""


class Verdict(enum.Enum):
    """Outcome of one equivalence check; only EQUAL counts as correct."""

    EQUAL = "equal"
    NOT_EQUAL = "not_equal"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    ERROR = "error"


def _src_root() -> str:
    import vapo_async

    return str(Path(vapo_async.__file__).resolve().parents[1])


class _Worker:
    """One math-verify subprocess speaking JSON lines; not thread-safe (the pool hands it out)."""

    def __init__(self, memory_mb: int, start_timeout_s: float, cpu_s_per_request: int) -> None:
        self.memory_mb = memory_mb
        self.cpu_s_per_request = cpu_s_per_request
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._buf = b""
        self._next_id = 0

    def spawn(self) -> None:
        """Start the process without waiting for it to be ready."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_src_root(), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "vapo_async.rewards.worker"]
        cmd += [
            "--memory-mb",
            str(self.memory_mb),
            "--cpu-s-per-request",
            str(self.cpu_s_per_request),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env
        )
        self._ready, self._buf = False, b""

    def ensure_ready(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.spawn()
        assert self.proc is not None
        if not self._ready:
            line = self._read_line(time.monotonic() + self.start_timeout_s)
            if line is None or json.loads(line) != {"ready": True}:
                code = self.proc.poll()
                self.kill()
                raise RewardError(
                    f"math-verify worker did not start within {self.start_timeout_s:.0f} s "
                    f"(exit code {code}; its stderr is above)"
                )
            self._ready = True
        return self.proc

    def _read_line(self, deadline: float) -> bytes | None:
        """One reply line, or None on timeout or end of file."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:  # not select(): fds above 1024 in big processes
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _send(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self.proc.stdin.fileno(), view) :]

    def compare(self, gold: str, pred: str, timeout_s: float) -> Verdict:
        self.ensure_ready()
        self._next_id += 1
        request = {"id": self._next_id, "gold": gold, "pred": pred}
        try:
            self._send(json.dumps(request).encode() + b"\n")
        except BrokenPipeError:
            self.kill()
            return Verdict.ERROR
        line = self._read_line(time.monotonic() + timeout_s)
        if line is None:
            died = self.proc is not None and self.proc.poll() is not None
            self.kill()
            self.spawn()  # the replacement imports sympy while the caller moves on
            return Verdict.ERROR if died else Verdict.TIMEOUT
        reply = json.loads(line)
        if reply.get("id") != self._next_id:
            self.kill()
            raise RewardError(
                f"math-verify worker answered request {reply.get('id')}, expected {self._next_id}"
            )
        if "error" in reply:
            log.warning(
                "math-verify raised %s on pred=%.80r gold=%.80r", reply["error"], pred, gold
            )
            return Verdict.ERROR
        return Verdict.EQUAL if reply["equal"] else Verdict.NOT_EQUAL

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.proc, self._ready, self._buf = None, False, b""


def _kill_all(workers: list[_Worker], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child must not kill its parent's workers
        return
    for w in workers:
        w.kill()


class VerifyPool:
    """``workers`` math-verify subprocesses shared by all threads of the process that made it."""

    def __init__(
        self,
        workers: int,
        memory_mb: int = 2048,
        start_timeout_s: float = 60.0,
        cpu_s_per_request: int = 30,
    ) -> None:
        if workers < 1:
            raise ValueError(f"VerifyPool needs at least one worker, got {workers}")
        args = (memory_mb, start_timeout_s, cpu_s_per_request)
        self._workers = [_Worker(*args) for _ in range(workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for w in self._workers:
            self._idle.put(w)
        self.pid = os.getpid()
        self._finalizer = weakref.finalize(self, _kill_all, self._workers, self.pid)

    def warmup(self) -> None:
        """Start every worker now instead of on first use."""
        taken = [self._idle.get() for _ in self._workers]
        try:
            for w in taken:
                if w.proc is None:
                    w.spawn()
            for w in taken:
                w.ensure_ready()
        finally:
            for w in taken:
                self._idle.put(w)

    def compare(self, gold: str, pred: str, timeout_s: float) -> Verdict:
        if not self._finalizer.alive:
            raise RewardError("VerifyPool is closed")
        w = self._idle.get()
        try:
            return w.compare(gold, pred, timeout_s)
        finally:
            self._idle.put(w)

    def close(self) -> None:
        """Kill the worker processes (also done when the pool is garbage-collected or at exit)."""
        self._finalizer()


class Verifier:
    """Thread-safe ``check(gold, pred) -> Verdict`` with a per-call time bound (see module doc)."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        workers: int = 1,
        max_answer_chars: int = 512,
        max_brace_depth: int = 12,
        memory_mb: int = 2048,
        start_timeout_s: float = 60.0,
        cache_size: int = 4096,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        self.max_brace_depth = max_brace_depth
        # CPU cap per check, only reached by an orphaned worker (the wall-clock kill comes first)
        cpu_s = math.ceil(timeout_s) + 5
        self._pool_args = (workers, memory_mb, start_timeout_s, cpu_s)
        self._pool: VerifyPool | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Verdict] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[tuple[str, str], Future[Verdict]] = {}
        self.counts: dict[str, int] = {
            "fast": 0,
            "slow": 0,
            "cached": 0,
            "rejected": 0,
            "timeout": 0,
            "error": 0,
        }

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def pool(self) -> VerifyPool:
        """This process's worker pool (a forked child starts its own; its parent's stay untouched)."""
        with self._lock:
            if self._pool is None or self._pool.pid != os.getpid():
                self._pool = VerifyPool(*self._pool_args)
            return self._pool

    def check(self, gold: str, pred: str) -> Verdict:
        """Whether ``pred`` is equivalent to ``gold``; never raises on pathological input."""
        g, p = clean_answer(gold), clean_answer(pred)
        if not p:
            self._count("fast")
            return Verdict.NOT_EQUAL
        if g == p:
            self._count("fast")
            return Verdict.EQUAL
        gn, pn = parse_number(g), parse_number(p)
        if gn is not None and pn is not None:
            self._count("fast")
            return Verdict.EQUAL if numbers_equal(gn, pn) else Verdict.NOT_EQUAL
        if len(p) > self.max_answer_chars or not 0 <= brace_depth(p) <= self.max_brace_depth:
            self._count("rejected")
            return Verdict.REJECTED
        if len(g) > MAX_GOLD_CHARS or not 0 <= brace_depth(g) <= MAX_GOLD_BRACE_DEPTH:
            log.warning("ground truth rejected (too long or braces unbalanced/too deep): %.80r", g)
            self._count("rejected")
            return Verdict.REJECTED
        return self._slow(g, p)

    def _slow(self, g: str, p: str) -> Verdict:
        key = (g, p)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.counts["cached"] += 1
                return cached
            pending = self._inflight.get(key)
            if pending is None:  # this thread checks; concurrent callers with the same pair wait
                self._inflight[key] = future = Future()
            else:
                self.counts["cached"] += 1
        if pending is not None:
            return pending.result()
        try:
            verdict = self.pool().compare(g, p, self.timeout_s)
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            future.set_exception(e)
            raise
        self._count({Verdict.TIMEOUT: "timeout", Verdict.ERROR: "error"}.get(verdict, "slow"))
        if verdict is Verdict.TIMEOUT:
            log.warning("math-verify timed out after %.1f s on pred=%.80r", self.timeout_s, p)
        with self._lock:
            del self._inflight[key]
            self._cache[key] = verdict
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.set_result(verdict)
        return verdict

    def warmup(self) -> None:
        """Start the math-verify workers now (otherwise the first slow-path check does)."""
        self.pool().warmup()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
