"""Held-out evaluation with a vLLM engine: sample k responses per prompt, score, summarise.

    from vapo_async.eval import evaluate
    metrics = evaluate("/path/to/model", prompts, k=16, temperature=1.0, top_p=0.7, max_tokens=512)

``evaluate`` takes a model directory (it builds and shuts down its own engine) or an existing
``vllm.LLM`` (reused as is, e.g. one engine shared by several evaluations). Scoring goes through
``vapo_async.rewards`` and aggregation through ``eval.metrics``, the same pure functions a learner
uses on responses from any other sampler.

Departures: VAPO evaluates with temperature 1.0 and top_p 0.7 (PAPER.md, "Setting"); those are the
defaults here, but the tiny default model is also reported at top_p 1.0 (the RL sampling setting).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vapo_async.common.engine import EngineConfig
from vapo_async.data import PromptRecord
from vapo_async.rewards import RewardConfig, Score, build_reward_fn

from .metrics import RewardFn, score_groups, summarize


@dataclass
class ProblemResult:
    """One prompt's k samples and their scores."""

    record: PromptRecord
    """The prompt, ground truth and uid."""
    texts: list[str]
    """Decoded responses (k)."""
    token_counts: list[int]
    """L_i of each response."""
    truncated: list[bool]
    """Response hit max_tokens."""
    scores: list[Score]
    """Reward, correctness and format of each response."""


def build_llm(model: str | Path, engine: EngineConfig | None = None) -> Any:
    """A ``vllm.LLM`` for ``model`` with the project's engine settings (CPU and GPU)."""
    from vllm import LLM

    from vapo_async.common.engine import engine_kwargs

    return LLM(**engine_kwargs(model, engine or EngineConfig()))


def shutdown_llm(llm: Any) -> None:
    """Stop an engine built by :func:`build_llm` (its engine-core process and memory)."""
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        engine.engine_core.shutdown()
    del llm
    gc.collect()


def sample_and_score(
    llm: Any,
    prompts: Sequence[PromptRecord],
    k: int,
    reward_fn: RewardFn,
    *,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_tokens: int = 512,
    seed: int | None = None,
    chunk_prompts: int = 16,
    progress: bool = True,
) -> list[ProblemResult]:
    """Sample ``k`` responses per prompt with ``llm`` (chunks of ``chunk_prompts``) and score them."""
    from vllm import SamplingParams

    if k < 1 or not prompts:
        raise ValueError(f"evaluation needs k >= 1 and at least one prompt, got k={k}, {len(prompts)} prompts")
    params = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    results: list[ProblemResult] = []
    with tqdm(total=len(prompts), desc=f"eval k={k}", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(prompts), chunk_prompts):
            chunk = list(prompts[start : start + chunk_prompts])
            outputs = llm.generate([r.prompt for r in chunk], params, use_tqdm=False)
            texts = [[o.text for o in out.outputs] for out in outputs]
            counts = [[len(o.token_ids) for o in out.outputs] for out in outputs]
            scores = score_groups(texts, [r.answer for r in chunk], counts, reward_fn)
            for rec, out, t, c, s in zip(chunk, outputs, texts, counts, scores, strict=True):
                trunc = [o.finish_reason == "length" for o in out.outputs]
                results.append(ProblemResult(rec, t, c, trunc, s))
            bar.update(len(chunk))
    return results


def summarize_results(results: Sequence[ProblemResult], k: int) -> dict[str, float | int]:
    """``metrics.summarize`` over :func:`sample_and_score`'s output."""
    return summarize(
        [r.scores for r in results], [r.token_counts for r in results], k, [r.truncated for r in results]
    )


def evaluate(
    llm_or_model_path: Any,
    prompts: Sequence[PromptRecord],
    k: int,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_tokens: int = 512,
    *,
    seed: int | None = None,
    reward: RewardConfig | None = None,
    engine: EngineConfig | None = None,
    progress: bool = True,
    results_out: list[ProblemResult] | None = None,
) -> dict[str, float | int]:
    """Metrics of ``k`` samples per prompt (see ``metrics.summarize`` for the keys), plus ``seconds``.

    ``llm_or_model_path``: a ``vllm.LLM`` (reused) or a model directory (an engine is built from
    ``engine`` and shut down afterwards). ``results_out``, when given, receives the per-problem
    samples and scores.
    """
    t0 = time.perf_counter()
    own = isinstance(llm_or_model_path, str | Path)
    llm = build_llm(llm_or_model_path, engine) if own else llm_or_model_path
    reward_fn = build_reward_fn(reward or RewardConfig())
    try:
        results = sample_and_score(
            llm, prompts, k, reward_fn, temperature=temperature, top_p=top_p,
            max_tokens=max_tokens, seed=seed, progress=progress,
        )
    finally:
        close = getattr(reward_fn, "close", None)
        if close is not None:
            close()
        if own:
            shutdown_llm(llm)
    if results_out is not None:
        results_out.extend(results)
    metrics = summarize_results(results, k)
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    return metrics
