"""Compiled one-pass GAE for CPU tensors: the CPU fast path of ``vapo_async.algo.advantages.gae``.

Per row, the recurrence of PAPER.md "Decoupled GAE" is walked backwards over the valid tokens, as
written, in compiled code (numba):

    delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lambda_i * A_next,
    returns_t = A_t + V_t,

where V_next and A_next belong to the next *valid* token of the row (0 after the last one). Each
input element is read once and each output written once, so the cost is one pass over memory
(~1.4 ns per element on one core here, within ~1.1x of a plain copy of the same bytes; the
blocked matmul scan of ``vapo_async.algo.fast.torch_gae`` makes several passes).
Padding (mask 0) is never read: its outputs are written 0 whatever it holds (NaN included).

Choices (numerics and threading):
- Arithmetic in the compute dtype (float32 or float64, as the torch path), with the same operation
  order as the torch path, delta = (r - V) + gamma * V_next; multiply-adds may be fused (FMA), which
  only removes a rounding. In float64 the result equals the plain loop up to rounding (tests: 1e-10).
- Rows are split into contiguous blocks run on Python threads (the kernel releases the GIL), as many
  as ``torch.get_num_threads()`` allows, instead of numba's ``parallel=True``: that would start a
  second OpenMP pool beside torch's and is unsafe to call from two threads at once under numba's
  ``workqueue`` layer. The pool is rebuilt after a fork.
- numba is imported and the kernel compiled on first use, so ``import vapo_async.algo`` stays cheap.
  The compiled code is cached on disk (numba ``cache=True``: ``__pycache__`` beside this file, or
  numba's user-wide cache directory when that is read-only). Measured on 2 busy cores: the first
  call of a process costs ~0.3-1 s of numba import plus ~0.4-2.5 s per dtype compiling into an
  empty cache, or ~0.4-1.3 s in all (mostly numba's one-time set-up) with a filled one
  (benchmarks/results/bench_gae.md).
- Not fork-safe beyond what Python threads are: a child forked while a call is running must not
  use it (the pool itself is rebuilt in a child).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

MIN_ELEMS_PER_THREAD = 1 << 18
"""A thread gets at least this many elements (~0.3 ms of work), else handing it over costs more."""

_COMPILE_LOCK = threading.Lock()
_KERNEL: Callable[..., None] | None = None
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None


def _gae_kernel(
    rewards: np.ndarray,
    values: np.ndarray,
    valid: np.ndarray,
    x: np.ndarray,
    gamma: np.ndarray,
    adv: np.ndarray,
    ret: np.ndarray,
) -> None:  # pragma: no cover - runs compiled (a plain-Python call gives the same results, slowly)
    """GAE on a block of rows, compiled by ``_compiled_kernel``.

    Args:
        rewards, values: (b, T) C-contiguous, float32 or float64.
        valid: (b, T) uint8, nonzero on valid tokens.
        x: (b,) gamma * lambda per row, in the dtype of rewards.
        gamma: (1,) gamma in the dtype of rewards (an array so that float32 stays float32).
        adv, ret: (b, T) outputs, dtype of rewards; every element is written.
    """
    g = gamma[0]
    zero = g - g
    b, t = rewards.shape
    # Two rows at a time: their recurrences are independent chains, so the core overlaps one's
    # multiply-add latency with the other's (~12% faster than one row, measured). An odd last row
    # is paired with itself (computed twice, identically).
    for pair in range((b + 1) // 2):
        i = 2 * pair
        k = min(i + 1, b - 1)
        a_i = zero  # A after the last valid token
        a_k = zero
        v_next_i = zero  # V after the last valid token
        v_next_k = zero
        x_i = x[i]
        x_k = x[k]
        for j in range(t - 1, -1, -1):
            if valid[i, j]:
                v = values[i, j]
                a_i = ((rewards[i, j] - v) + g * v_next_i) + x_i * a_i  # delta_t + gamma * lambda * A_next
                adv[i, j] = a_i
                ret[i, j] = a_i + v
                v_next_i = v
            else:  # padding: not read, skipped by the recurrence
                adv[i, j] = 0
                ret[i, j] = 0
            if valid[k, j]:
                v = values[k, j]
                a_k = ((rewards[k, j] - v) + g * v_next_k) + x_k * a_k
                adv[k, j] = a_k
                ret[k, j] = a_k + v
                v_next_k = v
            else:
                adv[k, j] = 0
                ret[k, j] = 0


def _compiled_kernel() -> Callable[..., None]:
    """``_gae_kernel`` compiled by numba (imported here, on first use); cached on disk."""
    global _KERNEL
    with _COMPILE_LOCK:
        if _KERNEL is None:
            import numba

            _KERNEL = numba.njit(cache=True, nogil=True, fastmath={"contract"})(_gae_kernel)
    return _KERNEL


def _pool() -> ThreadPoolExecutor:
    """The process-wide pool of one thread per CPU (made again in a forked child, whose copy of
    the parent's pool has no threads behind it)."""
    global _POOL
    with _COMPILE_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="gae"))
        return _POOL[1]


def _check(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, x: torch.Tensor, out: tuple[torch.Tensor, ...]) -> None:
    dtype = rewards.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"gae_rows_compiled: compute dtype must be float32 or float64, got {dtype}")
    for name, arr, want in (("values", values, dtype), ("valid", valid, torch.uint8), ("adv", out[0], dtype), ("ret", out[1], dtype)):
        if arr.shape != rewards.shape or arr.dtype != want or not arr.is_contiguous() or arr.device.type != "cpu":
            raise ValueError(
                f"gae_rows_compiled: {name} must be a contiguous CPU {want} tensor of shape {tuple(rewards.shape)}, "
                f"got {arr.dtype} {tuple(arr.shape)} on {arr.device}"
            )
    if rewards.device.type != "cpu" or not rewards.is_contiguous() or x.shape != rewards.shape[:1] or x.dtype != dtype:
        raise ValueError(f"gae_rows_compiled: rewards must be contiguous on CPU and x a ({rewards.shape[0]},) {dtype} tensor")


def gae_rows_compiled(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    x: torch.Tensor,
    gamma: float,
    adv: torch.Tensor,
    ret: torch.Tensor,
    threads: int | None = None,
) -> None:
    """GAE of every row in one compiled pass, written into ``adv`` and ``ret``.

    Args:
        rewards: (B, T) contiguous CPU float32/float64 token rewards r_t.
        values: (B, T) critic values V_t, same dtype.
        valid: (B, T) contiguous uint8 mask (nonzero = valid token).
        x: (B,) gamma * lambda_i per row, same dtype.
        gamma: discount.
        adv, ret: (B, T) contiguous outputs, same dtype (overwritten everywhere; 0 on padding).
        threads: most threads to use (None: ``torch.get_num_threads()``).
    """
    _check(rewards, values, valid, x, (adv, ret))
    b, t = rewards.shape
    if b == 0 or t == 0:
        return
    kernel = _compiled_kernel()
    arrays = [a.detach().contiguous().numpy() for a in (rewards, values, valid, x)]  # views (only a strided x is copied)
    outs = [adv.detach().numpy(), ret.detach().numpy()]  # share memory with adv and ret
    g = np.array([gamma], dtype=arrays[0].dtype)
    limit = torch.get_num_threads() if threads is None else threads
    n = max(1, min(limit, b, (b * t) // MIN_ELEMS_PER_THREAD))
    bounds = [b * k // n for k in range(n + 1)]
    blocks = [(bounds[k], bounds[k + 1]) for k in range(n)]

    def run(lo: int, hi: int) -> None:
        r, v, m, xs = (a[lo:hi] for a in arrays)
        kernel(r, v, m, xs, g, outs[0][lo:hi], outs[1][lo:hi])

    futures: list[Future[None]] = [_pool().submit(run, lo, hi) for lo, hi in blocks[1:]] if n > 1 else []
    try:
        run(*blocks[0])
    finally:
        for future in futures:
            future.result()  # waits for every block; re-raises a block's error
