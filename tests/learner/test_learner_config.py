"""Hydra config of the learner: presets compose to the algo presets, any Trainer flag is an
override, typos and bad values fail with one line naming the key (exit code 2)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from vapo_async.algo.presets import PRESETS
from vapo_async.learner.__main__ import CONF_DIR, check_overrides
from vapo_async.learner.config import ConfigError, LearnerConfig
from vapo_async.learner.prepare import build_strategy
from vapo_async.learner.trainer_config import trainer_kwargs

SRC = Path(__file__).resolve().parents[2] / "src"


def _compose(overrides: list[str]) -> LearnerConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="learner", overrides=overrides))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_algo_presets_compose_to_the_algo_package_presets(name):
    # the tiny default is the preset plus the two knobs conf/model/tiny.yaml scales (lr, eq. 5 alpha)
    scale = yaml.safe_load((CONF_DIR / "model" / "tiny.yaml").read_text())["algo"]
    assert scale == {"actor_lr": 1.5e-4, "alpha": 0.5}
    assert _compose([f"algo={name}"]).algo == dataclasses.replace(PRESETS[name], **scale)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_presets_only_change_learning_rates(name):
    # qwen2.5-0.5b keeps the default scale; the paper presets: tests/learner/test_paper_presets.py
    cfg = _compose([f"algo={name}", "model=qwen2.5-0.5b"])
    scale = yaml.safe_load((CONF_DIR / "model" / "qwen2.5-0.5b.yaml").read_text())["algo"]
    assert set(scale) == {"actor_lr", "critic_lr", "warmup_steps"}
    assert cfg.algo == dataclasses.replace(PRESETS[name], **scale)


def test_paper_scale_preset():
    cfg = _compose(["model=qwen2.5-7b", "data=dapo_math", "algo=dapo", "trainer=fsdp"])
    assert cfg.algo.actor_lr == 1e-6 and cfg.algo.critic_lr == 2e-6 and cfg.model.gradient_checkpointing
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.precision == "bf16-mixed"
    assert cfg.data.name == "dapo_math" and cfg.sampling.max_tokens == 20480


def test_any_trainer_flag_is_an_override():
    cfg = _compose(["trainer.max_time=00:00:30:00", "trainer.benchmark=true", "trainer.devices=2",
                    "trainer.strategy=fsdp", "trainer.accelerator=cpu"])
    kw = trainer_kwargs(cfg.trainer)
    assert kw["max_time"] == "00:00:30:00" and kw["benchmark"] is True and kw["devices"] == 2
    strategy, precision = build_strategy(cfg)
    assert type(strategy).__name__ == "ModelParallelStrategy" and precision == "32-true"
    assert strategy._data_parallel_size == 2


@pytest.mark.parametrize("override, key", [
    ("algo.clip_hihg=0.3", "algo.clip_hihg"),
    ("trainer.max_stepz=3", "trainer.max_stepz"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("algo=vapoo", "algo/vapoo"),
    ("trainer.strategy=deepspeed", "trainer.strategy"),
    ("trainer.logger=false", "trainer.logger"),
    ("algo.eta=-1", "AlgoConfig.eta"),
    ("reward.overlong_shaping=true", "reward.overlong_shaping"),
    ("batching.micro_batch_overhead_tokens=-1", "batching.micro_batch_overhead_tokens"),
    ("batching.packed_attention=dense", "batching.packed_attention"),
    ("sampling.top_p=2", "top_p"),  # common.sampling.SamplingConfig, the generators' type too
    ("sampling.max_tokens=0", "sampling.max_tokens"),
])
def test_invalid_override_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        check_overrides([override])
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_micro_batch_overhead_is_chosen_for_the_device():
    # null (the default): 256 token-equivalents on CPU, 8192 on a GPU, where Python and kernel
    # launches cost more GPU time per micro-batch (benchmarks/results/device_check.md)
    cfg = LearnerConfig()
    assert cfg.batching.micro_batch_overhead_tokens is None
    assert cfg.batching.overhead_for("cpu") == 256 and cfg.batching.overhead_for("cuda") == 8192
    cfg.batching.micro_batch_overhead_tokens = 1000  # an explicit value wins on every device
    assert cfg.batching.overhead_for("cpu") == 1000 and cfg.batching.overhead_for("cuda") == 1000
    cfg = _compose(["batching.micro_batch_overhead_tokens=4096"])
    assert cfg.batching.overhead_for("cuda") == 4096


def test_cli_exit_code_and_single_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={tmp_path}", "algo.etaa=1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vapo_async.learner: error:") and "algo.etaa" in lines[0]
