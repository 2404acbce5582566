"""Fast paths of GAE, proven equal to the readable recurrence ``vapo_async.algo.advantages.gae``.

Modules:
    numba_gae  the recurrence walked once per row in numba-compiled code (CPU, one pass over memory)
    torch_gae  TD residuals as whole-tensor ops + the blocked matmul scan (any device, GPU)
    scan       the blocked matmul reverse scan A_t = d_t + x * A_{t+1} under ``torch_gae``

``gae_fast`` is the dispatcher: "auto" takes "compiled" (numba) for CPU tensors when numba is
installed and "torch" (the scan) otherwise; ``advantages.gae(..., backend="reference")`` runs the
readable loop instead. tests/algo/test_gae_fast_paths.py checks every path against the readable one
on random ragged batches (hypothesis).

Shared here (so that ``advantages`` and the paths agree): input checks, the per-row lambda tensor
and the output buffers; all three raise ValueError with what was expected.
"""

from __future__ import annotations

from typing import Literal

import torch

from vapo_async.algo.fast import numba_gae
from vapo_async.algo.fast.torch_gae import gae_rows_torch

Backend = Literal["auto", "compiled", "torch", "reference"]
"""Which GAE implementation runs: "reference" is the readable loop of ``advantages.gae``."""


def check_gae_inputs(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float) -> None:
    """Raise unless rewards, values, mask are (B, T), rewards/values floating and gamma in [0, 1]."""
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"gae: rewards, values and mask must all be (B, T); got {tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (rewards.is_floating_point() and values.is_floating_point()):
        raise ValueError(f"gae: rewards and values must be floating point, got {rewards.dtype} and {values.dtype}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gae: gamma must be in [0, 1], got {gamma}")


def lambda_tensor(lam: float | torch.Tensor, b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def compute_dtype(rewards: torch.Tensor, values: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, compute dtype): the promoted input dtype, and float64 or else float32."""
    out_dtype = torch.promote_types(rewards.dtype, values.dtype)
    return out_dtype, torch.float64 if out_dtype == torch.float64 else torch.float32


def outputs(
    out: tuple[torch.Tensor, torch.Tensor] | None, b: int, t: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (advantages, returns) (B, T) buffers: the caller's (checked) or new ones."""
    if out is None:
        return torch.empty(b, t, dtype=dtype, device=device), torch.empty(b, t, dtype=dtype, device=device)
    for buf in out:
        if buf.shape != (b, t) or buf.dtype != dtype or not buf.is_contiguous() or buf.device != device:
            raise ValueError(f"gae: out buffers must be contiguous ({b}, {t}) {dtype} on {device}, got {buf.dtype} {tuple(buf.shape)}")
    return out


def use_compiled(backend: str, device: torch.device) -> bool:
    """Whether ``gae_fast`` takes the compiled CPU path (see its ``backend`` argument)."""
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cpu" and numba_gae.numba_available()
    if backend != "compiled":
        raise ValueError(f"gae: backend must be 'auto', 'compiled', 'torch' or 'reference', got {backend!r}")
    if device.type != "cpu" or not numba_gae.numba_available():
        raise ValueError(f"gae: backend='compiled' needs CPU tensors and numba installed (device {device}, numba installed: {numba_gae.numba_available()})")
    return True


def gae_fast(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``advantages.gae`` by a fast path ("auto", "compiled" or "torch"; arguments as there).

    Args:
        rewards, values: (B, T) floating token rewards r_t and values V_t.
        mask: (B, T) nonzero on valid tokens.
        gamma: discount in [0, 1].
        lam: a float or (B,) tensor of per-row lambdas in [0, 1].
        out: optional contiguous (B, T) (advantages, returns) buffers in the compute dtype.
        backend: "auto", "compiled" or "torch".

    Returns:
        (advantages, returns), (B, T), 0 on padding, without gradient.
    """
    check_gae_inputs(rewards, values, mask, gamma)
    b, t = rewards.shape
    out_dtype, cdtype = compute_dtype(rewards, values)
    x = gamma * lambda_tensor(lam, b, cdtype, rewards.device)  # (B,) gamma * lambda_i
    valid = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    adv, ret = outputs(out, b, t, cdtype, rewards.device)
    if use_compiled(backend, rewards.device):
        r, v = (a.detach().to(cdtype).contiguous() for a in (rewards, values))
        numba_gae.gae_rows_compiled(r, v, valid.contiguous(), x, gamma, adv, ret)
    else:
        gae_rows_torch(rewards, values, valid, x, gamma, adv, ret)
    if out is not None:
        return adv, ret
    return adv.to(out_dtype), ret.to(out_dtype)
