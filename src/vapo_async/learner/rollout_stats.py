"""What a step's rollouts looked like: the ``rollout/*``, ``async/*`` and wait figures of a batch
(``RolloutStream`` on rank 0) and the per-token staleness of the histogram (``TensorBoardMetrics``)."""

from __future__ import annotations

import numpy as np

from vapo_async.transport.batch import RolloutBatch


def rollout_stats(groups: list[RolloutBatch], version: int, wait_s: float, n_stale: int,
                  n_filtered: int, rounds: int) -> dict[str, float]:
    """Rollout metrics over the fresh groups of a step (before dynamic-sampling filtering)."""
    out = {"async/dropped_stale": float(n_stale), "rollout/dropped_filtered": float(n_filtered),
           "rollout/sampling_rounds": float(rounds), "perf/wait_s": wait_s}
    if not groups:
        return out
    b = RolloutBatch.concat(groups)
    rewards, correct = b.rewards.astype(np.float64), b.correct.astype(np.float64)
    trunc, lens = b.truncated.astype(np.float64), b.response_lens.astype(np.float64)
    vers = b.versions.astype(np.int64)
    stale = (version - vers).astype(np.float64)
    out.update({
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/accuracy": float(correct.mean()),
        "rollout/response_length_mean": float(lens.mean()),
        "rollout/response_length_max": float(lens.max()),
        "rollout/truncated_fraction": float(trunc.mean()),
        "rollout/groups": float(len(groups)),
        "rollout/response_tokens": float(lens.sum()),
        "async/staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "async/staleness_max": float(stale.max()) if stale.size else 0.0,
        "rollout/token_version_min": float(vers.min()) if vers.size else -1.0,
        "rollout/token_version_max": float(vers.max()) if vers.size else -1.0,
        "rollout/gen_time_s_mean": float(np.mean([i.gen_time_s for i in b.info])) if b.info else 0.0,
    })
    return out


def token_staleness(groups: list[RolloutBatch], version: int) -> np.ndarray:
    """(sum L_i,) current version minus each response token's version (for the histogram)."""
    return version - RolloutBatch.concat(groups).versions.astype(np.int64)
