"""Advantages in one place: GAE (decoupled, length-adaptive), group-normalised (GRPO/DAPO), DAPO shaping.

``advantages_and_returns`` goes from a batch of scored responses (+ critic values) to advantages
and returns; the learner calls its two halves, ``score_responses`` (rank 0, whole groups) and
``token_advantages`` (per micro-batch, after the values are recomputed). ``gae`` is the recurrence
as PAPER.md writes it; its fast paths live in ``vapo_async.algo.fast``.

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
- ``overlong_penalty`` with ``cache_len = 0`` is a hard -1 above ``max_len`` (DAPO's middle band
  is empty then).
- ``group_advantages`` uses the unbiased (Bessel) standard deviation like the common GRPO code,
  returns exactly 0 for a group whose rewards are all equal (the formula is 0/0 there) and 0 for
  G = 1 (no group to compare with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    (b, n), (out_dtype, cdtype) = rewards.shape, compute_dtype(rewards, values)  # n = T
    valid = mask != 0  # (B, T)
    r = torch.where(valid, rewards.detach().to(cdtype), 0.0)  # (B, T), padding zeroed (even NaN)
    v = torch.where(valid, values.detach().to(cdtype), 0.0)  # (B, T)
    x = gamma * lambda_tensor(lam, b, cdtype, rewards.device)  # (B,) gamma * lambda_i
    adv, ret = outputs(out, b, n, cdtype, rewards.device)
    a_next = torch.zeros(b, dtype=cdtype, device=rewards.device)  # (B,) A_{t+1}, 0 after the last token
    v_next = torch.zeros_like(a_next)  # (B,) V_{t+1}, 0 after the last token
    for t in reversed(range(n)):
        delta = (r[:, t] - v[:, t]) + gamma * v_next  # delta_t = r_t + gamma * V_{t+1} - V_t
        a = delta + x * a_next  # A_t = delta_t + gamma * lambda * A_{t+1}
        # padding is skipped: the next *valid* token's A and V carry over it
        a_next, v_next = torch.where(valid[:, t], a, a_next), torch.where(valid[:, t], v[:, t], v_next)
        adv[:, t] = torch.where(valid[:, t], a, 0.0)
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


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, cache_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DAPO soft overlong punishment R_len(|y|) (PAPER.md, DAPO bullet), added to the correctness reward.

    R_len(L) = 0 for L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len up to
    max_len (linear from 0 to -1); -1 beyond max_len. The one implementation: the learner's
    shaping (``score_responses``) and the scalar reward-side ``vapo_async.rewards.overlong_penalty``
    both call it. Computed in float64 (exact for these integer ratios), returned in ``dtype``.

    Args:
        lengths: (B,) integer response lengths |y|.
        max_len: L_max > 0.
        cache_len: L_cache in [0, max_len].
        dtype: floating dtype of the result.

    Returns:
        (B,) penalties in [-1, 0].
    """
    if max_len <= 0 or not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong_penalty: need max_len > 0 and 0 <= cache_len <= max_len, got {max_len}, {cache_len}")
    if lengths.dim() != 1 or lengths.is_floating_point():
        raise ValueError(f"overlong_penalty: lengths must be a (B,) integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
    length = lengths.to(torch.float64)
    soft_start = float(max_len - cache_len)
    ramp = (soft_start - length) / max(cache_len, 1)  # cache_len = 0: the ramp is never used
    out = torch.where(length <= soft_start, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -1.0), out).to(dtype)


@dataclass(frozen=True)
class GaeLambdas:
    """The lambda of each GAE pass (PAPER.md: decoupled GAE, length-adaptive GAE eq. 5)."""

    policy: float = 0.95
    """lambda_policy of every response when ``alpha`` is None."""
    critic: float | None = 1.0
    """lambda_critic (decoupled GAE); None = coupled: the critic uses the policy's lambdas."""
    alpha: float | None = 0.05
    """Length-adaptive constant: lambda_policy(L) = 1 - 1/(alpha L) clamped at 0; None = fixed."""

    def policy_lambdas(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) float32 policy lambdas for (B,) integer response lengths."""
        if self.alpha is not None:
            return length_adaptive_lambda(lengths, self.alpha)
        return torch.full(lengths.shape, self.policy, dtype=torch.float32, device=lengths.device)

    def critic_lambdas(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) float32 critic lambdas for (B,) integer response lengths."""
        if self.critic is None:
            return self.policy_lambdas(lengths)
        return torch.full(lengths.shape, self.critic, dtype=torch.float32, device=lengths.device)


def score_responses(
    scores: torch.Tensor, lengths: torch.Tensor, *, group_size: int | None, overlong: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence-level half of ``advantages_and_returns``: shaped rewards and group advantages.

    Needs whole groups (rows [k*G, (k+1)*G) share a prompt), so the learner runs it on rank 0
    before the batch is split across ranks.

    Args:
        scores: (B,) float verifier rewards R_i.
        lengths: (B,) integer response lengths L_i.
        group_size: G for the group-normalised advantage (GRPO/DAPO); None: no group advantage.
        overlong: (L_max, L_cache) of DAPO's soft overlong punishment, or None.

    Returns:
        rewards (B,) = R_i + R_len(L_i) (DAPO eq. 13; R_i without shaping), dtype of ``scores``;
        seq_adv (B,) = (R_i - mean_group) / (std_group + eps) on those rewards, or zeros.
    """
    rewards = scores
    if overlong is not None and scores.numel():
        rewards = scores + overlong_penalty(lengths, *overlong, dtype=scores.dtype)
    if group_size is None or not scores.numel():
        return rewards, torch.zeros_like(rewards)
    return rewards, group_advantages(rewards, group_size)


def token_advantages(
    rewards: torch.Tensor,
    seq_adv: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None,
    *,
    estimator: Literal["gae", "group"],
    gamma: float,
    lambdas: GaeLambdas,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token-level half of ``advantages_and_returns``: any subset of rows (one micro-batch).

    "gae" (VAPO, PPO): the reward on the last valid token, then decoupled GAE: the critic's
    returns with lambda_critic, the policy's advantages with lambda_policy (eq. 5 per response).
    "group" (GRPO, DAPO): the sequence advantage on every valid token; no returns.

    Args:
        rewards: (B,) shaped sequence rewards (from ``score_responses``).
        seq_adv: (B,) sequence advantages (from ``score_responses``; read by "group" only).
        lengths: (B,) integer response lengths L_i (the length-adaptive lambda's L).
        mask: (B, T) float, 1 on response tokens.
        values: (B, T) critic values V_t ("gae"), None for "group".
        estimator: "gae" or "group".
        gamma: discount in [0, 1].
        lambdas: the lambdas of the two GAE passes.

    Returns:
        advantages (B, T) and returns (B, T) ("gae") or None ("group"), 0 on padding.
    """
    if estimator == "group":
        return seq_adv[:, None] * mask, None
    if estimator != "gae" or values is None:
        raise ValueError(f"token_advantages: estimator must be 'gae' (with values) or 'group', got {estimator!r} "
                         f"with values {'given' if values is not None else 'None'}")
    token_rewards = place_terminal_rewards(rewards, mask)  # (B, T): R_i on the last token
    _, returns = gae(token_rewards, values, mask, gamma, lambdas.critic_lambdas(lengths))
    advantages, _ = gae(token_rewards, values, mask, gamma, lambdas.policy_lambdas(lengths))
    return advantages, returns


def advantages_and_returns(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None,
    *,
    estimator: Literal["gae", "group"],
    group_size: int | None = None,
    overlong: tuple[int, int] | None = None,
    gamma: float = 1.0,
    lambdas: GaeLambdas,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch of scored responses (+ values with a critic) -> (advantages (B, T), returns (B, T) | None).

    DAPO shaping, then the group advantage ("group", G = ``group_size``) or decoupled,
    length-adaptive GAE ("gae"): ``score_responses`` then ``token_advantages``. The learner runs
    the two halves apart (the first on rank 0 over whole groups, the second per micro-batch once
    the values are recomputed); tests/algo/test_advantages_one_place.py proves the split equal to
    this call. Arguments as in the two halves; ``mask`` (B, T) float, 1 on response tokens.
    """
    if estimator == "group" and group_size is None:
        raise ValueError("advantages_and_returns: estimator 'group' needs group_size")
    rewards, seq_adv = score_responses(scores, lengths, group_size=group_size if estimator == "group" else None,
                                       overlong=overlong)
    return token_advantages(rewards, seq_adv, lengths, mask, values, estimator=estimator, gamma=gamma, lambdas=lambdas)
