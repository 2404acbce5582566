"""Presets carry the papers' values; every VAPO technique is one switch; bad values fail loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from vapo_async.algo.presets import (
    PRESETS,
    TECHNIQUES,
    AlgoConfig,
    batch_groups_for,
    preset,
    vapo_without,
)


def test_vapo_preset_has_the_paper_values() -> None:
    c = PRESETS["vapo"]
    assert (c.lambda_critic, c.alpha, c.clip_low, c.clip_high, c.nll_coef, c.gamma) == (1.0, 0.05, 0.2, 0.28, 0.1, 1.0)
    assert c.use_critic and c.decoupled_gae and c.length_adaptive and c.aggregation == "token"
    assert c.value_warmup_steps > 0 and c.group_size > 1 and c.critic_lr > c.actor_lr


def test_baseline_presets() -> None:
    ppo, grpo, dapo = PRESETS["ppo"], PRESETS["grpo"], PRESETS["dapo"]
    assert (ppo.lambda_critic, ppo.lambda_policy, ppo.aggregation, ppo.clip_low, ppo.clip_high) == (0.95, 0.95, "sequence", 0.2, 0.2)
    assert ppo.value_warmup_steps == 0 and ppo.nll_coef == 0 and not ppo.length_adaptive
    assert ppo.group_size * ppo.batch_groups == PRESETS["vapo"].group_size * PRESETS["vapo"].batch_groups
    assert not grpo.use_critic and grpo.advantage_estimator == "group" and grpo.clip_high == 0.2
    assert dapo.advantage_estimator == "group" and dapo.clip_high == 0.28 and dapo.aggregation == "token"
    assert dapo.dynamic_sampling and dapo.overlong_shaping and dapo.kl_coef == 0.0


@pytest.mark.parametrize(
    ("technique", "changed"),
    [
        ("value_pretraining", {"value_warmup_steps": 0}),
        ("decoupled_gae", {"decoupled_gae": False}),
        ("length_adaptive_gae", {"length_adaptive": False}),
        ("token_level_loss", {"aggregation": "sequence"}),
        ("clip_higher", {"clip_high": 0.2}),
        ("positive_nll", {"nll_coef": 0.0}),
        ("group_sampling", {"group_size": 1, "batch_groups": 128}),
    ],
)
def test_vapo_without_changes_only_its_technique(technique: str, changed: dict[str, object]) -> None:
    base = dataclasses.asdict(PRESETS["vapo"])
    got = dataclasses.asdict(vapo_without(technique))
    diff = {k: got[k] for k in got if got[k] != base[k] and k != "name"}
    assert diff == changed
    assert got["name"] == f"vapo_without_{technique}"


def test_all_seven_techniques_are_listed() -> None:
    assert len(TECHNIQUES) == 7
    with pytest.raises(ValueError, match="unknown VAPO technique"):
        vapo_without("entropy")


def test_lambdas_follow_the_switches() -> None:
    lengths = torch.tensor([100, 10])
    vapo = preset("vapo")
    assert vapo.policy_lambda(lengths).tolist() == pytest.approx([0.8, 0.0])
    assert vapo.critic_lambda(lengths).tolist() == [1.0, 1.0]
    coupled = vapo_without("decoupled_gae")
    assert coupled.critic_lambda(lengths).tolist() == pytest.approx([0.8, 0.0])
    fixed = vapo_without("length_adaptive_gae")
    assert fixed.policy_lambda(lengths).tolist() == pytest.approx([0.95, 0.95])
    assert PRESETS["ppo"].critic_lambda(lengths).tolist() == pytest.approx([0.95, 0.95])


@pytest.mark.parametrize(
    ("field", "value"),
    [("clip_low", 1.0), ("behav_mode", "clip"), ("proximal", "old"), ("aggregation", "mean"), ("alpha", 0.0), ("eta", -1), ("behav_cap", 0.5), ("group_size", 0),
     ("responses_per_step", 0), ("samples_per_prompt", 0), ("value_pretraining_steps", -1)],
)
def test_validate_names_the_bad_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"AlgoConfig.{field}"):
        dataclasses.replace(PRESETS["vapo"], **{field: value})


def test_inconsistent_combinations_fail() -> None:
    with pytest.raises(ValueError, match="needs use_critic"):
        AlgoConfig(use_critic=False)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        dataclasses.replace(PRESETS["grpo"], group_size=1, batch_groups=128)
    cfg = preset("vapo")
    cfg.mini_batches = 10_000
    with pytest.raises(ValueError, match="mini_batches"):
        cfg.validate()
    assert PRESETS["vapo"].mini_batches != 10_000  # preset() returned a copy


def test_structured_config_round_trip_with_override() -> None:
    conf = OmegaConf.merge(OmegaConf.structured(PRESETS["dapo"]), OmegaConf.from_dotlist(["eta=0", "behav_cap=null"]))
    obj = OmegaConf.to_object(conf)
    assert isinstance(obj, AlgoConfig) and obj.eta == 0 and obj.behav_cap is None and obj.name == "dapo"
    bad = OmegaConf.merge(OmegaConf.structured(PRESETS["vapo"]), OmegaConf.from_dotlist(["clip_high=-1"]))
    with pytest.raises(ValueError, match="clip_high"):
        OmegaConf.to_object(bad)


def test_presets_agree_with_their_scale_fields() -> None:
    # the Python presets are the tiny scale: 128 responses per step, G = 8, 10 value-pretraining steps
    for name, c in PRESETS.items():
        assert c.batch_groups * c.group_size == c.responses_per_step == 128, name
        assert (c.samples_per_prompt, c.value_pretraining_steps) == (8, 10), name
        assert c.group_size == (1 if name == "ppo" else 8), name
        assert c.value_warmup_steps == (10 if name == "vapo" else 0), name


def test_batch_groups_for_the_scale() -> None:
    assert batch_groups_for(8192, 16) == 512  # the paper: 512 prompts x 16
    assert batch_groups_for(8192, 1) == 8192  # vanilla PPO: 8192 x 1
    assert batch_groups_for(128, 8) == 16
    with pytest.raises(ValueError, match="algo.responses_per_step=100 must be a positive multiple of algo.group_size=16"):
        batch_groups_for(100, 16)
    with pytest.raises(ValueError, match="algo.group_size=0"):
        batch_groups_for(128, 0)
