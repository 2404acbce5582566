"""``advantages_and_returns``: hand-derived values, the learner's split (rank-0 half + per
micro-batch half) equal to the one call, and both estimators equal to plain loops (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from algo_reference import gae_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from vapo_async.algo.advantages import (
    GaeLambdas,
    advantages_and_returns,
    score_responses,
    token_advantages,
)
from vapo_async.algo.presets import PRESETS

SETTINGS = settings(max_examples=30, deadline=None, database=None)  # no .hypothesis/ in the repo


def _right_mask(lengths: list[int], t: int) -> torch.Tensor:
    """(B, T) float 1 on the first L_i tokens of row i."""
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_group_estimator_with_overlong_shaping_by_hand() -> None:
    # lengths 3, 3, 3, 10 with L_max 10, L_cache 4: R_len = 0 up to 6 tokens, (6 - 10) / 4 = -1 at 10,
    # so rewards 1, -1, 1, 1 become 1, -1, 1, 0. Group of 4: mean 0.25, unbiased variance
    # (0.75^2 * 2 + 1.25^2 + 0.25^2) / 3 = 2.75 / 3, A_i = (R_i - 0.25) / (sqrt(2.75 / 3) + 1e-6).
    lengths = [3, 3, 3, 10]
    mask = _right_mask(lengths, 10)
    adv, ret = advantages_and_returns(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor(lengths), mask, None,
                                      estimator="group", group_size=4, overlong=(10, 4), lambdas=GaeLambdas())
    want = (torch.tensor([1.0, -1.0, 1.0, 0.0]) - 0.25) / (math.sqrt(2.75 / 3) + 1e-6)
    torch.testing.assert_close(adv, want[:, None] * mask)  # the response's advantage on each of its tokens
    assert ret is None


def test_gae_estimator_by_hand() -> None:
    # One response of 3 tokens, score 1 on the last, V = 0.5 everywhere, gamma 1.
    # TD residuals: delta_2 = 1 + 0 - 0.5 = 0.5, delta_1 = delta_0 = 0 + 0.5 - 0.5 = 0.
    # Policy, lambda 0.5: A = [0.5^2 * 0.5, 0.5 * 0.5, 0.5] = [0.125, 0.25, 0.5].
    # Critic, lambda 1: A_t = sum of later deltas = 0.5 -> returns = A + V = 1 = the score everywhere.
    values = torch.full((1, 4), 0.5)
    mask = _right_mask([3], 4)
    adv, ret = advantages_and_returns(torch.tensor([1.0]), torch.tensor([3]), mask, values * mask, estimator="gae",
                                      lambdas=GaeLambdas(policy=0.5, critic=1.0, alpha=None))
    assert adv.tolist() == [[0.125, 0.25, 0.5, 0.0]]
    assert ret is not None and ret.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_lambdas_decoupled_and_length_adaptive() -> None:
    # VAPO eq. 5, alpha 0.05: L = 100 -> 1 - 1 / 5 = 0.8; L = 10 -> 1 - 1 / 0.5 = -1 -> clamped to 0.
    lengths = torch.tensor([100, 10])
    assert GaeLambdas().policy_lambdas(lengths).tolist() == pytest.approx([0.8, 0.0])
    assert GaeLambdas().critic_lambdas(lengths).tolist() == [1.0, 1.0]
    coupled = GaeLambdas(policy=0.95, critic=None, alpha=None)  # vanilla PPO: one lambda for both
    assert coupled.critic_lambdas(lengths).tolist() == pytest.approx([0.95, 0.95])
    assert PRESETS["vapo"].gae_lambdas() == GaeLambdas(policy=0.95, critic=1.0, alpha=0.05)


def test_gae_needs_values_and_group_needs_a_size() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="estimator must be 'gae' \\(with values\\)"):
        token_advantages(torch.ones(2), torch.zeros(2), torch.tensor([3, 3]), mask, None, estimator="gae",
                         gamma=1.0, lambdas=GaeLambdas())
    with pytest.raises(ValueError, match="needs group_size"):
        advantages_and_returns(torch.ones(2), torch.tensor([3, 3]), mask, None, estimator="group", lambdas=GaeLambdas())


@st.composite
def scored_batches(draw: st.DrawFn) -> dict:
    """Whole groups of right-padded responses (lengths 1..T) with scores, values and settings."""
    groups, g, t = draw(st.integers(1, 4)), draw(st.integers(2, 5)), draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b = groups * g
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    scores = torch.randint(0, 2, (b,), generator=gen).float() * 2 - 1  # +1 / -1 (DAPO)
    mask = _right_mask(lengths.tolist(), t)
    return dict(
        scores=scores, lengths=lengths, mask=mask, group_size=g,
        values=torch.randn(b, t, generator=gen) * mask,
        overlong=draw(st.sampled_from([None, (t, t // 3), (t, 0)])),
        lambdas=draw(st.sampled_from([GaeLambdas(), GaeLambdas(critic=None, alpha=None), GaeLambdas(policy=0.0)])),
        gamma=draw(st.sampled_from([1.0, 0.9])),
        cuts=sorted(draw(st.sets(st.integers(1, max(1, b - 1)), max_size=3))),  # micro-batch boundaries
    )


def _loop_rewards(c: dict) -> list[float]:
    """R_i + R_len(L_i) (DAPO eq. 13) written out per response."""
    out = []
    for r, n in zip(c["scores"].tolist(), c["lengths"].tolist(), strict=True):
        if c["overlong"] is not None:
            l_max, l_cache = c["overlong"]
            r += 0.0 if n <= l_max - l_cache else (-1.0 if n > l_max else ((l_max - l_cache) - n) / l_cache)
        out.append(r)
    return out


@SETTINGS
@given(scored_batches(), st.sampled_from(["gae", "group"]))
def test_split_equals_one_call_equals_loops(c: dict, estimator: str) -> None:
    kw = dict(gamma=c["gamma"], lambdas=c["lambdas"])
    values = c["values"] if estimator == "gae" else None
    adv, ret = advantages_and_returns(c["scores"], c["lengths"], c["mask"], values, estimator=estimator,  # type: ignore[arg-type]
                                      group_size=c["group_size"], overlong=c["overlong"], **kw)
    # The learner's split: score_responses over whole groups, token_advantages per micro-batch.
    rewards, seq_adv = score_responses(c["scores"], c["lengths"], overlong=c["overlong"],
                                       group_size=c["group_size"] if estimator == "group" else None)
    b = rewards.shape[0]
    for lo, hi in zip([0, *c["cuts"]], [*c["cuts"], b], strict=True):
        part = slice(lo, hi)
        a_p, r_p = token_advantages(rewards[part], seq_adv[part], c["lengths"][part], c["mask"][part],
                                    None if values is None else values[part], estimator=estimator, **kw)  # type: ignore[arg-type]
        torch.testing.assert_close(a_p, adv[part], rtol=0, atol=1e-6)
        assert (r_p is None) == (ret is None)
        if r_p is not None:
            torch.testing.assert_close(r_p, ret[part], rtol=0, atol=1e-6)  # type: ignore[index]
    shaped = _loop_rewards(c)
    torch.testing.assert_close(rewards, torch.tensor(shaped), rtol=0, atol=1e-6)
    if estimator == "group":  # (R_i - mean) / (unbiased std + 1e-6) per group, 0 for an all-equal group
        g = c["group_size"]
        for k in range(0, b, g):
            grp = shaped[k : k + g]
            mean = sum(grp) / g
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (g - 1))
            for i in range(k, k + g):
                want = 0.0 if max(grp) == min(grp) else (shaped[i] - mean) / (std + 1e-6)
                torch.testing.assert_close(adv[i], want * c["mask"][i], rtol=0, atol=1e-5)
        return
    token_r = torch.zeros_like(c["mask"], dtype=torch.float64)
    for i, n in enumerate(c["lengths"].tolist()):
        token_r[i, n - 1] = shaped[i]  # the verifier reward on the last response token
    lam = c["lambdas"]
    ref_adv, _ = gae_loop(token_r, values.double(), c["mask"], c["gamma"], lam.policy_lambdas(c["lengths"]).tolist())
    _, ref_ret = gae_loop(token_r, values.double(), c["mask"], c["gamma"], lam.critic_lambdas(c["lengths"]).tolist())
    torch.testing.assert_close(adv.double(), torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-4)
    torch.testing.assert_close(ret.double(), torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-4)  # type: ignore[union-attr]
