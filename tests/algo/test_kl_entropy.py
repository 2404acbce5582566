"""KL (k3) and entropy-bonus terms: hand-derived values, padding and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from vapo_async.algo.losses import entropy_bonus, kl_k3, kl_penalty
from vapo_async.algo.stats import entropy_from_logits


def test_kl_k3_by_hand() -> None:
    # token 0: pi_theta = 0.5, pi_ref = 0.25: d = log(0.25 / 0.5) = -ln 2, k3 = e^d - d - 1 = 0.5 + ln 2 - 1
    # token 1: equal policies: d = 0, k3 = 1 - 0 - 1 = 0;  token 2: padding holding NaN -> 0
    logp = torch.tensor([[math.log(0.5), math.log(0.3), float("nan")]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.3), float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    k3 = kl_k3(logp, ref, mask)
    torch.testing.assert_close(k3, torch.tensor([[math.log(2) - 0.5, 0.0, 0.0]], dtype=torch.float64))
    # token mean over the 2 valid tokens: (ln 2 - 0.5 + 0) / 2
    pen = kl_penalty(logp, ref, mask, "token")
    assert pen.item() == pytest.approx((math.log(2) - 0.5) / 2, abs=1e-12)
    # d k3 / d logp = -e^d + 1: token 0: 1 - 0.5 = 0.5, / 2 tokens = 0.25; token 1: 0; padding: 0 (no NaN)
    pen.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.25, 0.0, 0.0]], dtype=torch.float64))


def test_kl_penalty_sequence_aggregation_and_normalizer() -> None:
    # row 0: k3 = ln 2 - 0.5 on one of its 2 tokens -> row mean (ln 2 - 0.5) / 2; row 1: 0.
    # "sequence": mean of row means = (ln 2 - 0.5) / 4; with normalizer 1: sum of row means.
    logp = torch.log(torch.tensor([[0.5, 0.3], [0.2, 0.2]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.3], [0.2, 0.2]], dtype=torch.float64))
    mask = torch.ones(2, 2)
    assert kl_penalty(logp, ref, mask, "sequence").item() == pytest.approx((math.log(2) - 0.5) / 4, abs=1e-12)
    assert kl_penalty(logp, ref, mask, "sequence", 1.0).item() == pytest.approx((math.log(2) - 0.5) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp has shape"):
        kl_k3(logp, ref[:, :1], mask)


def test_entropy_bonus_by_hand() -> None:
    # token 0: 4 equal logits -> H = ln 4; token 1: two logits of 0 and two of -1e9 (probability
    # exactly 0 in float64) -> H = ln 2; token 2 is padding (any logits) -> excluded.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1e9, -1e9], [3.0, -2.0, 7.0, 1.0]]],
                          dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ent = entropy_from_logits(logits)
    bonus = entropy_bonus(ent, mask)
    assert bonus.item() == pytest.approx((math.log(4) + math.log(2)) / 2, abs=1e-12)  # = 1.5 ln 2
    # with the mini-batch's 3 tokens as the normalizer: (ln 4 + ln 2) / 3 = ln 2
    assert entropy_bonus(ent, mask, 3.0).item() == pytest.approx(math.log(2), abs=1e-12)
    bonus.backward()
    assert logits.grad is not None
    # uniform logits are a maximum of the entropy: zero gradient at token 0; padding gets none
    torch.testing.assert_close(logits.grad[0, 0], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(logits.grad[0, 2], torch.zeros(4, dtype=torch.float64))
    # NaN entropies on padding neither reach the value nor the gradient: d bonus / d H = [1/2, 1/2, 0]
    ent_nan = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    entropy_bonus(ent_nan, mask).backward()
    assert ent_nan.grad is not None and ent_nan.grad.tolist() == [[0.5, 0.5, 0.0]]
    assert entropy_bonus(ent.detach(), torch.zeros(1, 3)).item() == 0.0  # no valid token: exactly 0
