"""vapo_async.eval: held-out evaluation (avg@k, pass@k, format rate) with a vLLM engine.

    python -m vapo_async.eval model=PATH data=synthetic k=32          # CLI (Hydra overrides)

    from vapo_async.eval import evaluate, score_groups, summarize
    metrics = evaluate(model_dir_or_llm, prompts, k=16, temperature=1.0, top_p=0.7, max_tokens=512)
    metrics = summarize(score_groups(texts, answers, token_counts, reward_fn), token_counts, k=16)

``evaluate`` samples with vLLM; ``score_groups`` + ``summarize`` are pure and serve responses from
any sampler (e.g. the learner's periodic held-out evaluation).
"""

from .metrics import avg_at_k, mean_pass_at_k, pass_at_k, score_groups, summarize
from .runner import (
    ProblemResult,
    build_llm,
    evaluate,
    sample_and_score,
    shutdown_llm,
    summarize_results,
)

__all__ = [
    "ProblemResult",
    "avg_at_k",
    "build_llm",
    "evaluate",
    "mean_pass_at_k",
    "pass_at_k",
    "sample_and_score",
    "score_groups",
    "shutdown_llm",
    "summarize",
    "summarize_results",
]
