"""Mismatch at staleness 0: hand-derived values and a loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from vapo_async.algo.mismatch import MISMATCH_KEYS, fresh_tokens, mismatch_metrics, mismatch_sums


def test_hand_derived_values() -> None:
    # token 0: pi_prox 0.5, pi_behav 0.25 -> r = 2, log r = ln 2 = 0.693147, k3 = (2 - 1) - ln 2 = 0.306853
    # token 1: equal -> r = 1, k3 = 0; token 2 was sampled by version 2 (stale): left out although
    # its gap (ln 1 - ln 0.1 = 2.302585) is the largest; token 3 is padding (mask 0)
    logp_prox = torch.tensor([[math.log(0.5), math.log(0.2), 0.0, 5.0]])
    logp_behav = torch.tensor([[math.log(0.25), math.log(0.2), math.log(0.1), -5.0]])
    versions = torch.tensor([[3, 3, 2, 3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    fresh = fresh_tokens(versions, mask, version=3)
    assert fresh.tolist() == [[True, True, False, False]]
    sums = mismatch_sums(logp_prox, logp_behav, fresh, behav_cap=1.5)
    assert set(sums) == set(MISMATCH_KEYS)
    m = mismatch_metrics({k: float(v) for k, v in sums.items()})
    assert m["mismatch/tokens"] == 2
    assert m["mismatch/kl"] == pytest.approx((1 - math.log(2)) / 2, rel=1e-6)  # 0.153426
    assert m["mismatch/abs_logp_mean"] == pytest.approx(math.log(2) / 2, rel=1e-6)  # 0.346574
    assert m["mismatch/abs_logp_max"] == pytest.approx(math.log(2), rel=1e-6)
    assert m["mismatch/capped_frac"] == 0.5  # r = 2 > 1.5 for token 0 only
    assert mismatch_sums(logp_prox, logp_behav, fresh, behav_cap=None)["capped"] == 0


def test_equal_policies_give_zero_and_no_fresh_token_gives_nothing() -> None:
    logp = torch.log(torch.rand(3, 7)).clamp(min=-20)
    fresh = torch.ones(3, 7, dtype=torch.bool)
    m = mismatch_metrics({k: float(v) for k, v in mismatch_sums(logp, logp.clone(), fresh, 2.0).items()})
    assert m["mismatch/kl"] == 0.0 and m["mismatch/abs_logp_max"] == 0.0 and m["mismatch/capped_frac"] == 0.0
    none = mismatch_sums(logp, logp - 1.0, torch.zeros(3, 7, dtype=torch.bool), 2.0)
    assert mismatch_metrics({k: float(v) for k, v in none.items()}) == {}


def test_matches_a_loop_reference() -> None:
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(4, 9, generator=g) * 3
    behav = prox + torch.randn(4, 9, generator=g) * 0.3
    versions = torch.randint(5, 7, (4, 9), generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.2).float()
    fresh = fresh_tokens(versions, mask, version=6)
    got = mismatch_metrics({k: float(v) for k, v in mismatch_sums(prox, behav, fresh, 1.2).items()})
    n = kl = ab = mx = cap = 0.0
    for i in range(4):
        for t in range(9):
            if mask[i, t] == 0 or versions[i, t] != 6:
                continue
            r = math.exp(float(prox[i, t]) - float(behav[i, t]))
            n += 1
            kl += (r - 1) - math.log(r)
            ab += abs(math.log(r))
            mx = max(mx, abs(math.log(r)))
            cap += r > 1.2
    assert n > 0
    assert got["mismatch/tokens"] == n
    assert got["mismatch/kl"] == pytest.approx(kl / n, rel=1e-5)
    assert got["mismatch/abs_logp_mean"] == pytest.approx(ab / n, rel=1e-5)
    assert got["mismatch/abs_logp_max"] == pytest.approx(mx, rel=1e-5)
    assert got["mismatch/capped_frac"] == pytest.approx(cap / n)


def test_shape_mismatch_is_refused_naming_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"logp_prox \(2, 3\).*fresh \(2, 4\)"):
        mismatch_sums(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.bool), 2.0)
