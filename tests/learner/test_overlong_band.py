"""DAPO's overlong band (PAPER.md, DAPO bullet): L_cache defaults to 20% of L_max = sampling.max_tokens
(DAPO: 4096 of 20480), resolved in one place (``RewardConfig.overlong_band``) for the learner and
for generator-side shaping; bad values are one line naming reward.overlong_cache_tokens."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from learner_helpers import make_groups
from omegaconf import OmegaConf

from vapo_async.algo.advantages import overlong_penalty
from vapo_async.algo.presets import preset
from vapo_async.learner.__main__ import CONF_DIR, check_overrides
from vapo_async.learner.config import ConfigError, LearnerConfig
from vapo_async.learner.module import LearnerModule
from vapo_async.learner.stream import ListSource
from vapo_async.rewards import RewardConfig, RewardFn


def _compose(overrides: list[str]) -> LearnerConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="learner", overrides=overrides))


def test_default_dapo_band_is_20_percent_of_max_tokens():
    cfg = _compose(["algo=dapo"])
    assert cfg.algo.overlong_shaping and cfg.sampling.max_tokens == 256
    assert cfg.reward.overlong_cache_tokens is None
    # rounding rule: L_cache = L_max // 5, i.e. 20% rounded down: 256 // 5 = 51 (51.2)
    band = cfg.reward.overlong_band(cfg.sampling.max_tokens)
    assert band == (256, 51)
    # R_len(L) with the soft band (205, 256]: 256 - 51 = 205
    lengths = torch.tensor([1, 100, 205, 206, 230, 255, 256])
    want = [0.0, 0.0, 0.0,   # L <= 205: no penalty (before the fix every L got -L/256: -100/256 at 100)
            -1 / 51,         # (205 - 206) / 51
            -25 / 51,        # (205 - 230) / 51
            -50 / 51,        # (205 - 255) / 51
            -1.0]            # (205 - 256) / 51 = -51/51: a truncated response
    assert overlong_penalty(lengths, *band).tolist() == pytest.approx(want)


def test_paper_band_and_an_explicit_cache():
    cfg = _compose(["algo=dapo", "model=qwen2.5-7b"])
    band = cfg.reward.overlong_band(cfg.sampling.max_tokens)
    assert band == (20480, 4096)  # 20480 // 5: DAPO's own numbers
    lengths = torch.tensor([16384, 16385, 18432, 20480])
    # threshold 20480 - 4096 = 16384; (16384 - 18432) / 4096 = -0.5
    assert overlong_penalty(lengths, *band).tolist() == pytest.approx([0.0, -1 / 4096, -0.5, -1.0])
    cfg = _compose(["algo=dapo", "reward.overlong_cache_tokens=64"])
    assert cfg.reward.overlong_band(cfg.sampling.max_tokens) == (256, 64)
    cfg = _compose(["algo=dapo", "reward.overlong_cache_tokens=0"])  # DAPO's hard -1 beyond L_max only
    assert overlong_penalty(torch.tensor([255, 256]), *cfg.reward.overlong_band(256)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("overrides", [
    ["algo=dapo", "reward.overlong_cache_tokens=300"],   # longer than the 256-token responses
    ["algo=dapo", "reward.overlong_cache_tokens=256"],   # the band would start at length 0
    ["algo=dapo", "reward.overlong_cache_tokens=-1"],
    ["algo=vapo", "reward.overlong_cache_tokens=-1"],    # negative is wrong whether used or not
])
def test_bad_cache_is_one_line_naming_the_key(overrides):
    with pytest.raises(ConfigError) as err:
        check_overrides(overrides)
    assert "reward.overlong_cache_tokens" in str(err.value) and "\n" not in str(err.value)


def test_generator_side_shaping_resolves_the_same_band():
    # L_max = max_response_tokens = 100, L_cache = 100 // 5 = 20, soft band (80, 100]
    cfg = RewardConfig(overlong_shaping=True, max_response_tokens=100)
    assert cfg.overlong_band(100, "reward.max_response_tokens") == (100, 20)
    with RewardFn(cfg) as fn:
        assert fn("Answer: 4", "4", 80).reward == 1.0    # correct, no penalty
        assert fn("Answer: 4", "4", 90).reward == 0.5    # 1 + (80 - 90) / 20
        assert fn("Answer: 5", "4", 100).reward == -2.0  # -1 + (80 - 100) / 20
    with pytest.raises(ValueError, match="reward.overlong_cache_tokens=100.*reward.max_response_tokens=100"):
        RewardConfig(overlong_shaping=True, max_response_tokens=100, overlong_cache_tokens=100)


def test_learner_setup_uses_the_resolved_band(tiny_model_dir, tmp_path):
    # one DAPO step through the real module: its rollout stream gets (L_max, L_cache) = (14, 14 // 5 = 2)
    cfg = LearnerConfig()
    cfg.algo = dataclasses.replace(preset("dapo"), batch_groups=3, group_size=4, mini_batches=1, warmup_steps=0,
                                   dynamic_sampling=False)
    cfg.batching.micro_batch_tokens = 64
    cfg.sampling.max_tokens = 14
    module = LearnerModule(cfg, str(tiny_model_dir), tmp_path, source=ListSource(make_groups(3, 4, vocab=300, seed=5)))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, max_epochs=-1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module)
    module.publishing.close()
    assert module.rollouts.stream.cfg.overlong == (14, 2)
