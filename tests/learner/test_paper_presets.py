"""The paper presets compose to the papers' settings (PAPER.md), value by value; ``model.path=DIR``
alone means ``model=hf``; ``model=tiny`` with a directory is refused."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from vapo_async.algo.presets import AlgoConfig
from vapo_async.learner.__main__ import CONF_DIR, check_overrides
from vapo_async.learner.config import ConfigError, LearnerConfig
from vapo_async.learner.model_presets import implied_overrides, model_presets

SRC = Path(__file__).resolve().parents[2] / "src"
ALGOS = ("vapo", "ppo", "grpo", "dapo")


def _compose(overrides: list[str]) -> LearnerConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="learner", overrides=overrides))


# Every AlgoConfig field at the papers' scale, per algorithm:  field: (vapo, ppo, grpo, dapo).
# VAPO (PAPER.md "The seven VAPO techniques"): lambda_critic 1.0, alpha 0.05, clip 0.2 / 0.28,
# mu 0.1, 50 value-pretraining steps, 512 prompts x 16. Vanilla PPO (section 5.1): lambda 0.95 for
# both, per-sample loss, clip 0.2, 8192 prompts x 1. DAPO: lr 1e-6 after 20 warm-up steps, 512 x 16.
# All: 8192 responses per step in 16 mini-batches of 512, actor 1e-6, critic 2e-6, 20 warm-up steps.
PAPER_ALGO: dict[str, tuple[object, object, object, object]] = {
    "name": ("vapo", "ppo", "grpo", "dapo"),
    "use_critic": (True, True, False, False),
    "advantage_estimator": ("gae", "gae", "group", "group"),
    "gamma": (1.0, 1.0, 1.0, 1.0),
    "lambda_critic": (1.0, 0.95, 1.0, 1.0),
    "lambda_policy": (0.95, 0.95, 0.95, 0.95),
    "decoupled_gae": (True, False, False, False),
    "length_adaptive": (True, False, False, False),
    "alpha": (0.05, 0.05, 0.05, 0.05),
    "whiten_advantages": (True, True, False, False),
    "clip_low": (0.2, 0.2, 0.2, 0.2),
    "clip_high": (0.28, 0.2, 0.2, 0.28),
    "behav_cap": (5.0, 5.0, 5.0, 5.0),
    "behav_mode": ("mask", "mask", "mask", "mask"),
    "proximal": ("recompute", "recompute", "recompute", "recompute"),
    "aggregation": ("token", "sequence", "sequence", "token"),
    "value_clip": (None, None, None, None),
    "nll_coef": (0.1, 0.0, 0.0, 0.0),
    "entropy_coef": (0.0, 0.0, 0.0, 0.0),
    "kl_coef": (0.0, 0.0, 0.0, 0.0),
    "value_warmup_steps": (50, 0, 0, 0),
    "value_warmup_ev_threshold": (None, None, None, None),
    "group_size": (16, 1, 16, 16),
    "batch_groups": (512, 8192, 512, 512),
    "mini_batches": (16, 16, 16, 16),
    "responses_per_step": (8192, 8192, 8192, 8192),
    "samples_per_prompt": (16, 16, 16, 16),
    "value_pretraining_steps": (50, 50, 50, 50),
    "ppo_epochs": (1, 1, 1, 1),
    "eta": (4, 4, 4, 4),
    "critic_max_staleness": (None, None, None, None),
    "actor_lr": (1e-6, 1e-6, 1e-6, 1e-6),
    "critic_lr": (2e-6, 2e-6, 2e-6, 2e-6),
    "warmup_steps": (20, 20, 20, 20),
    "grad_clip": (1.0, 1.0, 1.0, 1.0),
    "dynamic_sampling": (False, False, False, True),
    "overlong_shaping": (False, False, False, True),
}

# The rest of the run, the same for every algorithm (model name and path: per preset below).
PAPER_RUN: dict[str, object] = {
    "model.gradient_checkpointing": True,
    "model.critic_path": None,
    "sampling.max_tokens": 20480,         # DAPO's L_max
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "reward.correct": 1.0,                # DAPO's +1 / -1
    "reward.wrong": -1.0,
    "reward.overlong_cache_tokens": None,  # 20% of 20480 = 4096 (band below)
    "eval.every_n_steps": 0,              # off unless asked: remote generators hold the GPUs
    "eval.data.name": "aime",             # AIME 2024: 30 problems
    "eval.n_prompts": 30,
    "eval.samples": 32,                   # avg@32
    "eval.temperature": 1.0,
    "eval.top_p": 0.7,
    "eval.max_tokens": None,              # = sampling.max_tokens
    "generators.local": 0,
    "batching.micro_batch_tokens": 32768,
    "data.name": "dapo_math",
}
PAPER_MODELS = {"qwen2.5-7b": "Qwen/Qwen2.5-7B", "qwen2.5-32b": "Qwen/Qwen2.5-32B"}


def _get(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_table_names_every_algo_field():
    assert set(PAPER_ALGO) == {f.name for f in dataclasses.fields(AlgoConfig)}


@pytest.mark.parametrize("model", sorted(PAPER_MODELS))
@pytest.mark.parametrize("algo", ALGOS)
def test_paper_presets_equal_the_table(model, algo):
    cfg = _compose([f"model={model}", f"algo={algo}", "data=dapo_math"])
    col = ALGOS.index(algo)
    assert dataclasses.asdict(cfg.algo) == {k: v[col] for k, v in PAPER_ALGO.items()}
    got = {key: _get(cfg, key) for key in PAPER_RUN}
    assert got == PAPER_RUN
    assert (cfg.model.name, cfg.model.path) == (model, PAPER_MODELS[model])
    # 8192 responses per step for every algorithm, mini-batches of 8192 / 16 = 512 responses
    assert cfg.algo.batch_groups * cfg.algo.group_size == 8192
    assert cfg.algo.batch_groups * cfg.algo.group_size // cfg.algo.mini_batches == 512
    # DAPO's band: the last 4096 = 20480 // 5 tokens before L_max
    assert cfg.reward.overlong_band(cfg.sampling.max_tokens) == (20480, 4096)


def test_the_scale_follows_the_group_size_at_a_constant_budget():
    # VAPO "w/o group-sampling" at the paper's scale: G = 1, 8192 / 1 prompts, same 16 mini-batches
    cfg = _compose(["model=qwen2.5-32b", "algo=vapo", "algo.group_size=1"])
    assert (cfg.algo.batch_groups, cfg.algo.group_size, cfg.algo.mini_batches) == (8192, 1, 16)
    # G = 32: 8192 / 32 = 256 prompts
    cfg = _compose(["model=qwen2.5-7b", "algo=dapo", "algo.samples_per_prompt=32"])
    assert (cfg.algo.batch_groups, cfg.algo.group_size) == (256, 32)
    # explicit shape fields win (benchmarks set them directly)
    cfg = _compose(["model=qwen2.5-7b", "algo=vapo", "algo.batch_groups=8", "algo.group_size=4",
                    "algo.value_warmup_steps=0"])
    assert (cfg.algo.batch_groups, cfg.algo.group_size, cfg.algo.value_warmup_steps) == (8, 4, 0)


@pytest.mark.parametrize("override, key", [
    ("algo.samples_per_prompt=7", "algo.responses_per_step"),  # 128 is not a multiple of 7
    ("algo.responses_per_step=0", "algo.responses_per_step=0"),
    ("model=hf", "model.path"),
])
def test_bad_scale_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        check_overrides([override])
    assert key in str(err.value) and "\n" not in str(err.value)


# conf/model/hf.yaml: the papers' optimiser settings, a batch and length for one machine
HF_RUN: dict[str, object] = {
    "model.name": "hf", "model.path": "/models/x", "model.gradient_checkpointing": False,
    "algo.actor_lr": 1e-6, "algo.critic_lr": 2e-6, "algo.warmup_steps": 20, "algo.alpha": 0.05,
    "algo.group_size": 16, "algo.batch_groups": 16,  # 256 responses / 16 samples
    "algo.mini_batches": 4, "algo.value_warmup_steps": 50,
    "sampling.max_tokens": 4096, "eval.every_n_steps": 0, "generators.local": 1,
}


def test_model_path_alone_means_the_hf_preset(caplog):
    args = ["--cfg", "job", "algo=vapo", "model.path=/models/x", "trainer.max_steps=3"]
    with caplog.at_level("WARNING", logger="vapo_async.learner"):
        implied = implied_overrides(args)
    assert implied == ["--cfg", "job", "algo=vapo", "model=hf", "model.path=/models/x", "trainer.max_steps=3"]
    assert len(caplog.records) == 1 and "model=hf" in caplog.messages[0]
    cfg = _compose([a for a in implied if not a.startswith("-") and a != "job"])
    assert {key: _get(cfg, key) for key in HF_RUN} == HF_RUN
    # tiny's knobs (actor 1.5e-4, alpha 0.5, 256 tokens, eval every 10 steps) are gone
    tiny = _compose([])
    assert (tiny.algo.actor_lr, tiny.algo.alpha, tiny.sampling.max_tokens, tiny.eval.every_n_steps) == \
        (1.5e-4, 0.5, 256, 10)


@pytest.mark.parametrize("args", [
    ["model=qwen2.5-7b", "model.path=/models/x"],  # a preset is named: keep it
    ["+model=hf", "model.path=/models/x"],
    ["model.path=null"],                           # the tiny base
    ["algo=dapo", "--cfg", "job"],                 # no path at all
])
def test_nothing_is_implied_when_a_preset_or_no_path_is_given(args):
    assert implied_overrides(args) == args


def test_tiny_with_a_model_directory_is_refused():
    with pytest.raises(ConfigError) as err:
        check_overrides(["model=tiny", "model.path=/models/x"])
    msg = str(err.value)
    assert "model=tiny" in msg and "model.path=/models/x" in msg and "\n" not in msg
    for name in model_presets():
        assert name == "tiny" or name in msg
    assert set(model_presets()) >= {"tiny", "hf", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b"}


def test_cli_says_which_preset_it_took(tmp_path):
    # a real learner process: model.path alone -> one line naming model=hf, then the usual one-line
    # error for a directory that is not a Hugging Face model (exit 2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={tmp_path}/run",
                           f"model.path={tmp_path}/nothing", "generators.local=0"],
                          env=env, capture_output=True, text=True, timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert sum("model=hf" in ln for ln in lines) == 1
    assert lines[-1].startswith("vapo_async.learner: error: model.path=") and "nothing" in lines[-1]
