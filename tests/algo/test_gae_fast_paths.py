"""Every fast GAE path equals the readable recurrence (``gae(..., backend="reference")``).

Hypothesis draws ragged batches: lengths 1..T (1 always among them), right / left padding and gaps,
per-row lambdas with exact 0 and 1 in every batch, or one float lambda, gamma in {1, 0.97, 0.5, 0},
float32 and float64, padding poisoned with NaN. The readable path is itself checked against the
plain-Python float64 loop of ``algo_reference.gae_loop`` (a different code, written from the
recurrence token by token), so the chain is loop == readable == every fast path.
"""

from __future__ import annotations

import pytest
import torch
from algo_reference import gae_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from vapo_async.algo.advantages import gae, length_adaptive_lambda
from vapo_async.algo.fast import numba_gae

FAST = [
    pytest.param("compiled", marks=pytest.mark.skipif(not numba_gae.numba_available(), reason="numba not installed")),
    "torch",
    "auto",
]
SETTINGS = settings(max_examples=30, deadline=None, database=None)  # no .hypothesis/ in the repo
TOL = {torch.float64: 1e-10, torch.float32: 2e-4}
"""Absolute tolerance: float64 agrees to rounding; float32 to ~1e-7 relative per step over T <= 70
tokens with |A| <~ 30 (a few times 1e-5, well inside 2e-4)."""


@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor, float]:
    """(rewards (B, T), values (B, T), mask (B, T) bool, lambda float or (B,), gamma)."""
    b = draw(st.integers(1, 7))
    t = draw(st.integers(1, 70))  # T > 16 and not a multiple of it exercises the scan's padding
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = 1  # a one-token response in every batch
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        layout = draw(st.sampled_from(["right", "left", "gaps"]))
        if layout == "right":
            mask[i, :n] = True
        elif layout == "left":
            mask[i, t - n :] = True
        else:  # n valid tokens at random places
            mask[i, torch.randperm(t, generator=gen)[:n]] = True
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    poison = torch.full_like(rewards, float("nan"))
    rewards, values = torch.where(mask, rewards, poison), torch.where(mask, values, poison)
    kind = draw(st.sampled_from(["per_row", "length_adaptive", "float"]))
    lam: float | torch.Tensor
    if kind == "per_row":
        lam = torch.rand(b, generator=gen, dtype=torch.float64).to(dtype)
        lam[0] = 0.0
        lam[-1] = 1.0  # b = 1: lambda 1 on the single row
    elif kind == "length_adaptive":  # VAPO eq. 5 with alpha 0.05: rows shorter than 20 get 0
        lam = length_adaptive_lambda(mask.sum(1), 0.05, dtype=dtype)
    else:
        lam = draw(st.sampled_from([0.0, 1.0, 0.95]))
    gamma = draw(st.sampled_from([1.0, 0.97, 0.5, 0.0]))
    return rewards, values, mask, lam, gamma


@SETTINGS
@given(ragged_batches())
def test_readable_gae_equals_the_plain_loop(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor, float]) -> None:
    rewards, values, mask, lam, gamma = case
    b = rewards.shape[0]
    lams = lam.tolist() if isinstance(lam, torch.Tensor) else [lam] * b
    ref_adv, ref_ret = gae_loop(rewards.double(), values.double(), mask, gamma, lams)
    adv, ret = gae(rewards, values, mask, gamma, lam, backend="reference")
    tol = TOL[rewards.dtype]
    torch.testing.assert_close(adv.double(), torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=tol)
    torch.testing.assert_close(ret.double(), torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=tol)


@pytest.mark.parametrize("backend", FAST)
@SETTINGS
@given(case=ragged_batches())
def test_fast_path_equals_readable_gae(backend: str, case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor, float]) -> None:
    rewards, values, mask, lam, gamma = case
    want_adv, want_ret = gae(rewards, values, mask, gamma, lam, backend="reference")
    adv, ret = gae(rewards, values, mask, gamma, lam, backend=backend)  # type: ignore[arg-type]
    assert adv.dtype == want_adv.dtype == rewards.dtype
    tol = TOL[rewards.dtype]
    torch.testing.assert_close(adv, want_adv, rtol=0, atol=tol)
    torch.testing.assert_close(ret, want_ret, rtol=0, atol=tol)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all()), "padding must be exactly 0"


def test_readable_gae_hand_derived() -> None:
    # One row [r = 0, 0, 1], V = [0.5, 0.5, 0.5], gamma 1, lambda 0.5:
    # delta_2 = 1 + 0 - 0.5 = 0.5;  delta_1 = 0 + 0.5 - 0.5 = 0;  delta_0 = 0
    # A_2 = 0.5;  A_1 = 0 + 0.5 * 0.5 = 0.25;  A_0 = 0 + 0.5 * 0.25 = 0.125; returns = A + 0.5.
    # A second row holds the same tokens with a gap [v, pad, v, v]: the gap is skipped.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 9.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 7.0], [0.5, 9.0, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, 1.0, 0.5, backend="reference")
    assert adv.tolist() == [[0.125, 0.25, 0.5, 0.0], [0.125, 0.0, 0.25, 0.5]]
    assert ret.tolist() == [[0.625, 0.75, 1.0, 0.0], [0.625, 0.0, 0.75, 1.0]]
