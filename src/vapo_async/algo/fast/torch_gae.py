"""GAE by the blocked matmul scan: the any-device (GPU) fast path of ``vapo_async.algo.advantages.gae``.

Computes what ``vapo_async.algo.advantages.gae`` writes as a loop, with no Python loop over T:
the TD residuals delta_t = r_t + gamma * V_{t+1} - V_t (PAPER.md "Decoupled GAE") as a few
whole-tensor ops, then A_t = delta_t + gamma * lambda * A_{t+1} by ``fast.scan.reverse_scan``.

Choices (speed; the results equal the recurrence up to rounding, proven by tests/algo):
- Rows are processed in blocks of about ``BLOCK_ELEMS`` elements so intermediates stay in cache,
  with buffers reused by every block (fresh large tensors cost page faults).
- Masking is a bitwise AND of a float's bits with -1 / 0 (bit-exact and NaN-proof; ``torch.where``
  is a scalar kernel on CPU, ~10x slower).
- Rows whose valid tokens are not one run (gaps) are redone with their valid tokens moved to the
  front (order kept), solved, and scattered back.
"""

from __future__ import annotations

import torch

from vapo_async.algo.fast.scan import DEFAULT_CHUNK, reverse_scan

BLOCK_ELEMS = 1 << 19
"""Rows are processed in blocks of about this many elements so intermediates stay in cache."""


class _Workspace:
    """Buffers reused by every row block of one call (fresh large tensors cost page faults)."""

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
    # show), padding becomes +0.0 whatever it held.
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
    """Rows whose mask has gaps: move valid tokens to the front (order kept), solve, scatter back.

    Args: as ``_gae_rows`` for the g gapped rows; ``rows`` (g,) their indices in adv_out/ret_out.
    """
    order = torch.sort(valid, dim=1, descending=True, stable=True).indices  # (g, T)
    r_p, v_p, m_p = (torch.gather(a, 1, order) for a in (rewards, values, valid))
    adv_p = torch.empty_like(r_p)
    ret_p = torch.empty_like(r_p)
    g, t = r_p.shape
    _gae_rows(r_p, v_p, m_p, x, gamma, adv_p, ret_p, _Workspace(g, t, r_p.dtype, r_p.device))
    adv_out[rows] = torch.zeros_like(adv_p).scatter_(1, order, adv_p)
    ret_out[rows] = torch.zeros_like(ret_p).scatter_(1, order, ret_p)


@torch.no_grad()
def gae_rows_torch(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    x: torch.Tensor,
    gamma: float,
    adv: torch.Tensor,
    ret: torch.Tensor,
) -> None:
    """GAE of every row by the blocked scan, written into ``adv`` and ``ret``.

    Args:
        rewards, values: (B, T) token rewards r_t and values V_t (any float dtype, any device).
        valid: (B, T) uint8 0/1 mask (1 = valid token).
        x: (B,) gamma * lambda_i per row in the compute dtype.
        gamma: discount.
        adv, ret: (B, T) contiguous float32/float64 outputs (the compute dtype), 0 on padding.
    """
    b, t = rewards.shape
    if b == 0 or t == 0:
        return
    cdtype = adv.dtype
    rows = min(b, max(1, BLOCK_ELEMS // t))
    ws = _Workspace(rows, t, cdtype, rewards.device)
    for s in range(0, b, rows):
        e = min(b, s + rows)
        r, v = (a[s:e].to(cdtype).contiguous() for a in (rewards, values))
        _gae_rows(r, v, valid[s:e].contiguous(), x[s:e], gamma, adv[s:e], ret[s:e], ws)
