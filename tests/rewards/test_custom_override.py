"""``reward.custom`` set on the command line (a Hydra mapping override) composes for the learner
and the generator, and the composed reward function scores with the custom target."""

from __future__ import annotations

import pytest
from hydra import compose, initialize, initialize_config_dir
from omegaconf import OmegaConf

from vapo_async.rewards import Score, build_reward_fn


def quarter_per_token(response: str, ground_truth: str, num_tokens: int) -> float:
    """A custom reward: 0.25 per token, +1 when the ground truth is in the response."""
    return 0.25 * num_tokens + (1.0 if ground_truth in response else 0.0)


TARGET = f"{__name__}.quarter_per_token"
OVERRIDE = f"reward.custom={{_target_:{TARGET},_partial_:true}}"


def _check_scores(reward_cfg) -> None:
    assert reward_cfg.custom == {"_target_": TARGET, "_partial_": True}
    with build_reward_fn(reward_cfg) as fn:
        # "Answer: 7" holds "7": 0.25 * 4 + 1 = 2.0; the rule-based score would be +1.0 (correct)
        assert fn("Answer: 7", "7", 4) == Score(2.0, True, True)
        # "Answer: 8" lacks "7": 0.25 * 2 + 0 = 0.5 > 0, so "correct" by the number rule; rules say -1
        assert fn("Answer: 8", "7", 2) == Score(0.5, True, True)


def test_learner_config_accepts_reward_custom_override() -> None:
    from vapo_async.learner.__main__ import CONF_DIR, check_overrides

    check_overrides([OVERRIDE])  # the learner CLI's own check: compose, build, validate
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="learner", overrides=[OVERRIDE]))
    _check_scores(cfg.reward)


def test_generator_config_accepts_reward_custom_override() -> None:
    from vapo_async.generator.config import register_configs

    register_configs()
    with initialize(version_base=None, config_path=None):
        cfg = OmegaConf.to_object(compose(config_name="generator", overrides=[OVERRIDE]))
    _check_scores(cfg.reward)


@pytest.mark.parametrize("override, message", [
    ("reward.custom=3", "must be a mapping"),
    ("reward.custom={path:x.y}", "needs a '_target_' key"),
])
def test_bad_reward_custom_overrides_name_the_key(override: str, message: str) -> None:
    from vapo_async.learner.__main__ import check_overrides
    from vapo_async.learner.config import ConfigError

    with pytest.raises(ConfigError, match=rf"reward\.custom.*{message}|{message}"):
        check_overrides([override])


def test_learner_reward_settings_reach_generators_through_the_welcome() -> None:
    """The learner's reward settings travel in the controller's welcome (msgpack over the wire)
    and replace a generator's own; a custom target with awkward strings survives the round trip,
    and a generator's own value of a field the controller sent does not survive."""
    import dataclasses

    from vapo_async.generator.config import reward_with_welcome
    from vapo_async.rewards import RewardConfig
    from vapo_async.transport.messages import MessageLimits, Welcome, decode_from_controller

    custom = {"_target_": TARGET, "_partial_": True, "note": "it's a \\ test\\", "q": "\\'x", "ks": [1, 2]}
    learner = RewardConfig(custom=custom, wrong=0.0, answer_formats=["answer_line"], answer_tail_chars=120)
    welcome = Welcome("c", "s", 0, None, "", "tcp://127.0.0.1:1", 32, 60.0, 15.0, {}, 64,
                      dataclasses.asdict(learner))
    got = decode_from_controller(welcome.to_frames(), MessageLimits())
    local = RewardConfig(wrong=-1.0, answer_formats=["boxed"])
    assert reward_with_welcome(local, got.reward) == learner
    with pytest.raises(ValueError, match="does not know.*'no_such_field'"):
        reward_with_welcome(local, {**got.reward, "no_such_field": 1})
    with pytest.raises(ValueError, match="timeout_s"):
        reward_with_welcome(local, {**got.reward, "timeout_s": 0.0})
