"""Advantage estimators: GAE (decoupled, length-adaptive) and group-normalised (GRPO/DAPO).

Notation (see ``vapo_async.algo``): B responses, T padded length, G samples per prompt,
L_i valid tokens of response i; ``mask[i, t]`` is nonzero on the tokens that count.

Deliberate departures from the papers (each a documented choice where the paper is silent):
- ``length_adaptive_lambda`` clamps the VAPO eq. 5 value below at 0 (the paper gives no clamp;
  the formula is negative for L < 1/alpha). No upper clamp: 1 - 1/(alpha * L) < 1 for finite L.
- ``gae`` runs the recurrence over the valid tokens of each row only: a row whose mask has gaps is
  treated as if its valid tokens were adjacent (the value after a valid token is that of the next
  valid token, 0 after the last). Its outputs carry no gradient (advantages and returns are
  constants in PPO), and it computes in float32 at least (bfloat16/float16 inputs are upcast).
  Fast paths in ``vapo_async.algo.fast`` (numba on CPU, the blocked scan elsewhere) compute the
  same recurrence in a different order of operations: equal up to rounding (tests/algo).
- ``group_advantages`` uses the unbiased (Bessel) standard deviation like the common GRPO code,
  returns exactly 0 for a group whose rewards are all equal (the formula is 0/0 there) and 0 for
  G = 1 (no group to compare with).
"""

from __future__ import annotations

import torch

from vapo_async.algo.fast import (
    Backend,
    check_gae_inputs,
    compute_dtype,
    gae_fast,
    lambda_tensor,
    outputs,
)


def length_adaptive_lambda(
    lengths: torch.Tensor, alpha: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-response policy lambda of length-adaptive GAE (VAPO eq. 5), clamped below at 0.

    lambda_policy(L) = 1 - 1 / (alpha * L), chosen so that sum_t lambda^t = alpha * L (eq. 4).
    Example: L = 100, alpha = 0.05 -> 1 - 1/5 = 0.8; any L <= 1/alpha = 20 -> 0.

    Args:
        lengths: (B,) integer response lengths L_i (>= 0; L = 0 gives 0).
        alpha: the eq. 5 constant (> 0; paper: 0.05).
        dtype: floating dtype of the result.

    Returns:
        (B,) lambdas in [0, 1).
    """
    if alpha <= 0:
        raise ValueError(f"length_adaptive_lambda: alpha must be > 0, got {alpha}")
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex():
        raise ValueError(f"length_adaptive_lambda: lengths must be a (B,) integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("length_adaptive_lambda: lengths must be >= 0")
    lam = 1.0 - 1.0 / (alpha * lengths.to(torch.float64))  # L = 0 -> -inf -> clamped to 0
    return lam.clamp(min=0.0).to(dtype)


def place_terminal_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards for the sparse verifier setting: score i on the last valid token of row i.

    Args:
        scores: (B,) float sequence rewards R_i.
        mask: (B, T) valid-token mask (nonzero = valid).

    Returns:
        (B, T) tensor (dtype of ``scores``), zero except at each row's last valid token; a row
        with no valid token gets no reward.
    """
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"place_terminal_rewards: expected scores (B,) and mask (B, T), got {tuple(scores.shape)} and {tuple(mask.shape)}")
    valid = mask != 0
    t = mask.shape[1]
    # last valid index = argmax of position * valid (positions start at 1 so an empty row gives 0)
    pos = torch.arange(1, t + 1, device=mask.device)
    last = (pos * valid).argmax(dim=1, keepdim=True)
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has = valid.any(dim=1, keepdim=True)
    out.scatter_(1, last, torch.where(has, scores[:, None], torch.zeros_like(scores[:, None])))
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a per-response lambda (PAPER.md "Decoupled GAE").

    Decoupled GAE calls this twice: lambda_critic = 1.0 for the critic's returns and lambda_policy
    (a float, or the length-adaptive (B,) tensor of eq. 5) for the policy's advantages. The body
    below is the recurrence; ``backend`` "auto" (default), "compiled" (numba, CPU) or "torch"
    (blocked scan, any device) hands the same computation to ``vapo_async.algo.fast``, proven equal
    by tests/algo/test_gae_fast_paths.py; "reference" runs the loop below.

    Args:
        rewards: (B, T) token rewards r_t (verifier setting: the score on the last valid token).
        values: (B, T) critic values V_t.
        mask: (B, T) nonzero on valid tokens, anywhere in T (left/right padding, gaps); padding
            may hold anything, NaN included, and never reaches a valid output.
        gamma: discount in [0, 1] (the papers use 1.0).
        lam: a float in [0, 1] or a (B,) tensor of per-response lambdas in [0, 1].
        out: optional contiguous (B, T) float32/float64 (advantages, returns) buffers to fill.
        backend: see above.

    Returns:
        (advantages, returns), (B, T) in the promoted dtype of rewards and values (the ``out``
        buffers when given), 0 on padding, without gradient.
    """
    if backend != "reference":
        return gae_fast(rewards, values, mask, gamma, lam, out, backend)
    check_gae_inputs(rewards, values, mask, gamma)
    (b, t), (out_dtype, cdtype) = rewards.shape, compute_dtype(rewards, values)
    valid = mask != 0  # (B, T)
    r = torch.where(valid, rewards.detach().to(cdtype), 0.0)  # (B, T), padding zeroed (even NaN)
    v = torch.where(valid, values.detach().to(cdtype), 0.0)  # (B, T)
    x = gamma * lambda_tensor(lam, b, cdtype, rewards.device)  # (B,) gamma * lambda_i
    adv, ret = outputs(out, b, t, cdtype, rewards.device)
    a_next = torch.zeros(b, dtype=cdtype, device=rewards.device)  # (B,) A_{t+1}, 0 after the last token
    v_next = torch.zeros_like(a_next)  # (B,) V_{t+1}, 0 after the last token
    for j in reversed(range(t)):
        delta = (r[:, j] - v[:, j]) + gamma * v_next  # delta_t = r_t + gamma * V_{t+1} - V_t
        a = delta + x * a_next  # A_t = delta_t + gamma * lambda * A_{t+1}
        # padding is skipped: the next *valid* token's A and V carry over it
        a_next, v_next = torch.where(valid[:, j], a, a_next), torch.where(valid[:, j], v[:, j], v_next)
        adv[:, j] = torch.where(valid[:, j], a, 0.0)
    torch.add(adv, v, out=ret)  # returns_t = A_t + V_t (the critic's target), 0 on padding
    return (adv, ret) if out is not None else (adv.to(out_dtype), ret.to(out_dtype))


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO / DAPO outcome advantage: A_i = (R_i - mean(R_group)) / (std(R_group) + eps).

    Responses are grouped consecutively: rows [k*G, (k+1)*G) share a prompt. A group whose rewards
    are all equal gets exactly 0 (never NaN); G = 1 gives 0.

    Args:
        rewards: (B,) floating sequence rewards R_i, B a multiple of G (B = 0 allowed).
        group_size: G >= 1.
        normalize_std: divide by the group std (GRPO); False keeps only the mean baseline.
        eps: added to the std.

    Returns:
        (B,) advantages in the dtype of ``rewards`` (computed in float32 at least).
    """
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"group_advantages: rewards must be a (B,) float tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: B = {rewards.numel()} is not a positive multiple of group_size = {group_size}")
    cdtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(cdtype).view(-1, group_size)  # (B/G, G)
    if group_size == 1 or rewards.numel() == 0:
        return torch.zeros_like(rewards)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) - r.amin(dim=1, keepdim=True)) == 0
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1).to(rewards.dtype)
