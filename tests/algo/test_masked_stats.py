"""Masked statistics and log-prob helpers against direct computations on the valid entries."""

from __future__ import annotations

import pytest
import torch

from vapo_async.algo.advantages import group_advantages
from vapo_async.algo.stats import (
    entropy_from_logits,
    explained_variance,
    gather_logprobs,
    masked_mean,
    masked_var,
    masked_whiten,
)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=gen) < 0.6
    mask[4] = False  # an empty row
    return torch.where(mask, x, float("nan")), mask


def test_masked_mean_var_whiten_match_valid_entries() -> None:
    x, mask = _data()
    vals = x[mask]
    assert masked_mean(x, mask).item() == pytest.approx(vals.mean().item(), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(vals.var(unbiased=False).item(), abs=1e-12)
    rows = masked_mean(x, mask, dim=1)
    assert rows[4].item() == 0.0
    assert rows[0].item() == pytest.approx(x[0][mask[0]].mean().item(), abs=1e-12)
    w = masked_whiten(x, mask, eps=0.0)
    assert torch.all(w[~mask] == 0)
    assert w[mask].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert w[mask].var(unbiased=False).item() == pytest.approx(1.0, abs=1e-12)
    w_keep = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    assert w_keep[mask].mean().item() == pytest.approx(vals.mean().item(), abs=1e-12)
    empty = torch.zeros(3, 3, dtype=torch.bool)
    assert masked_mean(x[:3, :3], empty).item() == 0.0


def test_explained_variance() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    # V = R - [1, -1, 1, -1]: Var(residual) = 1, Var(R) = 1.25 -> 1 - 1 / 1.25 = 0.2
    v = r - torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]])
    assert explained_variance(v, r, m).item() == pytest.approx(0.2, abs=1e-6)
    assert explained_variance(v, torch.ones(1, 5), m).item() == 0.0  # Var(R) = 0: defined as 0


def test_gather_logprobs_and_entropy_match_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    for temp in (1.0, 0.7):
        ref = torch.log_softmax(logits / temp, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
        torch.testing.assert_close(gather_logprobs(logits, ids, temp), ref)
        ent = torch.distributions.Categorical(logits=logits / temp).entropy()
        torch.testing.assert_close(entropy_from_logits(logits, temp), ent)
    lp = gather_logprobs(logits.bfloat16(), ids)
    assert lp.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(logits, ids, 0.0)


def test_group_advantages_hand_values() -> None:
    # group [1, 0, 0, 0]: mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5
    # -> A = [0.75, -0.25, -0.25, -0.25] / 0.5 = [1.5, -0.5, -0.5, -0.5]
    # group [1, 1, 1, 1]: all equal -> exactly 0
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert group_advantages(r, 4, eps=0.0).tolist() == [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert group_advantages(r, 4, normalize_std=False).tolist() == [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]
    assert group_advantages(r, 1).tolist() == [0.0] * 8
    assert group_advantages(torch.tensor([0.1, 0.1, 0.1]), 3).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(r, 3)
