"""Losses: hand-derived values (clip-higher, aggregation, behaviour caps), padding and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from vapo_async.algo.advantages import overlong_penalty
from vapo_async.algo.losses import policy_loss, positive_nll_loss, value_loss

VAPO_KW = dict(clip_low=0.2, clip_high=0.28, behav_cap=None, behav_mode="mask", aggregation="token")


def _tokens(ratios: list[float], advs: list[float]) -> tuple[torch.Tensor, ...]:
    """One response whose tokens have the given ratios u = pi_theta / pi_prox (logp_prox = -1)."""
    prox = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    logp = prox + torch.tensor([ratios], dtype=torch.float64).log()
    return logp, prox, prox.clone(), torch.tensor([advs], dtype=torch.float64), torch.ones(1, len(ratios), dtype=torch.bool)


def test_clip_higher_boundaries() -> None:
    # ratio 1.5, A = +2: min(1.5 * 2, clip(1.5, 0.8, 1.28) * 2) = min(3.0, 2.56) = 2.56 = 1.28 * A
    loss, _ = policy_loss(*_tokens([1.5], [2.0]), **VAPO_KW)
    assert loss.item() == pytest.approx(-1.28 * 2.0, abs=1e-12)
    # ratio 0.5, A = -2: min(0.5 * -2, clip(0.5, 0.8, 1.28) * -2) = min(-1.0, -1.6) = -1.6 = 0.8 * A
    loss, _ = policy_loss(*_tokens([0.5], [-2.0]), **VAPO_KW)
    assert loss.item() == pytest.approx(-0.8 * -2.0, abs=1e-12)
    # inside the trust region the surrogate is the plain ratio * A: 1.1 * 2 = 2.2
    loss, _ = policy_loss(*_tokens([1.1], [2.0]), **VAPO_KW)
    assert loss.item() == pytest.approx(-2.2, abs=1e-12)
    # symmetric PPO clip caps the same token at 1.2 * A
    loss, _ = policy_loss(*_tokens([1.5], [2.0]), **{**VAPO_KW, "clip_high": 0.2})
    assert loss.item() == pytest.approx(-2.4, abs=1e-12)


def test_clip_fraction_and_gradient_of_clipped_tokens() -> None:
    # tokens: (1.5, +1) clipped high, (1.0, +1) not clipped, (0.5, -1) clipped low -> 2/3
    logp, prox, behav, adv, mask = _tokens([1.5, 1.0, 0.5], [1.0, 1.0, -1.0])
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, prox, behav, adv, mask, **VAPO_KW)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d(-u * A / 3)/dlogp = -u * A / 3 for the unclipped token (u = 1, A = 1); clipped ones get 0
    assert logp.grad.tolist() == [[0.0, pytest.approx(-1 / 3), 0.0]]


def test_token_vs_sequence_aggregation() -> None:
    # Two responses, lengths 1 and 3, ratio 1 everywhere so each token contributes -A.
    # A: response 0 -> [4], response 1 -> [1, 1, 1]
    # token:    -(4 + 1 + 1 + 1) / 4 tokens            = -7/4 = -1.75
    # sequence: -(4 / 1 + 3 / 3) / 2 responses          = -5/2 = -2.5
    logp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    tok, _ = policy_loss(logp, logp, logp, adv, mask, **VAPO_KW)
    seq, _ = policy_loss(logp, logp, logp, adv, mask, **{**VAPO_KW, "aggregation": "sequence"})
    assert tok.item() == pytest.approx(-1.75) and seq.item() == pytest.approx(-2.5)
    # an explicit normalizer (e.g. tokens of the whole training batch) replaces the denominator
    tok8, _ = policy_loss(logp, logp, logp, adv, mask, **VAPO_KW, normalizer=8.0)
    assert tok8.item() == pytest.approx(-7 / 8)


@pytest.mark.parametrize(("mode", "expected"), [("truncate", -2.5), ("mask", -2.5 / 3)])
def test_behaviour_weight_truncate_vs_mask(mode: str, expected: float) -> None:
    # behaviour weights pi_prox / pi_behav = [0.5, 2, 8], cap 5, ratio 1, A = 1 (loss_t = -w_t):
    # truncate: w = [0.5, 2, 5] -> -(0.5 + 2 + 5) / 3 = -2.5
    # mask:     w = [0.5, 2, 0] -> -(0.5 + 2 + 0) / 3 = -0.8333 (the masked token stays in the count)
    prox = torch.zeros(1, 3, dtype=torch.float64)
    behav = -torch.tensor([[0.5, 2.0, 8.0]], dtype=torch.float64).log()
    kw = {**VAPO_KW, "behav_cap": 5.0, "behav_mode": mode}
    loss, m = policy_loss(prox, prox, behav, torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool), **kw)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["behav_capped_frac"].item() == pytest.approx(1 / 3)
    assert m["behav_weight_max"].item() == pytest.approx(8.0)
    assert m["behav_weight_mean"].item() == pytest.approx(10.5 / 3)
    # no cap: the weight is disabled entirely (w = 1) -> -1
    loss, _ = policy_loss(prox, prox, behav, torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool), **VAPO_KW)
    assert loss.item() == pytest.approx(-1.0)


def test_padding_poison_and_gradients_only_on_valid_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = 4, 9
    mask = torch.tensor([[1] * 9, [1] * 4 + [0] * 5, [0] * 3 + [1] * 6, [0] * 9], dtype=torch.bool)
    base = [torch.randn(b, t, generator=gen) * 0.1 - 1.0 for _ in range(3)] + [torch.randn(b, t, generator=gen)]
    results = []
    for poison in (0.0, float("nan"), 1e30):
        logp, prox, behav, adv = (torch.where(mask, x, poison) for x in base)
        logp.requires_grad_(True)
        values = torch.where(mask, base[3], poison).requires_grad_(True)
        p_loss, p_metrics = policy_loss(logp, prox, behav, adv, mask, **{**VAPO_KW, "behav_cap": 2.0})
        v_loss, v_metrics = value_loss(values, prox, adv, mask, clip=0.2, aggregation="sequence")
        n_loss = positive_nll_loss(logp, mask, torch.tensor([True, True, True, False]))
        (p_loss + v_loss + n_loss).backward()
        assert torch.isfinite(logp.grad).all() and torch.isfinite(values.grad).all()
        assert torch.all(logp.grad[~mask] == 0) and torch.all(values.grad[~mask] == 0)
        assert torch.all(logp.grad[mask] != 0)
        metrics = {**p_metrics, **v_metrics}
        assert all(torch.isfinite(v) for v in metrics.values())
        results.append((p_loss.detach(), v_loss.detach(), n_loss.detach(), logp.grad, values.grad, metrics))
    for other in results[1:]:
        for got, want in zip(other[:5], results[0][:5], strict=True):
            assert torch.equal(got, want)
        assert all(torch.equal(other[5][k], results[0][5][k]) for k in results[0][5])


def test_value_loss_hand_values_and_clip() -> None:
    # no clip: 0.5 * ((1 - 0)^2 + (2 - 0)^2) / 2 tokens = 0.5 * 5 / 2 = 1.25
    v = torch.tensor([[1.0, 2.0]])
    loss, m = value_loss(v, v, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), clip=None, aggregation="token")
    assert loss.item() == pytest.approx(1.25) and m["value_mse"].item() == pytest.approx(2.5)
    # clip 0.5 with V_old = 3, V = 1, R = 0: V_c = 3 + clip(-2, -0.5, 0.5) = 2.5
    # max(0.5 * 1^2, 0.5 * 2.5^2) = 3.125 and the clipped branch (constant in V) gives no gradient
    v = torch.tensor([[1.0]], requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[3.0]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), clip=0.5, aggregation="token")
    assert loss.item() == pytest.approx(3.125) and m["value_clip_frac"].item() == 1.0
    loss.backward()
    assert v.grad.item() == 0.0


def test_value_loss_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, m = value_loss(returns.clone(), returns, returns, mask, clip=None, aggregation="token")
    assert m["explained_variance"].item() == pytest.approx(1.0)
    _, m = value_loss(torch.full((1, 4), 2.5), returns, returns, mask, clip=None, aggregation="token")
    assert m["explained_variance"].item() == pytest.approx(0.0, abs=1e-7)


def test_positive_nll_hand_value_and_empty() -> None:
    # positives: row 0 tokens [-1, -2], row 2 token [-4] (its other tokens are padding);
    # row 1 is negative. L_NLL = -(-1 - 2 - 4) / 3 tokens = 7/3
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -3.0, -3.0], [-4.0, float("nan"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss = positive_nll_loss(logp, mask, torch.tensor([True, False, True]))
    assert loss.item() == pytest.approx(7 / 3)
    none = positive_nll_loss(logp, mask, torch.tensor([False, False, False]))
    assert none.item() == 0.0
    none.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_overlong_penalty_dapo_eq13() -> None:
    # L_max = 20, L_cache = 4: soft band (16, 20]; L = 18 -> (16 - 18) / 4 = -0.5; L = 20 -> -1
    lengths = torch.tensor([0, 16, 17, 18, 20, 21, 100])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([20, 21]), 20, 0).tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(lengths, 20, 30)


def test_errors_name_the_problem() -> None:
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(x, x, x, torch.zeros(2, 4), mask, **VAPO_KW)
    with pytest.raises(ValueError, match="behav_mode"):
        policy_loss(x, x, x, x, mask, **{**VAPO_KW, "behav_mode": "clip"})
    with pytest.raises(ValueError, match="aggregation"):
        value_loss(x, x, x, mask, clip=None, aggregation="mean")
    assert math.isfinite(policy_loss(x, x, x, x, torch.zeros(2, 3), **VAPO_KW)[0].item())
