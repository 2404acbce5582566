"""Log-probabilities and entropy of sampled tokens straight from hidden states, in token chunks.

The output layer's logits are (tokens x vocabulary): 0.6 MB per token in float32 for Qwen's 151,936
words, the largest tensor of a learner step, and autograd would keep them (and their softmax) for
the backward pass. ``logprob_entropy`` computes, for N tokens,

    z = h W^T / T                      (chunk, V) float32, never all N rows at once
    log p(y) = z_y - logsumexp(z)      (the sampled token's log-probability, as ``gather_logprobs``)
    H = logsumexp(z) - sum_v p_v z_v   (the entropy, as ``entropy_from_logits``)

and keeps only h, W, y, logsumexp(z) and H for the backward pass, which recomputes each chunk's
logits. With g_l and g_H the incoming gradients of log p(y) and H (p = softmax z, log p = z - lse):

    dL/dz_j = g_l (1[j = y] - p_j) - g_H p_j (log p_j + H)
    dL/dh = (dL/dz / T) W,   dL/dW = (dL/dz / T)^T h

(dH/dz_j = -p_j (log p_j + H), from H = -sum_v p_v log p_v.) Memory of this part: two chunk x V
float32 tensors at a time (computed in place) and the V x H gradient of W, whatever N is. Exact to float rounding: the same
float32 arithmetic as the reference, summed in another order.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK = 256
"""Tokens per chunk: 256 x 151,936 float32 = 0.16 GB per (chunk, V) tensor at Qwen's vocabulary
(two exist at a time), against 5 GB for the logits of 8192 tokens at once."""


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, dt = hidden.shape[0], _compute_dtype(hidden)
        logp = hidden.new_empty(n, dtype=dt)
        ent = hidden.new_empty(n, dtype=dt)
        lse = hidden.new_empty(n, dtype=dt)
        for lo in range(0, n, chunk):  # two (chunk, V) tensors at a time: z and p
            hi = min(n, lo + chunk)
            z = (hidden[lo:hi] @ weight.t()).to(dt).div_(temperature)  # (c, V)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            logp[lo:hi] = z.gather(1, ids[lo:hi, None])[:, 0] - lse[lo:hi]
            ent[lo:hi] = lse[lo:hi] - torch.softmax(z, dim=-1).mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, ids, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple:
        hidden, weight, ids, lse, ent = ctx.saved_tensors
        t, chunk, dt = ctx.temperature, ctx.chunk, _compute_dtype(hidden)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if ctx.needs_input_grad[1] else None
        for lo in range(0, hidden.shape[0], chunk):  # in place: two (chunk, V) tensors at a time
            hi = min(hidden.shape[0], lo + chunk)
            gz = (hidden[lo:hi] @ weight.t()).to(dt).div_(t).sub_(lse[lo:hi, None])  # log p, recomputed
            p = gz.exp()
            if g_ent is not None:  # - g_H p (log p + H)
                gz.add_(ent[lo:hi, None]).mul_(p).mul_(-g_ent[lo:hi, None].to(dt))
            else:
                gz.zero_()
            if g_logp is not None:  # + g_l (1[j = y] - p)
                gl = g_logp[lo:hi, None].to(dt)
                gz.sub_(p.mul_(gl)).scatter_add_(1, ids[lo:hi, None], gl)
            del p
            gz = gz.div_(t).to(hidden.dtype)  # (c, V): d loss / d (h W^T)
            if grad_h is not None:
                grad_h[lo:hi] = gz @ weight
            if grad_w is not None:
                grad_w.addmm_(gz.t().to(dt), hidden[lo:hi].to(dt))
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (as ``gather_logprobs``)."""
    return torch.promote_types(t.dtype, torch.float32)


def logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                    chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[ids] and the entropy of softmax(h W^T / T), per token, differentiable
    in ``hidden`` and ``weight`` (see module docstring).

    Args:
        hidden: (N, H) final hidden states (after the last norm), one row per token.
        weight: (V, H) output embedding (``lm_head.weight``).
        ids: (N,) integer token ids in [0, V): the token each row's distribution is asked about.
        temperature: > 0, the sampling temperature.
        chunk: rows computed at a time (>= 1).

    Returns:
        ((N,) log-probabilities, (N,) entropies in nats), float32 (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or ids.shape != hidden.shape[:1]:
        raise ValueError(f"logprob_entropy: expected hidden (N, H), weight (V, H), ids (N,), got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(ids.shape)}")
    if temperature <= 0 or chunk < 1:
        raise ValueError(f"logprob_entropy: temperature must be > 0 and chunk >= 1, got {temperature}, {chunk}")
    return _LogProbEntropy.apply(hidden, weight, ids.long(), float(temperature), int(chunk))
