"""Plain-Python float64 references written straight from the recurrences (no torch arithmetic)."""

from __future__ import annotations

import torch


def gae_loop(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lams: list[float]
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE over the valid tokens of each row, latest first; 0 on padding.

    delta_t = r_t + gamma * V_next - V_t (V_next: value of the next valid token, 0 after the last)
    A_t = delta_t + gamma * lambda_i * A_next;  returns_t = A_t + V_t.
    """
    b, t = rewards.shape
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        a_next, v_next = 0.0, 0.0
        for j in range(t - 1, -1, -1):
            if not m[i][j]:
                continue
            delta = r[i][j] + gamma * v_next - v[i][j]
            a_next = delta + gamma * lams[i] * a_next
            adv[i][j] = a_next
            ret[i][j] = a_next + v[i][j]
            v_next = v[i][j]
    return adv, ret


def scan_loop(d: torch.Tensor, x: list[float], carry: list[float] | None = None) -> list[list[float]]:
    """A_t = d_t + x * A_{t+1}, A_T = carry."""
    b, t = d.shape
    rows = d.tolist()
    out = [[0.0] * t for _ in range(b)]
    for i in range(b):
        acc = 0.0 if carry is None else carry[i]
        for j in range(t - 1, -1, -1):
            acc = rows[i][j] + x[i] * acc
            out[i][j] = acc
    return out


def random_mask(gen: torch.Generator, b: int, t: int, layouts: tuple[str, ...] = ("right", "left", "gaps")) -> torch.Tensor:
    """(b, t) bool mask; row i uses layouts[i % len] with a random length in 1..t (gaps: ~half)."""
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        length = int(torch.randint(1, t + 1, (), generator=gen))
        layout = layouts[i % len(layouts)]
        if layout == "right":
            mask[i, :length] = True
        elif layout == "left":
            mask[i, t - length :] = True
        elif layout == "middle":
            start = int(torch.randint(0, t - length + 1, (), generator=gen))
            mask[i, start : start + length] = True
        else:
            mask[i] = torch.rand(t, generator=gen) < 0.5
    return mask
