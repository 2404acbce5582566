"""``model.compile`` (``models.compile_blocks``): compiled transformer blocks give the eager
model's log-probs, entropy, values and gradients on a padded and a packed micro-batch of different
lengths (dynamic shapes), and leave parameter names unchanged (the
weights the learner publishes and checkpoints)."""

from __future__ import annotations

import copy

import torch
from learner_helpers import make_groups, random_actor_critic

from vapo_async.learner.attention import set_packed_attention
from vapo_async.learner.batching import collate, pack_rows
from vapo_async.learner.models import actor_logprobs, compile_blocks, critic_values
from vapo_async.transport.batch import RolloutBatch

TEMPERATURE = 0.7


def _run(actor, critic, mb, weights):
    """Outputs (masked) and gradients of sum(a * logp + b * entropy + c * values)."""
    actor.zero_grad()
    critic.zero_grad()
    logp, ent = actor_logprobs(actor, mb, TEMPERATURE)
    values = critic_values(critic, mb)
    a, b, c = weights
    mask = mb.resp_mask
    ((a * logp + b * ent + c * values) * mask).sum().backward()
    grads = [p.grad.clone() for m in (actor, critic) for p in m.parameters()]
    return [t.detach() * mask for t in (logp, ent, values)], grads


def _assert_same(eager_actor, eager_critic, actor, critic, mb, seed: int) -> None:
    """The compiled pair's outputs and gradients equal the eager pair's on ``mb`` (random weights
    seeded by ``seed``): outputs to 1e-5, gradients to 1e-4 of the reference's largest entry."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(mb.resp_mask.shape, generator=g) for _ in range(3)]
    ref_out, ref_grads = _run(eager_actor, eager_critic, mb, weights)
    out, grads = _run(actor, critic, mb, weights)
    for name, r, x in zip(("logp", "entropy", "values"), ref_out, out, strict=True):
        assert (x - r).abs().max() <= 1e-5 * r.abs().max() + 1e-6, (seed, name)
    for r, x in zip(ref_grads, grads, strict=True):
        assert (x - r).abs().max() <= 1e-4 * r.abs().max() + 1e-7, seed


def test_compiled_blocks_equal_eager_with_gradients() -> None:
    eager_actor, eager_critic = random_actor_critic(vocab=512, max_positions=256)
    actor, critic = copy.deepcopy(eager_actor), copy.deepcopy(eager_critic)
    names = [n for n, _ in actor.named_parameters()], list(critic.state_dict())
    compile_blocks(actor)
    compile_blocks(critic)
    # parameter names and state-dict keys unchanged (no "_orig_mod." prefix)
    assert [n for n, _ in actor.named_parameters()] == names[0] and list(critic.state_dict()) == names[1]
    for seed, packed in ((1, False), (2, True)):  # two micro-batch shapes and layouts
        seqs = RolloutBatch.concat(make_groups(2, 4, vocab=512, seed=seed, max_prompt=10 + seed, max_response=20 + 7 * seed))
        idx = list(range(seqs.n_responses))
        rows = None
        if packed:
            row_of = {i: r for r, row in enumerate(pack_rows(seqs.seq_lens.tolist(), 64)) for i in row}
            rows = [row_of[i] for i in idx]
        mb = collate(seqs, idx, pad_id=0, rows=rows)
        _assert_same(eager_actor, eager_critic, actor, critic, mb, seed)


def test_compiled_blocks_with_attention_by_segments_equal_eager() -> None:
    """``model.compile`` with ``batching.packed_attention=segments`` (the CPU default when packing),
    set before compiling as ``configure_model`` does: the attention loop runs outside the compiled
    graph, and a packed micro-batch gives the eager dense-mask model's outputs and gradients."""
    eager_actor, eager_critic = random_actor_critic(vocab=512, max_positions=256)
    actor, critic = copy.deepcopy(eager_actor), copy.deepcopy(eager_critic)
    set_packed_attention((actor, critic), "segments")
    compile_blocks(actor)
    compile_blocks(critic)
    for seed in (3, 4):  # two packed shapes: the compiled blocks take both (dynamic shapes)
        seqs = RolloutBatch.concat(make_groups(2, 4, vocab=512, seed=seed, max_prompt=8 + seed, max_response=16 + 5 * seed))
        idx = list(range(seqs.n_responses))
        row_of = {i: r for r, row in enumerate(pack_rows(seqs.seq_lens.tolist(), 64)) for i in row}
        mb = collate(seqs, idx, pad_id=0, rows=[row_of[i] for i in idx])
        _assert_same(eager_actor, eager_critic, actor, critic, mb, seed)
