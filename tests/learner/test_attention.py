"""Packed-row attention by segments (``learner/attention.py``): sequence bounds by hand, a hand-derived
output, equality with SDPA under transformers' block-diagonal mask (GQA, gradients), the whole model
on packed rows, the choice per device and the errors naming the setting."""

from __future__ import annotations

import types

import pytest
import torch
from learner_helpers import random_actor_critic
from transformers import Qwen2Config, Qwen2ForCausalLM

from vapo_async.learner.attention import (
    SEGMENTS,
    segment_bounds,
    segments_attention_forward,
    segments_mask,
    set_packed_attention,
)
from vapo_async.learner.config import BatchingConfig


def test_segment_bounds_by_hand() -> None:
    # row 0: 0 1 2 | 0 1 | 0 | 0 1 -> starts at 0, 3, 5, 6 (a 0 after a 0 starts one too)
    # row 1: 0 1 2 3 4 5 6 7      -> one sequence
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
    assert segment_bounds(pos) == [[(0, 3), (3, 5), (5, 6), (6, 8)], [(0, 8)]]
    # a sequence may start at a position other than 0: 3 4 5 then 0 1 (transformers' rule: +1 or a new one)
    assert segment_bounds(torch.tensor([[3, 4, 5, 0, 1]])) == [[(0, 3), (3, 5)]]


def _gqa_module(groups: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    return module


def _block_causal_mask(bounds: list[list[tuple[int, int]]], t: int) -> torch.Tensor:
    """(B, 1, T, T) bool: key j visible to query i iff both lie in one segment and j <= i (loops)."""
    mask = torch.zeros(len(bounds), 1, t, t, dtype=torch.bool)
    for r, segs in enumerate(bounds):
        for s, e in segs:
            for i in range(s, e):
                for j in range(s, i + 1):
                    mask[r, 0, i, j] = True
    return mask


def test_first_token_of_each_sequence_sees_only_itself() -> None:
    # softmax over one key is 1, so the output at a sequence's first column is that column's value
    # vector, whatever the queries; with GQA (4 query heads, 2 kv heads) query head h reads kv head h // 2
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 3, generator=g), torch.randn(1, 2, 6, 3, generator=g), torch.randn(1, 2, 6, 3, generator=g)
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])  # sequences [0, 3), [3, 4), [4, 6)
    out, _ = segments_attention_forward(_gqa_module(2), q, k, v, None, scaling=0.5, position_ids=pos)  # (1, 6, 4, 3)
    for col in (0, 3, 4):
        for h in range(4):
            assert torch.equal(out[0, col, h], v[0, h // 2, col])
    # column 1 = softmax(0.5 * [q1.k0, q1.k1]) . [v0, v1], head 0 (kv head 0), by hand
    w = torch.softmax(0.5 * torch.stack([q[0, 0, 1] @ k[0, 0, 0], q[0, 0, 1] @ k[0, 0, 1]]), 0)
    torch.testing.assert_close(out[0, 1, 0], w[0] * v[0, 0, 0] + w[1] * v[0, 0, 1], rtol=1e-6, atol=1e-6)


def test_segments_equal_sdpa_under_the_block_diagonal_mask_with_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]])
    b, t = pos.shape
    q = torch.randn(b, 4, t, 8, generator=g, requires_grad=True)
    k = torch.randn(b, 2, t, 8, generator=g, requires_grad=True)
    v = torch.randn(b, 2, t, 8, generator=g, requires_grad=True)
    w = torch.randn(b, t, 4, 8, generator=g)
    got, _ = segments_attention_forward(_gqa_module(2), q, k, v, None, scaling=8 ** -0.5, position_ids=pos)
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    mask = _block_causal_mask(segment_bounds(pos), t)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=8 ** -0.5).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name, x, r in zip("qkv", got_grads, ref_grads, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6, msg=name)


def test_a_padding_mask_goes_through_transformers_sdpa() -> None:
    # the padded layout: a 2-D mask exists, so segments_mask defers to SDPA's mask and the forward to SDPA
    assert segments_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=None) is None
    mask2d = torch.tensor([[True, True, True, False]])
    built = segments_mask(batch_size=1, q_length=4, kv_length=4, attention_mask=mask2d)
    assert built is not None and built.shape == (1, 1, 4, 4) and not bool(built[0, 0, 3, 3])


def test_whole_model_on_packed_rows_equals_the_dense_mask() -> None:
    """A random 2-layer Qwen2 (GQA, 32k vocabulary) on two packed rows: final hidden states of every
    real token, and the gradients of a random function of them, equal under SDPA with transformers'
    block-diagonal mask and under ``SEGMENTS``."""
    actor, _ = random_actor_critic(vocab=32768)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32768, (2, 30), generator=g)
    pos = torch.tensor([list(range(12)) + list(range(10)) + list(range(8)),
                        list(range(17)) + list(range(9)) + list(range(4))])  # the last 4: a padding tail
    w = torch.randn(2, 30, 64, generator=g)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        actor.zero_grad()
        hidden = actor.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state  # (2, 30, 64)
        (hidden * w).sum().backward()
        return hidden.detach(), [p.grad.clone() for p in actor.parameters()]

    assert actor.config._attn_implementation == "sdpa"
    ref, ref_grads = run()
    set_packed_attention([actor, None], "segments")
    assert actor.config._attn_implementation == SEGMENTS
    got, got_grads = run()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (name, _), x, r in zip(actor.named_parameters(), got_grads, ref_grads, strict=True):
        assert (x - r).abs().max() <= 1e-5 * r.abs().max() + 1e-12, name


def test_the_choice_by_device_and_errors_naming_the_setting() -> None:
    assert BatchingConfig().packed_attention_for("cpu") == "segments"
    assert BatchingConfig().packed_attention_for("cuda") == "mask"
    assert BatchingConfig(packed_attention="mask").packed_attention_for("cpu") == "mask"
    with pytest.raises(ValueError, match="batching.packed_attention .*'dense'"):
        BatchingConfig(packed_attention="dense").packed_attention_for("cpu")
    with pytest.raises(ValueError, match="segments or mask, got 'auto'"):
        set_packed_attention([], "auto")
    # a model on another implementation (flash attention's varlen kernels, eager) keeps it
    other = torch.nn.Module()
    other.config = types.SimpleNamespace(_attn_implementation="eager")
    set_packed_attention([other], "segments")
    assert other.config._attn_implementation == "eager"
    # so does a model with sliding-window layers (the window lives in transformers' mask)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    windowed = Qwen2ForCausalLM(cfg)
    assert "sliding_attention" in windowed.config.layer_types
    set_packed_attention([windowed], "segments")
    assert windowed.config._attn_implementation == "sdpa"
    # Mistral-style: no layer_types, a window on every layer (config.sliding_window)
    mistral_like = torch.nn.Module()
    mistral_like.config = types.SimpleNamespace(_attn_implementation="sdpa", sliding_window=4096)
    set_packed_attention([mistral_like], "segments")
    assert mistral_like.config._attn_implementation == "sdpa"
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="batching.packed_attention=mask"):
        segments_attention_forward(_gqa_module(1), q, q, q, None, position_ids=torch.arange(3)[None], sliding_window=4)
