"""Blocked reverse linear scan: the engine under GAE.

Computes, for every row b of a (B, T) tensor ``d`` with a per-row coefficient ``x[b]`` in [0, 1],

    A[b, t] = d[b, t] + x[b] * A[b, t + 1],      A[b, T] = carry[b]  (0 by default)

which is GAE's recurrence (PAPER.md, "Decoupled GAE": A_t = delta_t + gamma * lambda * A_{t+1})
once ``d`` holds the TD residuals and ``x = gamma * lambda``.

How (instead of a Python loop over T): T is cut into chunks of C tokens. Inside a chunk the scan
is a (C x C) triangular Toeplitz matrix per row, W[j, i] = x^(j - i) for j >= i, so all chunks of
all rows are done by one batched matmul (B batches of (T/C, C) @ (C, C)). The values at the chunk
starts obey the same recurrence one level up, over T/C starts with coefficient y = x^C; that level
(and the ones above it, recursively) runs in float64 with one shared matrix between two per-row
scalings (``_upper_scan``), because a batched matmul costs microseconds per row and call, which
would dominate on these small arrays. Last, every chunk adds its carry-in:
A[t] += x^(C - i) * A[start of the next chunk].

Numerics: level 1 only multiplies by powers x^k <= 1, so x = 0 gives W = identity and the result
is exactly d, and x = 1 gives a plain reverse cumulative sum. The upper levels scale by y^j and
y^-j, which is as accurate as the recurrence as long as both are normal float64 numbers: y is
clamped to >= 1e-15, an error below 1e-15 * |A| that only rows with x < 0.12 can see (see
``_upper_scan``); with x = 0 those values are multiplied by 0, so lambda = 0 stays exact. Works for
float32 and float64 (callers upcast half precision) on any device.

Cost: 2 * C multiply-adds per element in the level-1 matmul plus a few passes over arrays C times
smaller; a few dozen tensor ops per call in all, none per token. C = 16 (one AVX-512 register of
float32) was the fastest of 8 / 16 / 32 for the batched matmul in a microbenchmark on this CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 16
"""Chunk length C of each scan level (see the module docstring)."""

_INDEX_CACHE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _decay_indices(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the power table of ``_powers`` (cached per size and device).

    Returns:
        (C * C,) long: entry (j, i) -> j - i for j >= i, else C + 1 (the table's zero column);
        (C,) long: entry i -> C - i.
    """
    key = (size, str(device))
    if key not in _INDEX_CACHE:
        k = torch.arange(size, device=device)
        expo = k[:, None] - k[None, :]
        toeplitz = torch.where(expo >= 0, expo, torch.full_like(expo, size + 1)).reshape(-1)
        _INDEX_CACHE[key] = (toeplitz, size - k)
    return _INDEX_CACHE[key]


def _powers(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C + 2) table [1, x, x^2, ..., x^C, 0] per row (cumprod: no pow kernel, 0^0 = 1).

    Powers below the dtype's smallest normal number are flushed to 0 (an absolute change below
    1e-38 * |d| in float32), because subnormal operands slow CPU arithmetic down ~100x.
    """
    b = x.shape[0]
    table = x.new_empty(b, size + 2)
    table[:, 0] = 1.0
    torch.cumprod(x[:, None].expand(b, size), dim=1, out=table[:, 1 : size + 1])
    table[:, size + 1] = 0.0
    # Subnormal powers (x^k < 1e-38 in float32) change no result but make every matmul slow.
    return table.masked_fill_(table < torch.finfo(table.dtype).tiny, 0.0)


_Y_FLOOR = 1e-15
"""Upper levels clamp their coefficient y = x^(C^k) to at least this (float64; see _upper_scan)."""


def _upper_constants(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cached float64 constants of ``_upper_scan`` for chunk length C.

    Returns:
        U (C, C) with U[j, i] = 1 for j >= i (``e @ U`` is a reverse cumsum inside each chunk),
        exponents (C,) = [0, 1, ..., C-1] and their negatives.
    """
    key = (-size, str(device))
    if key not in _INDEX_CACHE:
        k = torch.arange(size, device=device, dtype=torch.float64)
        _INDEX_CACHE[key] = ((k[:, None] >= k[None, :]).to(torch.float64), k)  # type: ignore[assignment]
    upper, k = _INDEX_CACHE[key]
    return upper, k, -k


def _upper_scan(s: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
    """A[:, k] = s[:, k] + y * A[:, k + 1], A[:, n] = 0, for the small arrays of chunk starts.

    Per-row matrices (a batched matmul) cost a few microseconds per row and call, which dominates
    on these arrays (T / C long), so the upper levels use one shared matrix instead:
    sum_{j>=i} y^(j-i) s_j = y^-i * sum_{j>=i} (y^j s_j), a reverse cumsum (``@ U``) between two
    per-row scalings. It has the rounding error of the plain recurrence but needs y^(C-1) and
    y^-(C-1) to be normal numbers, hence float64 and y clamped to >= 1e-15 (y^15 >= 1e-225, far
    from the subnormal range). Since y = x^C, the clamp only acts on rows with x < 0.12; it changes
    a carried value by at most 1e-15 * |A|, which reaches a token multiplied by x^(C-i) <= x, so
    the error stays below float64 rounding. Where x = 0 exactly (lambda 0) these values are
    multiplied by x^(C-i) = 0 afterwards, so that case stays exact.

    Args:
        s: (B, n) values at chunk starts (any float dtype).
        y: (B,) coefficients in [0, 1].
        chunk: C.

    Returns:
        (B, n) float64 tensor.
    """
    b, n = s.shape
    pad = (-n) % chunk if n > chunk else 0
    size = min(n + pad, chunk)
    m = (n + pad) // size
    s64 = s.to(torch.float64)
    if pad:
        s64 = F.pad(s64, (pad, 0))  # zeros in front change nothing after them
    upper, expo, neg_expo = _upper_constants(size, s.device)
    y64 = y.to(torch.float64).clamp(min=_Y_FLOOR)[:, None]  # (B, 1)
    local = (s64.view(b, m, size) * torch.pow(y64, expo)[:, None, :]) @ upper[:size, :size]
    local.mul_(torch.pow(y64, neg_expo)[:, None, :])  # (B, m, C): scan inside each chunk
    if m > 1:
        starts = _upper_scan(local[:, :, 0], y64[:, 0] ** size, chunk)  # y^C one level up
        nxt = torch.zeros_like(starts)
        nxt[:, :-1] = starts[:, 1:]
        local.addcmul_(torch.pow(y64, size + neg_expo)[:, None, :], nxt[:, :, None])  # y^(C-i) * carry
    out = local.view(b, m * size)
    return out[:, pad:] if pad else out


def reverse_scan(
    d: torch.Tensor,
    x: torch.Tensor,
    carry: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Solve A[:, t] = d[:, t] + x * A[:, t + 1] with A[:, T] = carry, vectorised over B and T.

    Args:
        d: (B, T) float32/float64 inputs (finite; callers zero out what must not contribute).
        x: (B,) per-row decay coefficients in [0, 1], same dtype and device as ``d``.
        carry: (B,) value of A just past the end (A[:, T]); None means 0.
        chunk: C, the chunk length of every level (>= 2).
        out: optional contiguous (B, T) buffer for the result (must not overlap ``d``).

    Returns:
        (B, T) tensor A (``out`` when given; ``d`` is never modified).
    """
    if d.dim() != 2 or x.shape != d.shape[:1]:
        raise ValueError(f"reverse_scan: expected d (B, T) and x (B,), got {tuple(d.shape)} and {tuple(x.shape)}")
    if chunk < 2:
        raise ValueError(f"reverse_scan: chunk must be >= 2, got {chunk}")
    b, t = d.shape
    if out is None:
        out = torch.empty(b, t, dtype=d.dtype, device=d.device)
    elif out.shape != d.shape or not out.is_contiguous():
        raise ValueError(f"reverse_scan: out must be a contiguous {tuple(d.shape)} tensor")
    if b == 0 or t == 0:
        return out
    if carry is not None:
        d = d.clone()
        d[:, -1].addcmul_(x, carry)  # A[T-1] = d[T-1] + x * carry: fold the carry into the input
    if t % chunk and t > chunk:
        # Zeros in front change nothing after them (the scan runs backwards): pad to a multiple of C.
        out.copy_(reverse_scan(F.pad(d, (chunk - t % chunk, 0)), x, chunk=chunk)[:, -t:])
        return out
    size = min(t, chunk)
    table = _powers(x, size)
    toeplitz_idx, carry_idx = _decay_indices(size, d.device)
    weights = table.index_select(1, toeplitz_idx).view(b, size, size)  # W[b, j, i] = x^(j - i)
    n = t // size
    local = out.view(b, n, size)
    torch.bmm(d.reshape(b, n, size), weights, out=local)  # scan inside every chunk at once
    if n > 1:
        # A at the chunk starts: the same recurrence over n starts with coefficient x^C.
        starts = _upper_scan(local[:, :, 0], table[:, size], chunk)
        nxt = local.new_zeros(b, n)  # in d's dtype: a mixed-dtype addcmul below would be slow
        nxt[:, :-1] = starts[:, 1:]  # carry-in of chunk k = A at the start of chunk k + 1
        local.addcmul_(table.index_select(1, carry_idx)[:, None, :], nxt[:, :, None])  # + x^(C-i) * carry
    return out
