"""Sequence packing: the row packer (hand-derived values, a brute-force optimum), the packed plan
(each sequence once, budgets, determinism, padding), the packed layout, and exactness: a packed,
chunked micro-batch gives the padded reference's log-probs, entropy, values, losses and gradients
on a random Qwen2 with a 32,768-word vocabulary."""

from __future__ import annotations

import dataclasses
import itertools
import types

import numpy as np
import pytest
import torch
from learner_helpers import make_groups, random_actor_critic
from torch import nn

from vapo_async.algo.presets import PRESETS
from vapo_async.learner.attention import set_packed_attention
from vapo_async.learner.batching import MicroBatch, collate, make_plan, pack_rows, row_starts
from vapo_async.learner.models import actor_logprobs, critic_values, model_inputs
from vapo_async.learner.stream import ListSource, RolloutStream, StreamConfig
from vapo_async.learner.update import (
    StepCounters,
    actor_micro_loss,
    compute_advantages,
    critic_micro_loss,
    recompute,
)
from vapo_async.transport.batch import GroupInfo, RolloutBatch

TEMPERATURE = 0.7


# ---- the row packer ----


def test_pack_rows_hand_example() -> None:
    # lengths 5, 3, 8, 2, 4, capacity 10; first-fit decreasing takes 8 (item 2), 5 (0), 4 (4), 3 (1), 2 (3):
    # 8 -> row0 (8); 5: row0 13 > 10 -> row1 (5); 4: row0 12 > 10, row1 9 -> row1; 3: row0 11, row1 12
    # -> row2 (3); 2: row0 10 <= 10 -> row0. Rows [[2, 3], [0, 4], [1]], loads 10, 9, 3.
    assert pack_rows([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    # an item longer than the capacity has a row of its own; nothing joins it
    assert pack_rows([12, 3, 1], 10) == [[0], [1, 2]]
    # equal lengths: lower index first
    assert pack_rows([4, 4, 4], 8) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="capacity"):
        pack_rows([1], 0)


def _optimal_rows(lens: list[int], capacity: int) -> int:
    """Fewest rows of <= capacity tokens holding every item: every assignment of items to rows."""
    n = len(lens)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for length, r in zip(lens, assign, strict=True):
                loads[r] += length
            if max(loads) <= capacity:
                return k
    return n


def test_pack_rows_within_the_first_fit_decreasing_bound_of_the_optimum() -> None:
    # FFD uses at most 11/9 OPT + 6/9 rows (Dosa 2007); every item once, every row within capacity
    rng = np.random.default_rng(0)
    for _ in range(40):
        capacity = int(rng.integers(8, 30))
        lens = rng.integers(1, capacity + 1, size=int(rng.integers(1, 7))).tolist()
        rows = pack_rows(lens, capacity)
        assert sorted(i for r in rows for i in r) == list(range(len(lens)))
        assert all(sum(lens[i] for i in r) <= capacity for r in rows)
        assert len(rows) <= 11 / 9 * _optimal_rows(lens, capacity) + 6 / 9
        assert pack_rows(lens, capacity) == rows


# ---- the packed plan ----


def _realistic(n_groups: int, group_size: int, seed: int, max_response: int = 1024) -> RolloutBatch:
    """Prompts of 40-200 tokens, responses log-normal around max_response / 4, capped (a length mix
    like the reasoning runs': many short answers, a tail of long and truncated ones)."""
    rng = np.random.default_rng(seed)
    groups = []
    for k in range(n_groups):
        p = int(rng.integers(40, 201))
        lens = np.clip(rng.lognormal(np.log(max_response / 4), 0.8, size=group_size).astype(int), 4, max_response)
        groups.append(RolloutBatch.from_group(
            GroupInfo(lease_id=k, prompt_index=k, generator_id="test"),
            prompt_ids=rng.integers(3, 1000, size=p).astype(np.int32),
            response_ids=[rng.integers(3, 1000, size=int(n)).astype(np.int32) for n in lens],
            logprobs=[np.full(int(n), -1.0, dtype=np.float32) for n in lens],
            versions=[np.zeros(int(n), dtype=np.int32) for n in lens],
            rewards=np.ones(group_size, dtype=np.float32), correct=np.ones(group_size, dtype=bool),
            truncated=lens == max_response))
    return RolloutBatch.concat(groups)


def _micro_rows(plan, r: int) -> dict[int, dict[int, list[int]]]:
    """slot -> row -> global sequence indices (in order) of rank r."""
    out: dict[int, dict[int, list[int]]] = {}
    for i, s, row in zip(plan.rank_index[r], plan.micro_id[r], plan.micro_row[r], strict=True):
        out.setdefault(s, {}).setdefault(row, []).append(i)
    return out


def _members(plan, r: int, m: int) -> list[int]:
    """Sorted global sequence indices rank r holds in mini-batch m."""
    return sorted(i for i, s in zip(plan.rank_index[r], plan.micro_id[r], strict=True) if s in plan.slots(m))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packed_plan_properties(world: int) -> None:
    seqs = _realistic(32, 8, seed=world)
    lens = seqs.seq_lens.tolist()
    budget, capacity = 8192, max(lens)
    plan = make_plan(seqs, world, 2, budget, torch.Generator().manual_seed(5), packing=True)
    padded = make_plan(seqs, world, 2, budget, torch.Generator().manual_seed(5))
    assert sorted(i for r in plan.rank_index for i in r) == list(range(seqs.n_responses)), "each sequence once"
    real = cells = 0
    for r in range(world):
        for slot, rows in _micro_rows(plan, r).items():
            loads = [sum(lens[i] for i in rows[k]) for k in range(len(rows))]  # rows 0 .. n - 1, none empty
            assert all(load <= capacity for load in loads)
            assert len(loads) == 1 or len(loads) * max(loads) <= budget, f"rank {r} slot {slot} over budget"
            real, cells = real + sum(loads), cells + len(loads) * max(loads)
    assert plan.padding_fraction == pytest.approx(1 - real / cells)
    assert plan.padding_fraction <= 0.02 < padded.padding_fraction  # padded plans: ~5% here
    # packing changes the layout only: the same mini-batches, loss normalisers and rank shares
    assert plan.norms == padded.norms
    for m in range(2):
        for r in range(world):
            assert _members(plan, r, m) == _members(padded, r, m)
    again = make_plan(seqs, world, 2, budget, torch.Generator().manual_seed(5), packing=True)
    assert (again.rank_index, again.micro_id, again.micro_row, again.n_micro) == \
        (plan.rank_index, plan.micro_id, plan.micro_row, plan.n_micro)


def test_packed_plan_row_capacity_and_padding_fraction_by_hand() -> None:
    # one group, prompt 2, responses 6, 3, 1, 2 -> sequences 8, 5, 3, 4; C = 8 (the longest).
    # FFD: 8 -> row0; 5 -> row1; 4: row0 12, row1 9 > 8 -> row2; 3: row0 11, row1 8 -> row1.
    # Rows [8], [5, 3], [4]: one micro-batch (3 rows x 8 = 24 cells <= 64) for 20 tokens: 4/24 padding
    g = RolloutBatch.from_group(
        GroupInfo(lease_id=0, prompt_index=0, generator_id="t"), prompt_ids=np.array([5, 6], dtype=np.int32),
        response_ids=[np.arange(n, dtype=np.int32) + 3 for n in (6, 3, 1, 2)],
        logprobs=[np.zeros(n, dtype=np.float32) for n in (6, 3, 1, 2)],
        versions=[np.zeros(n, dtype=np.int32) for n in (6, 3, 1, 2)],
        rewards=np.zeros(4, dtype=np.float32), correct=np.zeros(4, dtype=bool), truncated=np.zeros(4, dtype=bool))
    plan = make_plan(g, 1, 1, 64, torch.Generator().manual_seed(0), packing=True)
    assert _micro_rows(plan, 0) == {0: {0: [0], 1: [1, 2], 2: [3]}}
    assert plan.padding_fraction == pytest.approx(4 / 24)
    # (the spread over 3 rows by balanced_partition, 8 | 5 | 4 + 3, is no shorter than 8: kept)
    # capacity 10: 8 -> row0; 5 -> row1; 4: row0 12 -> row1 (9); 3: row0 11, row1 12 -> row2. Rows in
    # the micro-batch longest first: [5, 4] (9), [8], [3] -> 3 x 9 = 27 cells. Spread over 3 rows
    # (8 -> r0, 5 -> r1, 4 -> r2, 3 -> r2, the lightest): [8], [5], [4, 3], longest 8 < 9: taken,
    # 3 x 8 = 24 cells for 20 tokens
    plan = make_plan(g, 1, 1, 64, torch.Generator().manual_seed(0), packing=True, row_tokens=10)
    assert _micro_rows(plan, 0) == {0: {0: [0], 1: [1], 2: [3, 2]}}
    assert plan.padding_fraction == pytest.approx(4 / 24)


def test_stream_carries_the_rows_and_reports_packed_padding() -> None:
    groups = make_groups(6, 4, vocab=50, seed=2, max_response=30)
    cfg = StreamConfig(batch_groups=6, group_size=4, eta=2, n_minibatches=2, micro_batch_tokens=96, packing=True)
    local = RolloutStream(cfg, ListSource(groups), rank=0, world=1, device=torch.device("cpu")).next(step=0, version=0)
    real = cells = n_rows = 0
    rows = local.micro_row.tolist()
    for slot in range(sum(local.n_micro)):
        idx = [i for i, s in enumerate(local.micro_slot.tolist()) if s == slot]
        mb = collate(local.seqs, idx, 0, [rows[i] for i in idx])
        real, cells, n_rows = real + int(mb.attention_mask.sum()), cells + mb.input_ids.numel(), n_rows + len(mb.input_ids)
    assert real == int(local.seqs.seq_lens.sum()) and n_rows < local.seqs.n_responses  # rows hold several sequences
    assert local.stats["perf/padding_fraction"] == pytest.approx(1 - real / cells)


# ---- the packed layout ----


def test_packed_collate_layout_by_hand() -> None:
    groups = make_groups(3, 2, vocab=30, seed=7)
    seqs = RolloutBatch.concat(groups)
    idx, rows = [0, 3, 5, 2], [1, 0, 1, 0]  # row 0: sequences 3 then 2; row 1: 0 then 5
    mb = collate(seqs, idx, pad_id=0, rows=rows)
    lens = [int(seqs.seq_lens[i]) for i in idx]
    starts, loads = row_starts(lens, rows)
    assert starts == [0, 0, lens[0], lens[1]] and loads == [lens[1] + lens[3], lens[0] + lens[2]]
    assert mb.input_ids.shape == (2, max(loads)) and mb.resp_row.tolist() == rows
    for k, i in enumerate(idx):
        g, j = groups[i // 2], i % 2
        prompt, resp = g.prompt_ids.tolist(), g.response("response_ids", j).tolist()
        r, s, P, L = rows[k], starts[k], len(prompt), len(resp)
        assert mb.input_ids[r, s:s + P + L].tolist() == prompt + resp
        assert mb.position_ids[r, s:s + P + L].tolist() == list(range(P + L)), "positions restart per sequence"
        assert mb.response_ids[k, :L].tolist() == resp and mb.resp_mask[k].sum() == L
        for t in range(L):  # column resp_index predicts the next token: input_ids[col + 1] = response token t
            col = int(mb.resp_index[k, t])
            assert col == s + P - 1 + t and int(mb.input_ids[r, col + 1]) == resp[t]
        assert s <= int(mb.resp_index[k].min()) and int(mb.resp_index[k].max()) <= s + P + L - 2  # padding stays inside
    for r, load in enumerate(loads):  # the tail: pad tokens, positions 0, 1, ... (a sequence of its own)
        tail = mb.input_ids.shape[1] - load
        assert mb.attention_mask[r].tolist() == [1] * load + [0] * tail
        assert mb.position_ids[r, load:].tolist() == list(range(tail))
    with pytest.raises(ValueError, match="empty"):
        collate(seqs, [0, 1], pad_id=0, rows=[0, 2])


def test_packed_inputs_refuse_an_attention_without_packed_support() -> None:
    seqs = RolloutBatch.concat(make_groups(1, 2, vocab=30, seed=1))
    mb = collate(seqs, [0, 1], pad_id=0, rows=[0, 0])
    model = nn.Module()
    model.config = types.SimpleNamespace(_attn_implementation="paged|sdpa")
    with pytest.raises(ValueError, match="batching.packing=false"):
        model_inputs(model, mb)
    model.config._attn_implementation = "sdpa"
    assert set(model_inputs(model, mb)) == {"input_ids", "position_ids", "use_cache"}


# ---- exactness: packed == padded on a 32k vocabulary ----


@pytest.fixture(scope="module")
def models_32k():
    """A random 2-layer Qwen2 with a 32,768-word vocabulary (tied output embedding) and a critic of
    the same shape with a random one-label value head."""
    return random_actor_critic(vocab=32768)


def _seqs_32k(seed: int) -> RolloutBatch:
    return RolloutBatch.concat(make_groups(4, 4, vocab=32768, seed=seed, max_prompt=12, max_response=40))


def _close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """fp32 agreement relative to the reference's scale: max |got - ref| <= 1e-5 max |ref|."""
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-12, name


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["mask", "segments"])
def test_packed_micro_batch_equals_padded_with_gradients(models_32k, attention: str) -> None:
    """One micro-batch of 16 responses: padded (16 rows, SDPA) vs packed (rows of <= 64 tokens,
    several sequences each; transformers' block-diagonal mask or SDPA per sequence); log-probs and
    entropy in chunks of 7 tokens, values; gradients of a random linear function of them for every
    actor and critic parameter."""
    actor, critic = models_32k
    seqs = _seqs_32k(seed=3)
    lens = seqs.seq_lens.tolist()
    idx = list(range(seqs.n_responses))
    row_of = {i: r for r, row in enumerate(pack_rows(lens, 64)) for i in row}
    padded = collate(seqs, idx, pad_id=0)
    packed = collate(seqs, idx, pad_id=0, rows=[row_of[i] for i in idx])
    assert packed.input_ids.shape[0] < len(idx) // 2 and packed.packed and not padded.packed
    mask = padded.resp_mask
    assert torch.equal(packed.resp_mask, mask) and torch.equal(packed.response_ids, padded.response_ids)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(mask.shape, generator=g) for _ in range(3))

    def run(mb: MicroBatch):
        actor.zero_grad()
        critic.zero_grad()
        logp, ent = actor_logprobs(actor, mb, TEMPERATURE, chunk=7)
        values = critic_values(critic, mb)
        ((a * logp + b * ent + c * values) * mask).sum().backward()
        return [t.detach() * mask for t in (logp, ent, values)], _grads(actor), _grads(critic)

    ref = run(padded)
    set_packed_attention((actor, critic), attention)
    try:
        got = run(packed)
    finally:
        for m in (actor, critic):
            m.set_attn_implementation("sdpa")
    for name, r, x in zip(("logp", "entropy", "values"), ref[0], got[0], strict=True):
        _close(x, r, name)
    for model, k in ((actor, 1), (critic, 2)):
        for (pname, _), r, x in zip(model.named_parameters(), ref[k], got[k], strict=True):
            _close(x, r, f"{type(model).__name__}.{pname}.grad")


def _plan_micro_batches(seqs: RolloutBatch, packing: bool):
    plan = make_plan(seqs, 1, 1, 160, torch.Generator().manual_seed(4), packing=packing, row_tokens=64 if packing else 0)
    local = seqs.select_responses(plan.rank_index[0])
    slots: dict[int, list[int]] = {}
    for i, s in enumerate(plan.micro_id[0]):
        slots.setdefault(s, []).append(i)
    rows = plan.micro_row[0]
    mbs = [collate(local, slots[s], 0, [rows[i] for i in slots[s]] if packing else None) for s in sorted(slots)]
    return plan, mbs


def test_packed_plan_losses_and_gradients_equal_padded(models_32k) -> None:
    """The whole learner maths on one batch (recompute, GAE with whitening, the actor loss with NLL
    and entropy terms, the clipped value loss), planned padded and packed (same mini-batch, other
    micro-batches and rows): equal losses and gradients."""
    actor, critic = models_32k
    algo = dataclasses.replace(PRESETS["vapo"], nll_coef=0.1, entropy_coef=0.01, value_clip=0.2,
                               whiten_advantages=True)
    seqs = _seqs_32k(seed=5)
    out = {}
    for packing in (False, True):
        plan, mbs = _plan_micro_batches(seqs, packing)
        assert len(mbs) > 1 and (not packing or any(mb.input_ids.shape[0] < mb.size for mb in mbs))
        prep = recompute(actor, critic, mbs, TEMPERATURE)
        compute_advantages(prep, algo)
        actor.zero_grad()
        critic.zero_grad()
        a_loss = sum(actor_micro_loss(actor, p, plan.norms[0], algo, TEMPERATURE, StepCounters()) for p in prep)
        c_loss = sum(critic_micro_loss(critic, p, plan.norms[0], algo, StepCounters()) for p in prep)
        (a_loss + c_loss).backward()
        out[packing] = (a_loss.detach(), c_loss.detach(), _grads(actor), _grads(critic))
    ref, got = out[False], out[True]
    _close(got[0], ref[0], "actor loss")
    _close(got[1], ref[1], "critic loss")
    for model, k in ((actor, 2), (critic, 3)):
        for (pname, _), r, x in zip(model.named_parameters(), ref[k], got[k], strict=True):
            _close(x, r, f"{type(model).__name__}.{pname}.grad")
