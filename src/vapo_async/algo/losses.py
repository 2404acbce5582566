"""Losses: decoupled PPO policy loss with clip-higher, value loss, positive-example NLL, KL and entropy terms.

Notation (see ``vapo_async.algo``): B responses, T padded length. All (B, T) inputs share one mask,
nonzero on valid tokens; padding may hold anything (NaN, 1e30): it is replaced before any
arithmetic, so it never reaches a loss, a metric or a gradient. Losses are 0-dim tensors; metrics
are dicts of detached 0-dim tensors (token means over valid tokens unless named otherwise).

Deliberate departures and choices:
- Behaviour weight (AReaL decoupled objective): ``behav_mode="mask"`` zeroes tokens whose weight
  pi_prox / pi_behav exceeds the cap but keeps them in the denominator, as AReaL's code does (its
  loss divides by the count of all loss-mask tokens); ``"truncate"`` caps the weight (TIS-style).
  A weight exactly equal to the cap is kept in both modes.
- ``aggregation="sequence"`` averages each response over its tokens, then over the responses that
  have at least one valid token (empty responses are not counted).
- ``normalizer`` (optional) replaces the denominator (total tokens for "token", total responses
  for "sequence") so that gradient accumulation over micro-batches or ranks reproduces eq. 7 over
  the whole training batch.
"""

from __future__ import annotations

import torch

from vapo_async.algo.stats import explained_variance, masked_mean

_AGGREGATIONS = ("token", "sequence")
_BEHAV_MODES = ("truncate", "mask")


def _check_tokens(name: str, mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    """Validate that every tensor is (B, T) like mask; return the boolean mask."""
    if mask.dim() != 2:
        raise ValueError(f"{name}: mask must be (B, T), got shape {tuple(mask.shape)}")
    for key, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name}: {key} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} like mask")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {key} must be floating point, got {t.dtype}")
    return mask if mask.dtype == torch.bool else mask != 0


def _clean(x: torch.Tensor, valid: torch.Tensor, detach: bool = False) -> torch.Tensor:
    """x on valid tokens, 0 on padding (torch.where: the gradient at padding is exactly 0).

    Half-precision inputs are upcast to float32 first (differentiably), so ratios, exponentials
    and sums never run in bfloat16.
    """
    x = x.detach() if detach else x
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def aggregate(loss_tok: torch.Tensor, valid: torch.Tensor, aggregation: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    "token" (VAPO/DAPO eq. 7): sum over all valid tokens / number of valid tokens.
    "sequence" (vanilla PPO/GRPO): mean over each response's tokens, then mean over responses.

    Args:
        loss_tok: (B, T) per-token losses, already 0 on padding.
        valid: (B, T) bool mask.
        aggregation: "token" or "sequence".
        normalizer: denominator override (tokens or responses of the whole training batch).

    Returns:
        0-dim loss; exactly 0 when there is no valid token.
    """
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if aggregation == "token":
        denom = valid.sum().clamp(min=1).to(loss_tok.dtype) if normalizer is None else normalizer
        return loss_tok.sum() / denom
    lengths = valid.sum(dim=1)
    per_seq = loss_tok.sum(dim=1) / lengths.clamp(min=1).to(loss_tok.dtype)  # (B,), 0 for empty rows
    denom = (lengths > 0).sum().clamp(min=1).to(loss_tok.dtype) if normalizer is None else normalizer
    return per_seq.sum() / denom


def _behaviour_weight(
    logp_prox: torch.Tensor, logp_behav: torch.Tensor, valid: torch.Tensor, cap: float | None, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(applied weight, raw weight, capped flags), each (B, T), no gradient.

    Raw weight = pi_prox / pi_behav = exp(logp_prox - logp_behav) (AReaL decoupled objective).
    """
    raw = torch.exp(logp_prox - logp_behav)
    if cap is None:
        return torch.ones_like(raw), raw, torch.zeros_like(valid)
    capped = (raw > cap) & valid
    if mode == "truncate":
        return raw.clamp(max=cap), raw, capped
    return torch.where(capped, torch.zeros_like(raw), raw), raw, capped


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    behav_cap: float | None,
    behav_mode: str,
    aggregation: str,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO clipped surrogate with clip-higher (VAPO eq. 7-8, AReaL decoupled objective).

    u_t = exp(logp - logp_prox);  s_t = min(u_t * A_t, clip(u_t, 1 - clip_low, 1 + clip_high) * A_t);
    loss_t = - w_t * s_t with the behaviour weight w_t = pi_prox / pi_behav (no gradient), capped per
    ``behav_mode``; then aggregated per ``aggregation``.

    Args:
        logp: (B, T) log pi_theta of the sampled tokens (requires grad).
        logp_prox: (B, T) log pi_prox, recomputed by the learner at the start of the update.
        logp_behav: (B, T) log pi_behav, reported by the generator that sampled the token.
        advantages: (B, T) A_t (used without gradient).
        mask: (B, T) nonzero on tokens that count.
        clip_low: eps_low in [0, 1) (paper 0.2).
        clip_high: eps_high >= 0 (clip-higher 0.28; vanilla PPO 0.2).
        behav_cap: cap on the behaviour weight; None disables the weight (w = 1).
        behav_mode: "truncate" (w = min(w, cap)) or "mask" (w = 0 where w > cap).
        aggregation: "token" (eq. 7) or "sequence".
        normalizer: optional denominator override, see ``aggregate``.

    Returns:
        (loss, metrics) with metrics clip_frac, clip_frac_high, clip_frac_low, approx_kl
        (k3 estimate of KL(pi_prox || pi_theta)), ratio_mean, ratio_max, behav_weight_mean,
        behav_weight_max, behav_capped_frac, behav_approx_kl (k3 of KL(pi_behav || pi_prox)), tokens.
    """
    valid = _check_tokens("policy_loss", mask, logp=logp, logp_prox=logp_prox, logp_behav=logp_behav, advantages=advantages)
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"policy_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if behav_mode not in _BEHAV_MODES:
        raise ValueError(f"policy_loss: behav_mode must be one of {_BEHAV_MODES}, got {behav_mode!r}")
    if behav_cap is not None and behav_cap <= 0:
        raise ValueError(f"policy_loss: behav_cap must be > 0 or None, got {behav_cap}")
    logp = _clean(logp, valid)
    prox = _clean(logp_prox, valid, detach=True)
    behav = _clean(logp_behav, valid, detach=True)
    adv = _clean(advantages, valid, detach=True)
    log_ratio = logp - prox
    ratio = torch.exp(log_ratio)  # u_t = pi_theta / pi_prox
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # eq. 8
    weight, raw_weight, capped = _behaviour_weight(prox, behav, valid, behav_cap, behav_mode)
    loss_tok = _clean(-weight * surrogate, valid)
    loss = aggregate(loss_tok, valid, aggregation, normalizer)
    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1.0 + clip_high) & valid  # the clipped branch is the min: no gradient
        low = (adv < 0) & (r < 1.0 - clip_low) & valid
        metrics = {
            "clip_frac": masked_mean((high | low).to(r.dtype), valid),
            "clip_frac_high": masked_mean(high.to(r.dtype), valid),
            "clip_frac_low": masked_mean(low.to(r.dtype), valid),
            "approx_kl": masked_mean((r - 1.0) - log_ratio.detach(), valid),
            "ratio_mean": masked_mean(r, valid),
            "ratio_max": _clean(r, valid).max() if r.numel() else r.new_zeros(()),
            "behav_weight_mean": masked_mean(raw_weight, valid),
            "behav_weight_max": _clean(raw_weight, valid).max() if r.numel() else r.new_zeros(()),
            "behav_capped_frac": masked_mean(capped.to(r.dtype), valid),
            "behav_approx_kl": masked_mean((raw_weight - 1.0) - (prox - behav), valid),
            "tokens": valid.sum().to(r.dtype),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None,
    aggregation: str,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression: 0.5 * (V - R)^2, optionally PPO-clipped around the old values.

    With clip c: V_c = V_old + clip(V - V_old, -c, c) and the per-token loss is
    0.5 * max((V - R)^2, (V_c - R)^2) (the PAPER is silent on value clipping; default off).

    Args:
        values: (B, T) current critic values (requires grad).
        old_values: (B, T) values when the batch was collected (used without gradient).
        returns: (B, T) targets (lambda_critic GAE returns; used without gradient).
        mask: (B, T) nonzero on valid tokens.
        clip: value clip range c > 0, or None.
        aggregation: "token" or "sequence".
        normalizer: optional denominator override, see ``aggregate``.

    Returns:
        (loss, metrics) with value_clip_frac, explained_variance, value_mean, return_mean,
        value_mse, tokens.
    """
    valid = _check_tokens("value_loss", mask, values=values, old_values=old_values, returns=returns)
    if clip is not None and clip <= 0:
        raise ValueError(f"value_loss: clip must be > 0 or None, got {clip}")
    v = _clean(values, valid)
    old = _clean(old_values, valid, detach=True)
    ret = _clean(returns, valid, detach=True)
    err = 0.5 * (v - ret) ** 2
    clipped_frac = v.new_zeros(())
    if clip is not None:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = 0.5 * (v_clip - ret) ** 2
        with torch.no_grad():
            clipped_frac = masked_mean((err_clip > err).to(v.dtype), valid)
        err = torch.maximum(err, err_clip)
    loss = aggregate(_clean(err, valid), valid, aggregation, normalizer)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": clipped_frac,
            "explained_variance": explained_variance(v, ret, valid),
            "value_mean": masked_mean(v.detach(), valid),
            "return_mean": masked_mean(ret, valid),
            "value_mse": masked_mean((v.detach() - ret) ** 2, valid),
            "tokens": valid.sum().to(v.dtype),
        }
    return loss, metrics


def positive_nll_loss(
    logp: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, normalizer: float | None = None
) -> torch.Tensor:
    """Positive-example LM loss (VAPO eq. 9): token-mean NLL over the correct responses.

    L_NLL = - 1 / (sum_{i in P} L_i) * sum_{i in P} sum_t log pi_theta(a_it | s_it).

    Args:
        logp: (B, T) log pi_theta of the sampled tokens (requires grad).
        mask: (B, T) nonzero on valid tokens.
        positive: (B,) bool, True for correct responses (the set P).
        normalizer: optional denominator override (positive tokens of the whole training batch).

    Returns:
        0-dim loss; exactly 0 (no NaN, zero gradient) when no response is positive.
    """
    valid = _check_tokens("positive_nll_loss", mask, logp=logp)
    if positive.shape != mask.shape[:1]:
        raise ValueError(f"positive_nll_loss: positive must be ({mask.shape[0]},), got {tuple(positive.shape)}")
    chosen = valid & positive.to(torch.bool)[:, None]
    return aggregate(-_clean(logp, chosen), chosen, "token", normalizer)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) at the sampled tokens (Schulman, "Approximating
    KL divergence", 2020; the papers drop the KL term: PAPER.md "Paper is silent on", beta = 0).

    k3 = exp(d) - d - 1 with d = log pi_ref - log pi_theta: >= 0 for every token, 0 where the two
    policies agree, unbiased for the KL when tokens are sampled from pi_theta.

    Args:
        logp: (B, T) log pi_theta of the sampled tokens (may require grad).
        ref_logp: (B, T) log pi_ref of the same tokens.
        mask: (B, T) nonzero on valid tokens.

    Returns:
        (B, T) k3 per token, exactly 0 on padding (whatever it held).
    """
    valid = _check_tokens("kl_k3", mask, logp=logp, ref_logp=ref_logp)
    d = _clean(ref_logp, valid) - _clean(logp, valid)  # 0 on padding, so exp(0) - 0 - 1 = 0 there
    return d.exp() - d - 1.0


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float | None = None
) -> torch.Tensor:
    """KL penalty to a frozen reference policy: ``kl_k3`` aggregated like the policy loss.

    Args:
        logp, ref_logp, mask: as ``kl_k3`` ((B, T) each).
        aggregation: "token" or "sequence" (see ``aggregate``).
        normalizer: optional denominator override (see ``aggregate``).

    Returns:
        0-dim penalty (>= 0), to be added as kl_coef * penalty.
    """
    return aggregate(kl_k3(logp, ref_logp, mask), _check_tokens("kl_penalty", mask), aggregation, normalizer)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Token-level entropy bonus: sum of the valid tokens' entropies / normalizer (to be subtracted
    from the loss as entropy_coef * bonus; PAPER.md is silent on it, default coefficient 0).

    Args:
        entropy: (B, T) per-token policy entropies H_t (``stats.entropy_from_logits``; may require grad).
        mask: (B, T) nonzero on valid tokens.
        normalizer: denominator, e.g. the valid tokens of the whole mini-batch; None = this batch's.

    Returns:
        0-dim mean entropy per token (exactly 0 without a valid token).
    """
    valid = _check_tokens("entropy_bonus", mask, entropy=entropy)
    return aggregate(_clean(entropy, valid), valid, "token", normalizer)
