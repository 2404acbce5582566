"""Hypothesis properties: shapes, dtypes, empty responses and groups, all-equal groups."""

from __future__ import annotations

import pytest
import torch
from algo_reference import gae_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from vapo_async.algo.advantages import gae, group_advantages
from vapo_async.algo.losses import policy_loss, positive_nll_loss, value_loss

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SETTINGS = settings(max_examples=40, deadline=None, database=None)  # no .hypothesis/ in the repo


@st.composite
def gae_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    b = draw(st.integers(0, 6))
    t = draw(st.integers(0, 40))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(b, t, generator=gen) * 2 - 1).to(dtype)
    values = (torch.rand(b, t, generator=gen) * 2 - 1).to(dtype)
    mask = torch.rand(b, t, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    if b:
        mask[0] = False  # always one empty response
    lam = torch.rand(b, generator=gen)
    lam[lam < 0.2] = 0.0
    gamma = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    return rewards, values, mask, lam, gamma


@SETTINGS
@given(gae_inputs())
def test_gae_properties(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]) -> None:
    rewards, values, mask, lam, gamma = case
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv.shape == rewards.shape and ret.shape == rewards.shape
    assert adv.dtype == rewards.dtype and ret.dtype == rewards.dtype
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    ref_adv, ref_ret = gae_loop(rewards.double(), values.double(), mask, gamma, lam.double().tolist())
    ref_adv_t, ref_ret_t = torch.tensor(ref_adv, dtype=torch.float64), torch.tensor(ref_ret, dtype=torch.float64)
    if rewards.dtype == torch.float64:
        # lambda is float32 here, so the float64 path sees exactly these lambdas: agree to rounding
        tol = 1e-10
    else:
        # outputs rounded to the dtype (float32 inside); magnitudes are at most ~2 * T
        tol = 4 * torch.finfo(rewards.dtype).eps * (1 + max(ref_adv_t.abs().max().item() if ref_adv_t.numel() else 0, 1) * 2)
    torch.testing.assert_close(adv.double(), ref_adv_t.reshape(adv.shape), rtol=0, atol=tol)
    torch.testing.assert_close(ret.double(), ref_ret_t.reshape(ret.shape), rtol=0, atol=tol + 4 * torch.finfo(rewards.dtype).eps)


@SETTINGS
@given(
    groups=st.integers(0, 5),
    size=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    normalize=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_advantages_properties(groups: int, size: int, dtype: torch.dtype, normalize: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(-1, 2, (groups * size,), generator=gen).to(dtype)  # many all-equal groups
    adv = group_advantages(rewards, size, normalize_std=normalize)
    assert adv.shape == rewards.shape and adv.dtype == dtype
    assert not adv.isnan().any()
    by_group = adv.float().view(groups, size)
    flat = (rewards.view(groups, size) == rewards.view(groups, size)[:, :1]).all(dim=1)
    assert torch.all(by_group[flat] == 0)
    assert torch.allclose(by_group.sum(dim=1), torch.zeros(groups), atol=0.05 * size)


@SETTINGS
@given(
    b=st.integers(0, 5),
    t=st.integers(0, 12),
    dtype=st.sampled_from(DTYPES),
    density=st.sampled_from([0.0, 0.5, 1.0]),
    aggregation=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["truncate", "mask"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_losses_are_finite_and_zero_without_tokens(
    b: int, t: int, dtype: torch.dtype, density: float, aggregation: str, mode: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=gen) * 3).to(dtype).requires_grad_(True)
    prox = (-torch.rand(b, t, generator=gen) * 3).to(dtype)
    behav = (-torch.rand(b, t, generator=gen) * 3).to(dtype)
    adv = torch.randn(b, t, generator=gen).to(dtype)
    mask = torch.rand(b, t, generator=gen) < density
    p_loss, metrics = policy_loss(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28, behav_cap=5.0, behav_mode=mode, aggregation=aggregation)
    v_loss, v_metrics = value_loss(adv.float().requires_grad_(True), adv.float(), prox.float(), mask, clip=0.2, aggregation=aggregation)
    n_loss = positive_nll_loss(logp, mask, torch.ones(b, dtype=torch.bool))
    for loss in (p_loss, v_loss, n_loss):
        assert loss.dim() == 0 and torch.isfinite(loss)
        if not mask.any():
            assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in {**metrics, **v_metrics}.values())
    (p_loss + n_loss).backward()
    assert logp.grad is not None and torch.all(logp.grad[~mask] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batch(dtype: torch.dtype) -> None:
    empty = torch.zeros(0, 0, dtype=dtype)
    adv, ret = gae(empty, empty, empty.bool(), 1.0, torch.zeros(0))
    assert adv.shape == (0, 0) and ret.dtype == dtype
    assert group_advantages(torch.zeros(0, dtype=dtype), 4).shape == (0,)
