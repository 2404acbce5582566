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
  Two implementations, equal up to rounding: on CPU with numba installed, a compiled one-pass loop
  (``vapo_async.algo.gae_cpu``); elsewhere (GPU, no numba) the blocked matmul scan below.
- ``group_advantages`` uses the unbiased (Bessel) standard deviation like the common GRPO code,
  returns exactly 0 for a group whose rewards are all equal (the formula is 0/0 there) and 0 for
  G = 1 (no group to compare with).
"""

from __future__ import annotations

from typing import Literal

import torch

from vapo_async.algo import gae_cpu
from vapo_async.algo.scan import DEFAULT_CHUNK, reverse_scan

BLOCK_ELEMS = 1 << 19
"""Rows are processed in blocks of about this many elements so intermediates stay in cache."""


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


def _check_gae_inputs(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"gae: rewards, values and mask must all be (B, T); got {tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (rewards.is_floating_point() and values.is_floating_point()):
        raise ValueError(f"gae: rewards and values must be floating point, got {rewards.dtype} and {values.dtype}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gae: gamma must be in [0, 1], got {gamma}")


def _lambda_tensor(lam: float | torch.Tensor, b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(B,) lambdas from a float or a (B,) tensor, checked to lie in [0, 1]."""
    if isinstance(lam, torch.Tensor):
        if lam.shape != (b,):
            raise ValueError(f"gae: lam must be a float or a (B,) = ({b},) tensor, got shape {tuple(lam.shape)}")
        lam_t = lam.detach().to(device=device, dtype=dtype)
    else:
        lam_t = torch.full((b,), float(lam), dtype=dtype, device=device)
    if b and not bool(((lam_t >= 0) & (lam_t <= 1)).all()):
        raise ValueError(f"gae: every lambda must be in [0, 1], got min {lam_t.min().item()} max {lam_t.max().item()}")
    return lam_t


class _Workspace:
    """Buffers reused by every row block of one ``gae`` call (fresh large tensors cost page faults)."""

    def __init__(self, rows: int, t: int, dtype: torch.dtype, device: torch.device) -> None:
        self.itype = torch.int32 if dtype == torch.float32 else torch.int64
        self.pad = (-t) % DEFAULT_CHUNK if t > DEFAULT_CHUNK else 0
        self.delta = torch.zeros(rows, t + self.pad, dtype=dtype, device=device)  # front pad stays 0
        self.scan = torch.empty_like(self.delta)
        self.values = torch.empty(rows, t, dtype=dtype, device=device)
        self.keep = torch.empty(rows, t, dtype=self.itype, device=device)


def _gae_rows(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    x: torch.Tensor,
    gamma: float,
    adv_out: torch.Tensor,
    ret_out: torch.Tensor,
    ws: _Workspace,
) -> None:
    """GAE on a block of b rows, written into adv_out / ret_out.

    Args:
        rewards, values: (b, T) in the compute dtype (float32/float64).
        valid: (b, T) uint8 0/1 mask.
        x: (b,) gamma * lambda per row.
        adv_out, ret_out: (b, T) contiguous outputs in the compute dtype.
        ws: buffers with at least b rows.
    """
    b = rewards.shape[0]
    it = ws.itype
    # keep = -1 (all bits set) on valid tokens, 0 on padding. AND-ing a float's bits with it is a
    # bit-exact, NaN-proof masked select: valid values pass unchanged (NaN/inf in valid tokens still
    # show), padding becomes +0.0 whatever it held. (torch.where is a scalar kernel on CPU, ~10x slower.)
    keep = ws.keep[:b]
    keep.copy_(torch.neg(valid.view(torch.int8)))  # int8 -1 sign-extends to all ones
    vs = ws.values[:b]
    torch.bitwise_and(values.view(it), keep, out=vs.view(it))
    delta = ws.delta[:b, ws.pad :]
    torch.bitwise_and(rewards.view(it), keep, out=delta.view(it))
    # TD residual delta_t = r_t + gamma * V_{t+1} - V_t (PAPER.md "Decoupled GAE"); V after the last
    # valid token is 0 because padding was zeroed, which also makes delta 0 on right padding.
    delta.sub_(vs)
    delta[:, :-1].add_(vs[:, 1:], alpha=gamma)
    # A valid token right after an invalid one (a "rise") means left padding or a gap somewhere.
    rise = torch.gt(valid[:, 1:], valid[:, :-1])
    prefix_only = not bool(rise.any())
    # A_t = delta_t + gamma * lambda * A_{t+1} (blocked matmul scan). Tokens before a row's first
    # valid one never feed valid ones (the scan runs backwards); they are masked out below. When
    # every row's valid tokens are a prefix (right padding) no output mask is needed: delta is 0
    # after the prefix and nothing flows backwards into it, so A is exactly 0 there.
    if prefix_only and ws.pad == 0:
        reverse_scan(delta, x, out=adv_out)
    else:
        scan = reverse_scan(ws.delta[:b], x, out=ws.scan[:b])[:, ws.pad :]
        torch.bitwise_and(scan.view(it), keep, out=adv_out.view(it))
    torch.add(adv_out, vs, out=ret_out)  # returns = A + V on valid tokens, 0 + 0 on padding
    if not prefix_only:
        # A row with several runs of valid tokens is redone on its valid tokens moved together.
        runs = rise.view(torch.uint8).sum(dim=1, dtype=torch.int32) + valid[:, 0]
        gapped = (runs > 1).nonzero().squeeze(1)
        if gapped.numel():
            _gae_gapped_rows(rewards[gapped], values[gapped], valid[gapped], x[gapped], gamma, adv_out, ret_out, gapped)


def _gae_gapped_rows(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    x: torch.Tensor,
    gamma: float,
    adv_out: torch.Tensor,
    ret_out: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Rows whose mask has gaps: move valid tokens to the front (order kept), solve, scatter back."""
    order = torch.sort(valid, dim=1, descending=True, stable=True).indices  # (g, T)
    r_p, v_p, m_p = (torch.gather(a, 1, order) for a in (rewards, values, valid))
    adv_p = torch.empty_like(r_p)
    ret_p = torch.empty_like(r_p)
    g, t = r_p.shape
    _gae_rows(r_p, v_p, m_p, x, gamma, adv_p, ret_p, _Workspace(g, t, r_p.dtype, r_p.device))
    adv_out[rows] = torch.zeros_like(adv_p).scatter_(1, order, adv_p)
    ret_out[rows] = torch.zeros_like(ret_p).scatter_(1, order, ret_p)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: Literal["auto", "compiled", "torch"] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a per-response lambda (VAPO sections 3.1-3.2).

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lambda * A_{t+1},
    returns_t = A_t + V_t, run over the valid tokens of each row (V and A are 0 past the last one).
    Decoupled GAE calls this twice: lambda_critic = 1.0 for the critic's returns and lambda_policy
    (a float or the length-adaptive per-row tensor, eq. 5) for the policy's advantages.

    Two implementations (``backend``): "compiled", the recurrence as written walked once per row in
    numba-compiled code (``vapo_async.algo.gae_cpu``; CPU only, one pass over memory), and
    "torch", a blocked matmul scan (``vapo_async.algo.scan``) with no Python loop over T, for any
    device. "auto" takes "compiled" for CPU tensors when numba is installed, else "torch".

    Args:
        rewards: (B, T) token rewards r_t (verifier setting: the score on the last valid token).
        values: (B, T) critic values V_t.
        mask: (B, T) nonzero on valid tokens. Responses may sit anywhere in T (left or right
            padding, even gaps); padding may hold anything, NaN included, and never reaches a
            valid output.
        gamma: discount in [0, 1] (the papers use 1.0).
        lam: a float in [0, 1] or a (B,) tensor of per-response lambdas in [0, 1].
        out: optional preallocated contiguous (B, T) (advantages, returns) buffers in float32 or
            float64 (the compute dtype) to write into, e.g. reused across calls: fresh
            multi-megabyte outputs cost a page fault per 4 KiB on first touch.
        backend: "auto", "compiled" (raises unless the tensors are on CPU and numba is installed)
            or "torch" (see above).

    Returns:
        (advantages, returns), both (B, T) in the promoted dtype of rewards and values (the
        ``out`` buffers when given), 0 on padding, without gradient.
    """
    _check_gae_inputs(rewards, values, mask, gamma)
    b, t = rewards.shape
    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    cdtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    x = gamma * _lambda_tensor(lam, b, cdtype, rewards.device)
    valid = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    adv, ret = _outputs(out, b, t, cdtype, rewards.device)
    if _use_compiled(backend, rewards.device):
        to_c = (t_.detach().to(cdtype).contiguous() for t_ in (rewards, values))
        gae_cpu.gae_rows_compiled(*to_c, valid.contiguous(), x, gamma, adv, ret)
    elif b and t:
        rows = min(b, max(1, BLOCK_ELEMS // t))
        ws = _Workspace(rows, t, cdtype, rewards.device)
        with torch.no_grad():
            for s in range(0, b, rows):
                e = min(b, s + rows)
                _gae_rows(
                    rewards[s:e].to(cdtype).contiguous(),
                    values[s:e].to(cdtype).contiguous(),
                    valid[s:e].contiguous(),
                    x[s:e],
                    gamma,
                    adv[s:e],
                    ret[s:e],
                    ws,
                )
    if out is not None:
        return adv, ret
    return adv.to(out_dtype), ret.to(out_dtype)


def _use_compiled(backend: str, device: torch.device) -> bool:
    """Whether ``gae`` takes the compiled CPU path (see its ``backend`` argument)."""
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cpu" and gae_cpu.numba_available()
    if backend != "compiled":
        raise ValueError(f"gae: backend must be 'auto', 'compiled' or 'torch', got {backend!r}")
    if device.type != "cpu" or not gae_cpu.numba_available():
        raise ValueError(f"gae: backend='compiled' needs CPU tensors and numba installed (device {device}, numba installed: {gae_cpu.numba_available()})")
    return True


def _outputs(
    out: tuple[torch.Tensor, torch.Tensor] | None, b: int, t: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (advantages, returns) buffers: the caller's (checked) or new ones."""
    if out is None:
        return torch.empty(b, t, dtype=dtype, device=device), torch.empty(b, t, dtype=dtype, device=device)
    for buf in out:
        if buf.shape != (b, t) or buf.dtype != dtype or not buf.is_contiguous() or buf.device != device:
            raise ValueError(f"gae: out buffers must be contiguous ({b}, {t}) {dtype} on {device}, got {buf.dtype} {tuple(buf.shape)}")
    return out


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
