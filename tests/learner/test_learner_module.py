"""The LightningModule under a real single-device Trainer on fixed batches (``ListSource``): every
preset trains through it (GRPO/DAPO without a critic), value pretraining publishes nothing and can
stop early on the explained-variance threshold, a non-finite batch is skipped untouched."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from learner_helpers import make_groups

from vapo_async.algo.presets import preset
from vapo_async.learner.attention import SEGMENTS
from vapo_async.learner.config import LearnerConfig
from vapo_async.learner.module import LearnerModule
from vapo_async.learner.stream import ListSource


def _fit(model_dir, run_dir, steps: int, groups=None, packing: bool = False, **algo) -> LearnerModule:
    cfg = LearnerConfig()
    cfg.batching.packing = packing
    base = preset(algo.pop("name", "vapo"))
    cfg.algo = dataclasses.replace(base, batch_groups=3, group_size=4, mini_batches=2, warmup_steps=0,
                                   actor_lr=1e-3, critic_lr=1e-3, **algo)
    cfg.batching.micro_batch_tokens = 64
    cfg.sampling.max_tokens = 14
    cfg.reward.overlong_cache_tokens = 4
    module = LearnerModule(cfg, str(model_dir), run_dir, source=ListSource(groups or make_groups(6, 4, vocab=300, seed=5)))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module)
    module.publishing.close()
    return module


@pytest.mark.parametrize("name", ["ppo", "grpo", "dapo"])
def test_every_preset_trains_and_publishes(name, tiny_model_dir, tmp_path):
    module = _fit(tiny_model_dir, tmp_path, 2, name=name)
    assert module.state.version == 2
    assert (module.critic is None) == (name != "ppo")
    opts = module.optimizers()
    assert len(opts if isinstance(opts, list) else [opts]) == (2 if name == "ppo" else 1)
    assert (tmp_path / "weights" / "v00000002" / "model.safetensors").is_file()
    assert module.state.last.metrics["train/actor_optimizer_steps"] == 2.0  # 2 mini-batches
    assert "actor/pg_loss" in module.state.last.metrics
    assert ("critic/value_loss" in module.state.last.metrics) == (name == "ppo")


def test_value_pretraining_publishes_nothing_and_stops_on_threshold(tiny_model_dir, tmp_path):
    module = _fit(tiny_model_dir, tmp_path / "a", 3, value_warmup_steps=3)
    assert module.state.version == 0 and not (tmp_path / "a" / "weights" / "v00000001").exists()
    assert module.state.last.metrics["train/value_warmup"] == 1.0
    assert "actor/pg_loss" not in module.state.last.metrics
    # threshold -100: the first warm-up step's explained variance is above it, so pretraining ends
    stopped = _fit(tiny_model_dir, tmp_path / "b", 3, value_warmup_steps=3, value_warmup_ev_threshold=-100.0)
    assert stopped.state.warmup_stopped_at == 1
    assert stopped.state.version == 2  # steps 2 and 3 train the actor


def test_nonfinite_batch_is_skipped_without_touching_weights(tiny_model_dir, tmp_path):
    groups = make_groups(3, 4, vocab=300, seed=9)
    groups[1].rewards[2] = float("nan")  # the returns / advantages of that group become NaN
    module = _fit(tiny_model_dir, tmp_path, 1, groups=groups, value_warmup_steps=0)
    assert module.state.last.metrics["train/skipped_nonfinite_batch"] == 1.0
    assert module.state.version == 0
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for k, v in module.actor.state_dict().items():
        assert torch.equal(v, base[k]), k


def test_packed_batches_give_the_padded_step(tiny_model_dir, tmp_path):
    """``batching.packing`` through the module (plan -> rows over the stream -> packed collate ->
    forward): the step's statistics equal the padded run's, and the packed plan pads less."""
    padded = _fit(tiny_model_dir, tmp_path / "a", 1).state.last.metrics
    packed_module = _fit(tiny_model_dir, tmp_path / "b", 1, packing=True)
    # on CPU batching.packed_attention=auto runs SDPA per sequence (learner/attention.py)
    assert packed_module.actor.config._attn_implementation == SEGMENTS
    assert packed_module.critic.config._attn_implementation == SEGMENTS
    packed = packed_module.state.last.metrics
    timing = ("perf/", "weights/write_s", "rollout/gen_time_s_mean")
    compared = [k for k in padded if not k.startswith(timing)]
    assert {"mismatch/kl", "critic/value_loss", "critic/grad_norm"} <= set(compared) and set(packed) == set(padded)
    for k in compared:  # the actor's log-probs (mismatch), the critic's values, loss and gradient norm
        assert packed[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-7), k
    assert packed["perf/padding_fraction"] < padded["perf/padding_fraction"]
