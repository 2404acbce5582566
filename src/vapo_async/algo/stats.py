"""Masked statistics and log-probability helpers shared by the losses and the learner.

Notation (see ``vapo_async.algo``): B responses, T padded length, V vocabulary size.
Masks are nonzero on valid tokens; padding may hold anything (NaN included): every function
selects with ``torch.where`` before any arithmetic, so padding never reaches a result or a gradient.

Deliberate choices where the papers are silent:
- ``masked_whiten`` and ``explained_variance`` use the population variance (no Bessel correction).
- ``explained_variance`` returns 0 when the returns have zero variance (the ratio is undefined),
  so logs and early-stopping thresholds stay finite.
"""

from __future__ import annotations

import torch


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over valid entries.

    Args:
        x: (...) values, e.g. (B, T).
        mask: same shape as x, nonzero on valid entries.
        dim: reduce this dimension only (None: everything).

    Returns:
        Scalar, or x's shape without ``dim``.
    """
    valid = _valid(mask, x)
    picked = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid entries; exactly 0 where there are none (never NaN).

    Args:
        x: (...) values, e.g. (B, T).
        mask: same shape as x, nonzero on valid entries.
        dim: reduce this dimension only (e.g. dim=1: per-response means, shape (B,)).

    Returns:
        Scalar, or x's shape without ``dim``.
    """
    valid = _valid(mask, x)
    count = valid.sum() if dim is None else valid.sum(dim)
    return masked_sum(x, valid, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of x over valid entries (0 with fewer than one entry).

    Args:
        x: (...) values; mask: same shape.

    Returns:
        Scalar.
    """
    valid = _valid(mask, x)
    centred = x - masked_mean(x, valid)
    return masked_mean(centred * centred, valid)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over valid entries; padding is 0 in the output.

    Args:
        x: (...) values, e.g. advantages (B, T).
        mask: same shape, nonzero on valid entries.
        shift_mean: False keeps the mean (only scales), as some PPO codes do for advantages.
        eps: added to the variance.

    Returns:
        Tensor of x's shape.
    """
    valid = _valid(mask, x)
    mean = masked_mean(x, valid)
    var = masked_var(x, valid)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over valid tokens (1: perfect critic, 0: constant).

    Args:
        values: (B, T) critic predictions V_t.
        returns: (B, T) regression targets.
        mask: (B, T) nonzero on valid tokens.

    Returns:
        Scalar (float32 at least); 0 when Var(returns) is 0 or there are no valid tokens.
    """
    valid = _valid(mask, values)
    v = values.detach().float() if values.dtype in (torch.bfloat16, torch.float16) else values.detach()
    r = returns.detach().to(v.dtype)
    var_r = masked_var(r, valid)
    var_res = masked_var(r - v, valid)
    ev = 1.0 - var_res / var_r.clamp(min=torch.finfo(v.dtype).tiny)
    return torch.where(var_r > 0, ev, torch.zeros_like(ev))


def _float_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lf = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    return lf / temperature if temperature != 1.0 else lf


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[ids]: log-probabilities of the sampled tokens.

    Matches what the generator samples from (vLLM applies the temperature before the softmax).
    Computed as logit - logsumexp, without materialising the (B, T, V) log-softmax.

    Args:
        logits: (B, T, V) model outputs, position t already aligned to predict ids[:, t].
        ids: (B, T) integer token ids in [0, V).
        temperature: sampling temperature (> 0).

    Returns:
        (B, T) float32 (float64 for float64 logits) log-probabilities, differentiable.
    """
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"gather_logprobs: expected logits (B, T, V) and ids (B, T), got {tuple(logits.shape)} and {tuple(ids.shape)}")
    lf = _float_logits(logits, temperature)
    picked = lf.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(lf, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: H = logsumexp(z) - sum_v p_v z_v.

    Args:
        logits: (B, T, V) model outputs.
        temperature: > 0.

    Returns:
        (B, T) float32 (float64 for float64 logits) entropies in nats, differentiable.
    """
    if logits.dim() != 3:
        raise ValueError(f"entropy_from_logits: expected logits (B, T, V), got {tuple(logits.shape)}")
    lf = _float_logits(logits, temperature)
    probs = torch.softmax(lf, dim=-1)
    return torch.logsumexp(lf, dim=-1) - (probs * lf).sum(-1)
