"""avg@k / pass@k estimators against hand-computed values and a product-form loop reference."""

from __future__ import annotations

import math
import random

import pytest

from vapo_async.eval.metrics import avg_at_k, mean_pass_at_k, pass_at_k, score_groups, summarize
from vapo_async.rewards import RewardConfig, Score, build_reward_fn


def pass_at_k_loop(n: int, c: int, k: int) -> float:
    """Chen et al.'s numerically stable form: 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2)/C(10,2) = 1 - 21/45 = 0.5333...
        (8, 0, 8, 0.0),  # nothing correct
        (8, 1, 8, 1.0),  # k = n: any correct sample counts
        (6, 4, 3, 1.0),  # n - c = 2 < k = 3: every 3-subset holds a correct one
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_product_form_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 200)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_loop(n, c, k), abs=1e-9)


def test_pass_at_k_rejects_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_avg_and_pass_over_problems() -> None:
    correct = [[True, False, False, False], [True, True, False, False], [False] * 4]
    # avg@4 = (1/4 + 2/4 + 0) / 3 = 0.25; pass@4 = (1 + 1 + 0) / 3; pass@2 = (0.5 + 5/6 + 0) / 3
    assert avg_at_k(correct) == pytest.approx(0.25)
    assert mean_pass_at_k(correct, 4) == pytest.approx(2 / 3)
    assert mean_pass_at_k(correct, 2) == pytest.approx((0.5 + (1 - 1 / 6) + 0) / 3)
    assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct))


def test_summarize_counts_format_tokens_and_truncation() -> None:
    ok, bad, unformatted = Score(1.0, True, True), Score(-1.0, False, True), Score(-1.0, False, False)
    scores = [[ok, bad], [unformatted, unformatted]]
    m = summarize(scores, [[10, 20], [30, 40]], k=2, truncated=[[False, False], [False, True]])
    assert m["avg@k"] == m["avg@2"] == pytest.approx(0.25)  # (1/2 + 0) / 2
    assert m["pass@k"] == m["pass@2"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(0.5)
    assert m["mean_reward"] == pytest.approx(-0.5)  # (1 - 1 - 1 - 1) / 4
    assert m["mean_response_tokens"] == pytest.approx(25.0)
    assert m["truncated_rate"] == pytest.approx(0.25)
    assert (m["n_problems"], m["n_samples"], m["k"]) == (2, 4, 2)


def test_score_groups_uses_the_reward_function() -> None:
    fn = build_reward_fn(RewardConfig())
    try:
        texts = [["Start: 3\nfinds 2: 3 + 2 = 5\nAnswer: 5", "Answer: 6", "no answer here"]]
        scores = score_groups(texts, ["5"], [[12, 3, 3]], fn)
    finally:
        getattr(fn, "close", lambda: None)()
    assert [(s.correct, s.formatted) for s in scores[0]] == [(True, True), (False, True), (False, False)]
    assert [s.reward for s in scores[0]] == [1.0, -1.0, -1.0]
    assert math.isclose(summarize(scores, [[12, 3, 3]], k=3)["pass@3"], 1.0)


def test_score_groups_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="token counts"):
        score_groups([["a", "b"]], ["1"], [[1]], lambda t, a, n: Score(0.0, False, False))
