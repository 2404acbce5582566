"""``algo.chunked.logprob_entropy`` against the full-logits reference (``gather_logprobs``,
``entropy_from_logits``): values and gradients, float64 (gradcheck) and float32 at a 32k vocabulary."""

from __future__ import annotations

import pytest
import torch

from vapo_async.algo.chunked import logprob_entropy
from vapo_async.algo.stats import entropy_from_logits, gather_logprobs


def _reference(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (h @ w.t())[None] / t  # (1, N, V): the full tensor the chunked path never builds
    return gather_logprobs(logits, ids[None])[0], entropy_from_logits(logits)[0]


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (7,), generator=g)
    # chunk 3 over 7 rows: a full chunk, another, and a remainder of 1
    assert torch.autograd.gradcheck(lambda a, b: logprob_entropy(a, b, ids, 0.7, chunk=3), (h, w))


@pytest.mark.parametrize("chunk", [1, 64, 1000])
def test_matches_full_logits_with_gradients_at_a_32k_vocabulary(chunk: int) -> None:
    """float32, 300 tokens x 32,768 words: values and gradients within 2e-5 of their largest entry
    from the float64 truth, and no further from it than the float32 full-logits reference is (that
    reference itself is 1.95e-5 off on the hidden-state gradient with torch 2.13 CPU: fp32 sums
    over 32,768 words; chunks of 1 token are 1.1e-5 off)."""
    g = torch.Generator().manual_seed(1)
    n, hid, vocab, t = 300, 64, 32768, 0.8
    h0 = torch.randn(n, hid, generator=g)
    w0 = torch.randn(vocab, hid, generator=g) * 0.3  # logits of std ~2.4: peaked, not flat
    ids = torch.randint(0, vocab, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)  # any upstream gradient

    def run(fn, dtype: torch.dtype) -> list[torch.Tensor]:
        h, w = h0.to(dtype, copy=True).requires_grad_(), w0.to(dtype, copy=True).requires_grad_()
        logp, ent = fn(h, w, ids, t)
        ((a.to(dtype) * logp).sum() + (b.to(dtype) * ent).sum()).backward()
        return [x.detach().double() for x in (logp, ent, h.grad, w.grad)]

    truth = run(_reference, torch.float64)
    full32 = run(_reference, torch.float32)
    chunked = run(lambda h, w, i, tt: logprob_entropy(h, w, i, tt, chunk=chunk), torch.float32)
    for name, tr, ref, got in zip(("logp", "entropy", "grad hidden", "grad weight"), truth, full32, chunked, strict=True):
        err, ref_err, scale = (got - tr).abs().max().item(), (ref - tr).abs().max().item(), tr.abs().max().item()
        assert err <= 2e-5 * scale, f"{name}: max error {err:.2e} > 2e-5 x {scale:.2f}"
        assert err <= 1.5 * ref_err + 1e-7 * scale, f"{name}: {err:.2e} vs the full-logits float32 {ref_err:.2e}"
    assert chunked[1].min() > 0 and chunked[0].max() < 0  # entropies > 0, log-probs < 0


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"expected hidden \(N, H\), weight \(V, H\), ids \(N,\)"):
        logprob_entropy(torch.zeros(3, 4), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprob_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), temperature=0.0)
