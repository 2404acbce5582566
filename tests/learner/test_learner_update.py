"""The learner's loss on a fixed batch equals the ``algo`` functions applied by hand; value
pretraining leaves the actor bit-identical."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from learner_helpers import make_groups

from vapo_async.algo import losses as L
from vapo_async.algo.advantages import gae, length_adaptive_lambda, place_terminal_rewards
from vapo_async.algo.presets import PRESETS
from vapo_async.algo.stats import masked_whiten
from vapo_async.learner.batching import MinibatchNorms, collate, make_plan
from vapo_async.learner.models import load_actor, load_critic
from vapo_async.learner.update import (
    Prepared,
    StepCounters,
    actor_micro_loss,
    compute_advantages,
    critic_micro_loss,
    limit_critic_staleness,
    ppo_updates,
    recompute,
)
from vapo_async.transport.batch import RolloutBatch

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    torch.manual_seed(0)
    actor = load_actor(tiny_model_dir)
    critic = load_critic(tiny_model_dir)
    with torch.no_grad():  # a non-zero value head so that values and GAE are not trivial
        critic.score.weight.normal_(0.0, 0.05)
    return actor, critic


def _algo(**kw):
    base = PRESETS["vapo"]
    return dataclasses.replace(base, **kw)


def _by_hand_logp(actor, seqs: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, Tr) log-probs of the response tokens from one plain forward per sequence (no batching,
    no padding), and the (S, Tr) mask: logits at position P + t - 1 predict response token t."""
    lens = seqs.response_lens.tolist()
    tr = max(lens)
    logp = torch.zeros(seqs.n_responses, tr)
    mask = torch.zeros(seqs.n_responses, tr)
    prompts = seqs.split("prompt_ids")
    for i, k in enumerate(seqs.group_of_response.tolist()):
        p, r = len(prompts[k]), lens[i]
        ids = torch.from_numpy(np.concatenate([prompts[k], seqs.response("response_ids", i)]).astype(np.int64))
        logits = actor(input_ids=ids[None]).logits[0].float() / TEMPERATURE  # (P + L, V)
        lp = torch.log_softmax(logits[p - 1:p + r - 1], dim=-1)
        logp[i, :r] = lp.gather(-1, ids[p:, None]).squeeze(-1)
        mask[i, :r] = 1.0
    return logp, mask


@pytest.mark.parametrize("proximal", ["recompute", "behaviour"])
def test_actor_loss_equals_algo_by_hand(models, tiny_model_dir, proximal):
    """``proximal="behaviour"`` (AReaL's naive PPO) centres the clip on the generator's log-probs,
    which make_groups draws at random, far from the model's: the two cases differ."""
    actor, critic = models
    algo = _algo(nll_coef=0.1, aggregation="token", whiten_advantages=True, proximal=proximal)
    seqs = RolloutBatch.concat(make_groups(3, 4, vocab=300, seed=11))
    # micro-batches of <= 40 padded tokens: several micro-batches, so the scaling is exercised
    plan = make_plan(seqs, 1, 1, 40, torch.Generator().manual_seed(0))
    assert plan.n_micro[0] > 2
    local = seqs.select_responses(plan.rank_index[0])
    slots = {}
    for i, s in enumerate(plan.micro_id[0]):
        slots.setdefault(s, []).append(i)
    mbs = [collate(local, slots[s], pad_id=0) for s in sorted(slots)]
    prep = recompute(actor, critic, mbs, TEMPERATURE)
    compute_advantages(prep, algo)
    actor.zero_grad()
    counters = StepCounters()
    total = sum(actor_micro_loss(actor, p, plan.norms[0], algo, TEMPERATURE, counters) for p in prep)
    total.backward()
    grads = [q.grad.clone() for q in actor.parameters()]

    # by hand, on the whole batch at once in the original sequence order
    actor.zero_grad()
    logp, mask = _by_hand_logp(actor, local)
    with torch.no_grad():
        old = logp.detach()
        values = torch.zeros_like(mask)
        full = collate(local, list(range(local.n_responses)), pad_id=0)
        v_all = critic(input_ids=full.input_ids, attention_mask=full.attention_mask).logits.squeeze(-1)
        for i in range(local.n_responses):
            p, r = int(local.prompt_lens[i]), int(local.response_lens[i])
            values[i, :r] = v_all[i, p - 1:p + r - 1]
        rewards = place_terminal_rewards(torch.from_numpy(local.rewards), mask)
        lam = length_adaptive_lambda(torch.from_numpy(local.response_lens), algo.alpha)
        adv, _ = gae(rewards, values, mask, algo.gamma, lam)
        adv = masked_whiten(adv, mask)
    behav = full.logp_behav
    if proximal == "behaviour":
        old = behav
    pg, _ = L.policy_loss(logp, old, behav, adv, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                          behav_cap=algo.behav_cap, behav_mode=algo.behav_mode, aggregation=algo.aggregation)
    nll = L.positive_nll_loss(logp, mask, torch.from_numpy(local.correct))
    expected = pg + algo.nll_coef * nll
    expected.backward()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    for g, q in zip(grads, actor.parameters(), strict=True):
        torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-7)


def test_critic_loss_equals_algo_by_hand(models):
    actor, critic = models
    algo = _algo(value_clip=0.2)
    seqs = RolloutBatch.concat(make_groups(2, 4, vocab=300, seed=12))
    plan = make_plan(seqs, 1, 1, 40, torch.Generator().manual_seed(1))
    local = seqs.select_responses(plan.rank_index[0])
    slots = {}
    for i, s in enumerate(plan.micro_id[0]):
        slots.setdefault(s, []).append(i)
    mbs = [collate(local, slots[s], pad_id=0) for s in sorted(slots)]
    prep = recompute(actor, critic, mbs, TEMPERATURE)
    compute_advantages(prep, algo)
    counters = StepCounters()
    norms = plan.norms[0]
    total = sum(critic_micro_loss(critic, p, norms, algo, counters) for p in prep)
    # by hand: one padded batch, returns from GAE with lambda_critic = 1 (= the terminal reward)
    full = collate(local, list(range(local.n_responses)), pad_id=0)
    values = critic(input_ids=full.input_ids, attention_mask=full.attention_mask).logits.squeeze(-1)
    values = values.gather(1, full.resp_index) * full.resp_mask
    old = values.detach()
    rewards = place_terminal_rewards(full.rewards, full.resp_mask)
    _, ret = gae(rewards, old, full.resp_mask, 1.0, 1.0)
    # lambda = 1, gamma = 1: every token's return is the sequence reward
    torch.testing.assert_close(ret, full.rewards[:, None] * full.resp_mask)
    expected, _ = L.value_loss(values, old, ret, full.resp_mask, clip=algo.value_clip,
                               aggregation=algo.aggregation)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_limit_critic_staleness_keeps_recent_tokens() -> None:
    # learner at version 5, limit 1: tokens of versions 4 and 5 stay (5 - 4 = 1 <= 1); version 3
    # (staleness 2) and padding (mask 0) are left out
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    versions = torch.tensor([[3, 5, 4], [5, 2, 0]])
    mb = collate(RolloutBatch.concat(make_groups(1, 2, vocab=50, seed=1)), [0, 1], pad_id=0)
    prep = [Prepared(mb=dataclasses.replace(mb, resp_mask=mask, versions=versions), logp_prox=torch.zeros(2, 3),
                     values=torch.zeros(2, 3))]
    limit_critic_staleness(prep, 5, None)
    assert prep[0].value_mask is None
    limit_critic_staleness(prep, 5, 1)
    assert prep[0].value_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    limit_critic_staleness(prep, 5, 0)
    assert prep[0].value_mask.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_critic_loss_skips_stale_tokens_by_hand(models):
    """``algo.critic_max_staleness``: groups sampled at version 0 and 3, learner at version 4, limit
    1: the loss is the value loss over the version-3 tokens only, over the denominator of all tokens."""
    actor, critic = models
    algo = _algo(critic_max_staleness=1)
    groups = make_groups(2, 3, vocab=300, seed=14, version=0) + make_groups(2, 3, vocab=300, seed=15, version=3)
    seqs = RolloutBatch.concat(groups)
    full = collate(seqs, list(range(seqs.n_responses)), pad_id=0)
    prep = recompute(actor, critic, [full], TEMPERATURE)
    compute_advantages(prep, algo)
    limit_critic_staleness(prep, 4, algo.critic_max_staleness)
    norms = MinibatchNorms(tokens=float(full.resp_mask.sum()), seqs=float(seqs.n_responses), pos_tokens=1.0, pos_seqs=1.0)
    counters = StepCounters()
    total = critic_micro_loss(critic, prep[0], norms, algo, counters)
    recent = full.resp_mask * (full.versions == 3)
    assert 0 < float(recent.sum()) < float(full.resp_mask.sum())
    values = critic(input_ids=full.input_ids, attention_mask=full.attention_mask).logits.squeeze(-1)
    values = values.gather(1, full.resp_index) * full.resp_mask
    ret = full.rewards[:, None] * full.resp_mask  # lambda_critic = gamma = 1: the sequence reward
    # token aggregation: sum over kept tokens of 0.5 (V - R)^2 / all tokens
    expected = 0.5 * (((values - ret) ** 2) * recent).sum() / full.resp_mask.sum()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    fraction = counters.reduce()["critic/trained_fraction"]
    assert fraction == pytest.approx(float(recent.sum() / full.resp_mask.sum()))


def test_value_pretraining_leaves_actor_bit_identical(tiny_model_dir):
    torch.manual_seed(0)
    actor = load_actor(tiny_model_dir)
    critic = load_critic(tiny_model_dir)
    before_actor = {k: v.clone() for k, v in actor.state_dict().items()}
    before_critic = {k: v.clone() for k, v in critic.state_dict().items()}
    algo = _algo(ppo_epochs=2)
    seqs = RolloutBatch.concat(make_groups(4, 4, vocab=300, seed=13))
    plan = make_plan(seqs, 1, 2, 64, torch.Generator().manual_seed(2))
    assert len(plan.n_micro) == 2
    local = seqs.select_responses(plan.rank_index[0])
    slot_items: dict[int, list[int]] = {}
    for i, s in enumerate(plan.micro_id[0]):
        slot_items.setdefault(s, []).append(i)
    mbs = [collate(local, slot_items[s], pad_id=0) for s in range(sum(plan.n_micro))]
    prep = recompute(actor, critic, mbs, 1.0)
    compute_advantages(prep, algo)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    counters = ppo_updates(actor, critic, None, opt_c, prep, [plan.slots(m) for m in range(2)], plan.norms,
                           algo, 1.0, train_actor=False, backward=lambda loss: loss.backward(), seed=0)
    assert counters.critic_steps == 4 and counters.actor_steps == 0  # 2 epochs x 2 mini-batches
    for k, v in actor.state_dict().items():
        assert torch.equal(v, before_actor[k]), k
    assert all(p.grad is None for p in actor.parameters())
    changed = [k for k, v in critic.state_dict().items() if not torch.equal(v, before_critic[k])]
    assert "score.weight" in changed and len(changed) > 5


def test_nonfinite_gradient_skips_step(tiny_model_dir):
    from vapo_async.learner.update import optimizer_step

    critic = load_critic(tiny_model_dir)
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    for p in critic.parameters():
        p.grad = torch.ones_like(p)
    next(critic.parameters()).grad[0, 0] = float("nan")
    counters = StepCounters()
    assert not optimizer_step(list(critic.parameters()), opt, 1.0, "critic", counters)
    assert counters.skipped_nonfinite_grad == 1
    for k, v in critic.state_dict().items():
        assert torch.equal(v, before[k])
    assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())


def test_minibatch_norms_cover_positives():
    seqs = RolloutBatch.concat(make_groups(5, 4, vocab=50, seed=3))
    plan = make_plan(seqs, 2, 2, 64, torch.Generator().manual_seed(0))
    total = MinibatchNorms(0, 0, 0, 0)
    for n in plan.norms:
        total.tokens += n.tokens
        total.pos_tokens += n.pos_tokens
        total.seqs += n.seqs
    assert total.tokens == float(seqs.response_lens.sum())
    assert total.pos_tokens == float(seqs.response_lens[seqs.correct].sum())
    assert total.seqs == seqs.n_responses


def test_actor_entropy_bonus_and_kl_terms_by_hand(models):
    # The terms beyond eq. 7 / 10: loss(entropy_coef, kl_coef) - loss(0, 0) over the batch must be
    # - entropy_coef * sum_t H_t / N + kl_coef * sum_t k3_t / N (token aggregation, N valid tokens),
    # with H_t = -sum_v p_v log p_v and k3_t = e^d - d - 1, d = log pi_ref - log pi_theta, written out here.
    import copy

    actor, critic = models
    ref = copy.deepcopy(actor)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for q in ref.parameters():
            q.add_(torch.randn(q.shape, generator=gen) * 0.02)
    seqs = RolloutBatch.concat(make_groups(2, 4, vocab=300, seed=14))
    plan = make_plan(seqs, 1, 1, 40, torch.Generator().manual_seed(0))
    local = seqs.select_responses(plan.rank_index[0])
    slots: dict[int, list[int]] = {}
    for i, s in enumerate(plan.micro_id[0]):
        slots.setdefault(s, []).append(i)
    mbs = [collate(local, slots[s], pad_id=0) for s in sorted(slots)]
    prep = recompute(actor, critic, mbs, TEMPERATURE, ref=ref)
    plain, extra = _algo(nll_coef=0.0), _algo(nll_coef=0.0, entropy_coef=0.01, kl_coef=0.1)
    compute_advantages(prep, plain)
    with torch.no_grad():
        base = sum(actor_micro_loss(actor, p, plan.norms[0], plain, TEMPERATURE, StepCounters()) for p in prep)
        total = sum(actor_micro_loss(actor, p, plan.norms[0], extra, TEMPERATURE, StepCounters()) for p in prep)
        h_sum = k3_sum = 0.0
        n = 0
        ref_logp, _ = _by_hand_logp(ref, local)
        logp, mask = _by_hand_logp(actor, local)
        for i in range(local.n_responses):
            p, r = int(local.prompt_lens[i]), int(local.response_lens[i])
            ids = torch.from_numpy(np.concatenate([local.split("prompt_ids")[i],
                                                   local.response("response_ids", i)]).astype(np.int64))
            lp = torch.log_softmax(actor(input_ids=ids[None]).logits[0].float()[p - 1:p + r - 1] / TEMPERATURE, -1)
            h_sum += float(-(lp.exp() * lp).sum())
            d = ref_logp[i, :r] - logp[i, :r]
            k3_sum += float((d.exp() - d - 1.0).sum())
            n += r
    assert n == int(mask.sum()) and k3_sum > 0
    torch.testing.assert_close(float(total - base), -0.01 * h_sum / n + 0.1 * k3_sum / n, rtol=1e-4, atol=1e-6)


def test_chunked_logprobs_equal_full_logits_at_a_32k_vocabulary():
    """``actor_logprobs`` (hidden states -> log-probs and entropy in chunks of 7 tokens, no (b, Tr, V)
    tensor) against the full-logits path on the same padded micro-batch, values and gradients of
    every parameter, on a random Qwen2 with a 32,768-word vocabulary (tied output embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vapo_async.algo.stats import entropy_from_logits, gather_logprobs
    from vapo_async.learner.models import actor_logprobs

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    actor = Qwen2ForCausalLM(cfg).float()
    seqs = RolloutBatch.concat(make_groups(2, 4, vocab=300, seed=3))
    mb = collate(seqs, list(range(seqs.n_responses)), pad_id=0)
    mask = mb.resp_mask
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)

    def run(fn):
        actor.zero_grad()
        logp, ent = fn()
        ((a * logp + b * ent) * mask).sum().backward()
        return logp.detach() * mask, ent.detach() * mask, [p.grad.clone() for p in actor.parameters()]

    def full():
        logits = actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / TEMPERATURE
        picked = logits.gather(1, mb.resp_index[:, :, None].expand(-1, -1, logits.shape[-1]))  # (b, Tr, V)
        return gather_logprobs(picked, mb.response_ids), entropy_from_logits(picked)

    ref = run(full)
    got = run(lambda: actor_logprobs(actor, mb, TEMPERATURE, chunk=7))
    for name, r, x in (("logp", ref[0], got[0]), ("entropy", ref[1], got[1])):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5 * r.abs().max().item(), msg=name)
    # gradients sum over every token and all 32,768 words in another order (chunks of 7, the
    # backward written by hand): fp32 rounding alone reaches ~1e-5 of the largest entry (9.8e-6
    # measured on down_proj under load), so 3e-5 of it is the bound; a wrong term is O(1) of it
    for (pname, _), r, x in zip(actor.named_parameters(), ref[2], got[2], strict=True):
        assert (x - r).abs().max() <= 3e-5 * r.abs().max() + 1e-9, pname
