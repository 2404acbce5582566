"""Generator/learner log-prob mismatch at equal policy version.

A token sampled with the policy version the learner holds now (staleness 0) was drawn by the same
weights the learner just used to recompute pi_prox; any difference between the generator's log-prob
(pi_behav) and the learner's (pi_prox) is numerical: kernels, dtype, a sampler that is not the
policy (top-p, top-k), or weights that did not arrive intact. Async RL systems report this gap as
their most common silent failure; here it is measured on every step's fresh tokens, apart from the
gap that staleness explains.

With r_t = pi_prox(y_t) / pi_behav(y_t) over the fresh tokens (those with ``fresh[i, t]``):

- ``kl``: mean of k3 = (r_t - 1) - log r_t, an unbiased, non-negative estimate of
  KL(pi_behav || pi_prox) from tokens sampled by pi_behav (Schulman 2020; the same estimator the
  losses use for ``behav_approx_kl``).
- ``abs_logp_mean`` / ``abs_logp_max``: mean and largest |log pi_prox - log pi_behav|.
- ``capped_frac``: fraction of fresh tokens whose behaviour weight r_t passes ``algo.behav_cap``
  (capped by ``truncate`` or zeroed by ``mask``): caps that mismatch, not staleness, caused.

Departures: none; the papers report no such figure (PAPER.md "Off-policy tolerance" treats the
behaviour weight as a staleness correction only).
"""

from __future__ import annotations

import torch

MISMATCH_KEYS = ("tokens", "kl_sum", "abs_sum", "abs_max", "capped")
"""The entries of ``mismatch_sums``, in the order a caller reduces them."""


def fresh_tokens(versions: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    """(B, T) bool: valid tokens sampled with ``version`` (staleness 0).

    Args:
        versions: (B, T) int policy version that sampled each token.
        mask: (B, T) nonzero on valid tokens.
        version: the policy version the learner holds (the one pi_prox was recomputed with).
    """
    return (versions == version) & (mask != 0)


def mismatch_sums(logp_prox: torch.Tensor, logp_behav: torch.Tensor, fresh: torch.Tensor,
                  behav_cap: float | None) -> dict[str, torch.Tensor]:
    """Sums over the fresh tokens of one micro-batch, to be added over micro-batches and ranks
    (``mismatch_metrics`` turns them into means).

    Args:
        logp_prox: (B, T) log pi_prox of the sampled tokens (learner, current weights).
        logp_behav: (B, T) log pi_behav of the same tokens (generator).
        fresh: (B, T) bool, ``fresh_tokens``.
        behav_cap: the behaviour-weight cap (``AlgoConfig.behav_cap``); None counts no cap.

    Returns:
        0-dim float64 tensors keyed by ``MISMATCH_KEYS``: tokens (count), kl_sum (sum of k3),
        abs_sum and abs_max (of |log r|; 0 without fresh tokens), capped (count of r > cap).
    """
    if logp_prox.shape != logp_behav.shape or logp_prox.shape != fresh.shape:
        raise ValueError(f"mismatch_sums: shapes differ: logp_prox {tuple(logp_prox.shape)}, "
                         f"logp_behav {tuple(logp_behav.shape)}, fresh {tuple(fresh.shape)}")
    d = torch.where(fresh, logp_prox.double() - logp_behav.double(), torch.zeros((), dtype=torch.float64))
    k3 = torch.expm1(d) - d  # (r - 1) - log r with log r = d; 0 where not fresh
    capped = (d > torch.log(torch.tensor(behav_cap, dtype=torch.float64))) & fresh if behav_cap is not None \
        else torch.zeros_like(fresh)
    return {"tokens": fresh.sum().double(), "kl_sum": k3.sum(), "abs_sum": d.abs().sum(),
            "abs_max": d.abs().max() if d.numel() else torch.zeros((), dtype=torch.float64),
            "capped": capped.sum().double()}


def mismatch_metrics(total: dict[str, float]) -> dict[str, float]:
    """TensorBoard figures from summed ``mismatch_sums`` (empty without a fresh token: a step
    that trained only on stale tokens says nothing about the mismatch).

    Returns ``mismatch/kl``, ``mismatch/abs_logp_mean``, ``mismatch/abs_logp_max``,
    ``mismatch/capped_frac`` and ``mismatch/tokens``.
    """
    n = total["tokens"]
    if n <= 0:
        return {}
    return {"mismatch/kl": total["kl_sum"] / n, "mismatch/abs_logp_mean": total["abs_sum"] / n,
            "mismatch/abs_logp_max": total["abs_max"], "mismatch/capped_frac": total["capped"] / n,
            "mismatch/tokens": n}
