"""RewardFn end to end: values, overlong shaping, math-verify equivalence, custom `_target_`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from omegaconf import OmegaConf

from vapo_async.rewards import RewardConfig, RewardFn, Score, build_reward_fn, overlong_penalty


@pytest.fixture(scope="module")
def fn() -> Iterator[RewardFn]:
    with build_reward_fn(RewardConfig(timeout_s=2.0)) as f:
        yield f


def test_default_rewards_are_plus_minus_one(fn: RewardFn) -> None:
    assert fn("2 + 3 = 5\nAnswer: 5", "5", 10) == Score(1.0, True, True)
    assert fn("2 + 3 = 6\nAnswer: 6", "5", 10) == Score(-1.0, False, True)
    assert fn("I do not know", "5", 10) == Score(-1.0, False, False)


def test_one_zero_rewards_and_unformatted_value() -> None:
    with build_reward_fn(RewardConfig(correct=1.0, wrong=0.0, unformatted=-0.5)) as f:
        assert f("Answer: 5", "5", 3) == Score(1.0, True, True)
        assert f("Answer: 4", "5", 3) == Score(0.0, False, True)
        assert f("five", "5", 3) == Score(-0.5, False, False)


def test_overlong_penalty_hand_values() -> None:
    # L_max = 100, L_cache = 20, so the ramp starts after 100 - 20 = 80 tokens.
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == -0.5  # (80 - 90) / 20
    assert overlong_penalty(99, 100, 20) == -0.95  # (80 - 99) / 20
    assert overlong_penalty(100, 100, 20) == -1.0  # (80 - 100) / 20
    assert overlong_penalty(101, 100, 20) == -1.0  # truncated: -1


def test_overlong_shaping_adds_to_correctness() -> None:
    cfg = RewardConfig(overlong_shaping=True, max_response_tokens=100, overlong_cache_tokens=20)
    with build_reward_fn(cfg) as f:
        assert f("Answer: 5", "5", 90) == Score(0.5, True, True)  # +1 - 0.5
        assert f("Answer: 4", "5", 95) == Score(-1.75, False, True)  # -1 + (80 - 95) / 20
        assert f("Answer: 5", "5", 50).reward == 1.0


def test_config_validation_messages() -> None:
    with pytest.raises(ValueError, match="reward.overlong_cache_tokens=10: .* in \\[0, reward.max_response_tokens=10\\)"):
        RewardConfig(overlong_shaping=True, max_response_tokens=10, overlong_cache_tokens=10)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="answer_formats"):
        RewardConfig(answer_formats=["latex"])
    with pytest.raises(ValueError, match="'_target_'"):
        RewardConfig(custom={"path": "x.y"})


def test_config_is_a_valid_structured_config() -> None:
    """The lead registers RewardConfig in Hydra's ConfigStore: overrides must round-trip."""
    node = OmegaConf.structured(RewardConfig)
    node.merge_with(OmegaConf.from_dotlist(["wrong=0.0", "answer_formats=[answer_line]"]))
    cfg = OmegaConf.to_object(node)
    assert (
        isinstance(cfg, RewardConfig)
        and cfg.wrong == 0.0
        and list(cfg.answer_formats) == ["answer_line"]
    )


@pytest.mark.parametrize(
    ("response", "gold", "correct"),
    [
        ("Answer: 1/2", "0.5", True),
        ("Answer: $\\frac{1}{2}$", "0.5", True),
        ("\\boxed{\\frac{1}{2}}", "1/2", True),
        ("Answer: 1,000", "1000", True),
        ("#### 1,000", "1000", True),
        ("Answer: 18 dollars", "18", True),
        ("Answer: $18.00", "18", True),
        ("Answer: 0.333333", "\\frac{1}{3}", True),
        ("Answer: 0.33", "\\frac{1}{3}", False),
        # below: not plain numbers, decided by math-verify in the worker process
        ("Answer: \\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
        ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", True),
        ("Answer: x = 3", "3", True),
        ("Answer: (1, 2)", "(1,2)", True),
        ("Answer: \\sqrt{4}", "2", True),
        ("Answer: 2\\sqrt{2}", "\\sqrt{8}", True),
        ("Answer: \\sqrt{3}", "2", False),
        ("Answer: many", "5", False),
        ("Answer: 50\\%", "50", True),
    ],
)
def test_equivalence(fn: RewardFn, response: str, gold: str, correct: bool) -> None:
    score = fn(response, gold, 5)
    assert (score.correct, score.formatted) == (correct, True)
    assert score.reward == (1.0 if correct else -1.0)


def test_numeric_ground_truth_is_accepted(fn: RewardFn) -> None:
    assert fn("Answer: 204", 204, 3).correct  # AIME files may hold ints
    with pytest.raises(TypeError, match="ground_truth must be str"):
        fn("Answer: 1", None, 3)  # type: ignore[arg-type]


# --- custom rewards through Hydra `_target_` ---------------------------------------------


def length_bonus(response: str, ground_truth: str, num_tokens: int) -> float:
    """A plain-function custom reward: 1 when the ground truth appears, minus 0.01 per token."""
    return (1.0 if ground_truth in response else 0.0) - 0.01 * num_tokens


class ExactMatch:
    """A factory-style custom reward: the instance is the callable."""

    def __init__(self, bonus: float) -> None:
        self.bonus = bonus

    def __call__(self, response: str, ground_truth: str, num_tokens: int) -> Score:
        ok = response.strip() == ground_truth
        return Score(reward=self.bonus if ok else 0.0, correct=ok, formatted=True)


def _target(name: str) -> str:
    return f"{__name__}.{name}"


def test_custom_function_with_partial() -> None:
    cfg = RewardConfig(custom={"_target_": _target("length_bonus"), "_partial_": True})
    with build_reward_fn(cfg) as f:
        # 1 - 0.01 * 10 = 0.9 -> correct (reward > 0)
        assert f("the answer is 7", "7", 10) == Score(pytest.approx(0.9), True, True)
        # 0 - 0.01 * 10 = -0.1
        assert f("no", "7", 10) == Score(pytest.approx(-0.1), False, True)


def test_custom_class_with_kwargs_and_shaping() -> None:
    cfg = RewardConfig(
        custom={"_target_": _target("ExactMatch"), "bonus": 2.0},
        overlong_shaping=True,
        max_response_tokens=100,
        overlong_cache_tokens=20,
    )
    with build_reward_fn(cfg) as f:
        assert f(" 7 ", "7", 90) == Score(1.5, True, True)  # 2.0 + (80 - 90) / 20
        assert f("8", "7", 10) == Score(0.0, False, True)


def test_custom_errors_name_the_target() -> None:
    with pytest.raises(ValueError, match=r"length_bonus.*_partial_: true"):
        build_reward_fn(RewardConfig(custom={"_target_": _target("length_bonus")}))
    with pytest.raises(ValueError, match="no_such_module.fn"):
        build_reward_fn(RewardConfig(custom={"_target_": "no_such_module.fn", "_partial_": True}))
    with pytest.raises(TypeError, match="'builtins.dict' produced a dict, not a callable"):
        build_reward_fn(RewardConfig(custom={"_target_": "builtins.dict"}))


def returns_text(response: str, ground_truth: str, num_tokens: int) -> str:
    return "correct"


def test_custom_bad_return_type_is_an_error() -> None:
    cfg = RewardConfig(custom={"_target_": _target("returns_text"), "_partial_": True})
    with (
        build_reward_fn(cfg) as f,
        pytest.raises(TypeError, match="returned str; expected Score or a number"),
    ):
        f("x", "y", 1)
