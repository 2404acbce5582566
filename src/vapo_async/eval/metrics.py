"""Evaluation metrics from scored samples: avg@k, the unbiased pass@k estimator, format rate.

Pure functions over plain Python values, shared by ``python -m vapo_async.eval`` (vLLM samples) and
by the learner's periodic held-out evaluation (samples from any generator):

    scores = score_groups(texts, answers, token_counts, reward_fn)   # list (problems) of lists (samples)
    metrics = summarize(scores, token_counts, k=16)

Definitions, for problem j with n_j samples of which c_j are correct:
- avg@k  = mean_j c_j / n_j  (VAPO's "average pass rate over k samples", PAPER.md "Setting"; also the
  unbiased pass@1 estimate);
- pass@k = mean_j [1 - C(n_j - c_j, k) / C(n_j, k)]  (the unbiased estimator of Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", eq. 1); with n_j = k it is the fraction of
  problems with at least one correct sample.

Departures: none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from vapo_async.rewards import Score

RewardFn = Callable[[str, str, int], Score]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` correct (Chen et al. 2021, eq. 1).

    pass@k = 1 - C(n - c, k) / C(n, k): one minus the chance that k samples drawn without
    replacement from the n are all wrong. Exact integer binomials, so no cancellation error.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the fraction of correct samples (avg@k, VAPO's evaluation metric)."""
    if not correct or any(len(c) == 0 for c in correct):
        raise ValueError("avg_at_k needs at least one problem and one sample per problem")
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """Mean over problems of :func:`pass_at_k` with each problem's own sample count."""
    if not correct:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return sum(pass_at_k(len(c), sum(c), k) for c in correct) / len(correct)


def score_groups(
    texts: Sequence[Sequence[str]],
    answers: Sequence[str],
    token_counts: Sequence[Sequence[int]],
    reward_fn: RewardFn,
) -> list[list[Score]]:
    """Score every sample: ``texts[j][i]`` is sample i of problem j, whose ground truth is ``answers[j]``."""
    if not len(texts) == len(answers) == len(token_counts):
        raise ValueError(
            f"score_groups: {len(texts)} text groups, {len(answers)} answers, "
            f"{len(token_counts)} token-count groups; they must match"
        )
    out = []
    for j, (group, answer, counts) in enumerate(zip(texts, answers, token_counts, strict=True)):
        if len(group) != len(counts):
            raise ValueError(f"score_groups: problem {j} has {len(group)} texts but {len(counts)} token counts")
        out.append([reward_fn(text, answer, n) for text, n in zip(group, counts, strict=True)])
    return out


def summarize(
    scores: Sequence[Sequence[Score]],
    token_counts: Sequence[Sequence[int]],
    k: int,
    truncated: Sequence[Sequence[bool]] | None = None,
) -> dict[str, float | int]:
    """Aggregate metrics of scored samples (``k`` = samples per problem used for pass@k).

    Keys: ``avg@k``, ``pass@k`` (and the same under the numbered names, e.g. ``avg@16``),
    ``pass@1``, ``format_rate``, ``mean_reward``, ``mean_response_tokens``, ``truncated_rate``
    (when ``truncated`` is given), ``n_problems``, ``n_samples``, ``k``.
    """
    correct = [[s.correct for s in group] for group in scores]
    flat = [s for group in scores for s in group]
    lengths = [n for group in token_counts for n in group]
    if len(lengths) != len(flat):
        raise ValueError(f"summarize: {len(flat)} scores but {len(lengths)} token counts")
    avg = avg_at_k(correct)
    pk = mean_pass_at_k(correct, k)
    out: dict[str, float | int] = {
        "avg@k": avg,
        "pass@k": pk,
        f"avg@{k}": avg,
        f"pass@{k}": pk,
        "pass@1": mean_pass_at_k(correct, 1),
        "format_rate": sum(s.formatted for s in flat) / len(flat),
        "mean_reward": sum(s.reward for s in flat) / len(flat),
        "mean_response_tokens": sum(lengths) / len(lengths),
        "n_problems": len(scores),
        "n_samples": len(flat),
        "k": k,
    }
    if truncated is not None:
        flags = [t for group in truncated for t in group]
        out["truncated_rate"] = sum(flags) / len(flags)
    return out
