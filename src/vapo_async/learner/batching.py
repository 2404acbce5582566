"""A ``RolloutBatch`` -> a per-rank plan of micro-batches (padded or packed rows) -> tensors.

Notation (``vapo_async.algo``): S sequences (= responses) in a global batch, G responses per
group, P_i prompt length and L_i response length of sequence i, b sequences and n rows of a
micro-batch (n = b when padded), T row length of a micro-batch (its longest row), Tr padded
response length, M mini-batches per global batch, C packed row capacity.

The pipeline on learner rank 0, once per training step (every response i of the batch is one
sequence ``prompt_ids of its group + response_ids``):

1. ``make_plan``: sequences are shuffled (seeded by step) into M global mini-batches, each
   mini-batch is split across the R data-parallel ranks balanced by token count (longest
   processing time first), and each rank's share becomes rows: one sequence per row (padded), or
   whole sequences back to back up to C tokens (packed, ``pack_rows``: first-fit decreasing). The
   rows are cut into length-sorted micro-batches under a token budget (rows x longest row,
   ``micro_batches``); a packed micro-batch's sequences are then spread evenly over its rows.
   Every rank runs the same number of micro-batches per mini-batch (empty ones are padding),
   because FSDP2 all-gathers in every forward and all ranks must take part.
2. ``collate``: one micro-batch -> (n, T) tensors (right-padded rows; packed rows also carry
   ``position_ids`` restarting at 0 per sequence, from which transformers builds attention that
   never crosses sequences), plus ``resp_row``/``resp_index``/``resp_mask`` that gather the
   response-aligned (b, Tr) view the ``algo`` functions expect from the (n, T) outputs: one row
   per response either way, so nothing after the forward pass knows about packing.

Cost of packing: transformers' SDPA path applies the block-diagonal mask densely, so a row of C
tokens pays C^2 in attention however its sequences split it; C therefore defaults to the batch's
longest sequence, and on CPU a packed step was no faster than a padded one (the padded plan's
length sorting already keeps padding near 5%). Varlen flash attention (GPU) and SDPA per sequence
(``learner/attention.py``, ``batching.packed_attention=segments``, the CPU default) pay
sum_i len_i^2 whatever C is: there C can be the whole micro-batch budget (one row, no padding).

The global mini-batches do not depend on the number of ranks, so a step on R ranks computes the same
gradients as on one device (the loss normalisers are global token/sequence counts, see
``MinibatchNorms``).

Departures: none from the papers (they do not describe batching). Packing changes only the layout:
a packed micro-batch gives the padded one's log-probs, values, losses and gradients to float
rounding (tests/learner/test_learner_packing.py).
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


def pack_rows(lens: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: items, longest first (ties: lower index first), each into the first
    row (in opening order) whose load + its length <= ``capacity``, else a new row. An item longer
    than ``capacity`` gets a row of its own. Returns item indices per row, in placement order.
    Deterministic; O(items x rows)."""
    if capacity < 1:
        raise ValueError(f"pack_rows: capacity must be >= 1, got {capacity}")
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        for r, load in enumerate(loads):
            if load + lens[i] <= capacity:
                rows[r].append(i)
                loads[r] += lens[i]
                break
        else:
            rows.append([i])
            loads.append(lens[i])
    return rows


def share_micro_batches(items: Sequence[int], lens: Sequence[int], max_tokens: int, overhead_tokens: float,
                        capacity: int | None) -> list[list[list[int]]]:
    """One rank's share ``items`` (indices into ``lens``) -> micro-batches, each a list of rows,
    each a list of items: one item per row when ``capacity`` is None (right padding), else rows
    packed up to ``capacity`` tokens (``pack_rows``), cut by ``micro_batches`` (rows x longest row
    <= ``max_tokens``), then each micro-batch's items spread evenly over its rows (``rebalance``)."""
    if capacity is None:
        rows = [[i] for i in items]
    else:
        rows = [[items[j] for j in row] for row in pack_rows([lens[i] for i in items], capacity)]
    loads = [sum(lens[i] for i in row) for row in rows]
    micros = [[rows[k] for k in micro] for micro in micro_batches(loads, max_tokens, overhead_tokens)]
    return micros if capacity is None else [rebalance(m, lens) for m in micros]


def rebalance(rows: list[list[int]], lens: Sequence[int]) -> list[list[int]]:
    """The same items in as many rows, spread by ``balanced_partition`` when that shortens the
    longest row (first-fit fills rows to the capacity and leaves the last ones short; a micro-batch
    is as wide as its longest row). Never longer than ``rows``' longest row, so within its budget."""
    flat = [i for row in rows for i in row]
    parts = [[flat[j] for j in part] for part in balanced_partition([lens[i] for i in flat], len(rows))]
    longest = max(sum(lens[i] for i in row) for row in rows)
    return parts if max(sum(lens[i] for i in part) for part in parts) < longest else rows


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
    micro_row: list[list[int]]
    """Per rank, aligned with ``rank_index``: row of each sequence within its micro-batch (its
    sequences in ``rank_index`` order fill the row back to back; one sequence per row when padded)."""

    def slots(self, m: int) -> range:
        """Flat micro-batch slots of mini-batch m."""
        start = sum(self.n_micro[:m])
        return range(start, start + self.n_micro[m])


def make_plan(batch: RolloutBatch, world: int, n_minibatches: int, micro_batch_tokens: int,
              generator: torch.Generator, overhead_tokens: float = 256, packing: bool = False,
              row_tokens: int = 0) -> Plan:
    """Plan a global batch: M shuffled mini-batches (independent of ``world``), each balanced by
    token count over ``world`` ranks and cut into micro-batches of <= ``micro_batch_tokens``
    padded tokens (``share_micro_batches`` with ``overhead_tokens``). With fewer sequences than M,
    M = S. ``packing``: rows of whole sequences up to C = ``row_tokens`` tokens (0: the batch's
    longest sequence; a longer sequence has a row of its own, and no row is longer than it)
    instead of one right-padded sequence per row."""
    n = batch.n_responses
    m_count = max(1, min(n_minibatches, n))
    perm = torch.randperm(n, generator=generator).tolist()
    minibatches = [perm[k::m_count] for k in range(m_count)]
    lens = batch.seq_lens.tolist()
    capacity = (row_tokens or max(lens, default=1)) if packing else None
    rank_index: list[list[int]] = [[] for _ in range(world)]
    micro_id: list[list[int]] = [[] for _ in range(world)]
    micro_row: list[list[int]] = [[] for _ in range(world)]
    n_micro: list[int] = []
    real = padded = 0
    for mb in minibatches:
        shares = balanced_partition([lens[i] for i in mb], world)
        per_rank = [share_micro_batches([mb[j] for j in share], lens, micro_batch_tokens, overhead_tokens, capacity)
                    for share in shares]
        slot0 = sum(n_micro)
        for r, micros in enumerate(per_rank):
            for j, rows in enumerate(micros):
                for k, row in enumerate(rows):
                    rank_index[r] += row
                    micro_id[r] += [slot0 + j] * len(row)
                    micro_row[r] += [k] * len(row)
                loads = [sum(lens[i] for i in row) for row in rows]
                real += sum(loads)
                padded += len(rows) * max(loads)
        n_micro.append(max(1, max(len(p) for p in per_rank)))
    pad_frac = 1.0 - real / padded if padded else 0.0
    norms = [_norms(batch, mb) for mb in minibatches]
    return Plan(rank_index, micro_id, n_micro, norms, pad_frac, micro_row)


def _norms(batch: RolloutBatch, mb: Sequence[int]) -> MinibatchNorms:
    """Global loss denominators of the mini-batch holding sequences ``mb``."""
    rlens = batch.response_lens[list(mb)].astype(np.float64)
    correct = batch.correct[list(mb)].astype(bool)
    return MinibatchNorms(tokens=float(rlens.sum()), seqs=float(len(mb)),
                          pos_tokens=float(rlens[correct].sum()), pos_seqs=float(correct.sum()))


# ---- collation ----


@dataclass
class MicroBatch:
    """b sequences of one micro-batch in n rows of T tokens: one right-padded sequence per row
    (n = b), or packed rows holding whole sequences back to back (b = 0 for a padding micro-batch)."""

    input_ids: torch.Tensor
    """(n, T) int64 prompt + response tokens of each sequence, back to back in its row, each row
    right-padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """(n, T) int64 1 on real tokens (the model gets it only in the padded layout)."""
    position_ids: torch.Tensor | None
    """(n, T) int64 packed layout: position of each token within its own sequence (0 at every
    sequence start; a row's tail padding counts from 0 as a sequence of its own), which is how
    transformers recognises packed rows. None: the padded layout (positions 0 .. T - 1 per row)."""
    resp_row: torch.Tensor
    """(b,) int64 row of sequence i in the (n, T) inputs (i itself when padded)."""
    resp_index: torch.Tensor
    """(b, Tr) int64: column of row ``resp_row[i]`` whose next-token output predicts response token
    t (start_i + P_i - 1 + t, start_i = the sequence's first column), clamped into the sequence on
    padding."""
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
        return int(self.response_lens.shape[0])

    @property
    def packed(self) -> bool:
        """True for the packed layout (rows of several sequences, ``position_ids`` set)."""
        return self.position_ids is not None

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy on ``device``."""
        return MicroBatch(**{k: None if v is None else v.to(device, non_blocking=True) for k, v in vars(self).items()})


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """(sum counts,) int64: 0 .. c - 1 for every c of ``counts`` (c,), concatenated."""
    counts = counts.astype(np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def row_starts(lens: Sequence[int], rows: Sequence[int]) -> tuple[list[int], list[int]]:
    """First column of each sequence (its row's earlier sequences, in order, come before it) and
    the load (tokens) of each row 0 .. n - 1. Raises unless every row holds a sequence."""
    if len(rows) != len(lens):
        raise ValueError(f"collate: {len(rows)} row numbers for {len(lens)} sequences")
    n = max(rows, default=-1) + 1
    loads = [0] * n
    starts = []
    for length, r in zip(lens, rows, strict=True):
        if r < 0:
            raise ValueError(f"collate: negative row number {r}")
        starts.append(loads[r])
        loads[r] += length
    if 0 in loads:
        raise ValueError(f"collate: rows {[r for r in range(n) if loads[r] == 0]} are empty")
    return starts, loads


def collate(batch: RolloutBatch, idx: Sequence[int], pad_id: int, rows: Sequence[int] | None = None) -> MicroBatch:
    """Responses ``idx`` of ``batch``, each after its group's prompt, as one micro-batch: one
    right-padded sequence per row (``rows`` None), or packed: sequence k in row ``rows[k]``, after
    the row's earlier sequences (in ``idx`` order); rows are right-padded to the longest."""
    part = batch.select_responses(list(idx))  # every response a group of one: (b,) prompt lengths
    b = part.n_responses
    plens, rlens = part.prompt_lens.astype(np.int64), part.response_lens.astype(np.int64)
    lens = plens + rlens
    row = np.arange(b, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    start_l, load_l = row_starts(lens.tolist(), row.tolist())
    start, loads = np.asarray(start_l, dtype=np.int64), np.asarray(load_l, dtype=np.int64)
    n, t_max = len(load_l), max(load_l, default=1)
    # flat destinations in the (n, T) inputs: prompt token k of sequence i at (row_i, start_i + k),
    # response token t at (row_i, start_i + P_i + t)
    p_dest = torch.from_numpy(np.repeat(row * t_max + start, plens) + _ranges(plens))
    r_dest = torch.from_numpy(np.repeat(row * t_max + start + plens, rlens) + _ranges(rlens))
    input_ids = torch.full((n * t_max,), pad_id, dtype=torch.int64)
    input_ids[p_dest] = _tensor(part.prompt_ids, torch.int64)
    input_ids[r_dest] = _tensor(part.response_ids, torch.int64)
    attn = torch.zeros(n * t_max, dtype=torch.int64)
    attn[p_dest] = 1
    attn[r_dest] = 1
    position_ids = None
    if rows is not None:
        cols = torch.arange(t_max)[None, :]
        tail = torch.from_numpy(loads)[:, None]
        position_ids = torch.where(cols >= tail, cols - tail, 0).view(-1)  # the tail: its own sequence
        position_ids[p_dest] = torch.from_numpy(_ranges(plens))
        position_ids[r_dest] = torch.from_numpy(np.repeat(plens, rlens) + _ranges(rlens))
        position_ids = position_ids.view(n, t_max)
    tr_max = max(1, int(rlens.max())) if b else 1
    rcols = torch.arange(tr_max)[None, :]
    rvalid = rcols < torch.from_numpy(rlens)[:, None]  # (b, Tr)
    # response token t is predicted by column start_i + P_i - 1 + t; padding stays in the sequence
    last = torch.from_numpy(np.maximum(lens - 2, 0))[:, None]
    resp_index = torch.from_numpy(start)[:, None] + (torch.from_numpy(plens)[:, None] - 1 + rcols).clamp(min=0).minimum(last)
    resp_ids = torch.zeros((b, tr_max), dtype=torch.int64)
    logp = torch.zeros((b, tr_max), dtype=torch.float32)
    vers = torch.zeros((b, tr_max), dtype=torch.int64)
    resp_ids[rvalid] = _tensor(part.response_ids, torch.int64)
    logp[rvalid] = _tensor(part.logprobs, torch.float32)
    vers[rvalid] = _tensor(part.versions, torch.int64)
    return MicroBatch(input_ids=input_ids.view(n, t_max), attention_mask=attn.view(n, t_max), position_ids=position_ids,
                      resp_row=torch.from_numpy(row), resp_index=resp_index, resp_mask=rvalid.to(torch.float32),
                      response_ids=resp_ids, logp_behav=logp, versions=vers, response_lens=torch.from_numpy(rlens),
                      rewards=_tensor(part.rewards, torch.float32), correct=_tensor(part.correct, torch.bool),
                      seq_adv=_tensor(part.seq_adv, torch.float32))


def padding_micro_batch(pad_id: int) -> MicroBatch:
    """A one-token micro-batch with an empty mask: keeps FSDP collectives aligned on a rank that
    has no data for a slot (its loss is multiplied by 0)."""
    z = torch.zeros((1, 1), dtype=torch.int64)
    return MicroBatch(input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
                      attention_mask=torch.ones((1, 2), dtype=torch.int64), position_ids=None,
                      resp_row=torch.zeros(1, dtype=torch.int64), resp_index=z.clone(),
                      resp_mask=torch.zeros((1, 1)), response_ids=z.clone(), logp_behav=torch.zeros((1, 1)),
                      versions=z.clone(), response_lens=torch.zeros(1, dtype=torch.int64),
                      rewards=torch.zeros(1), correct=torch.zeros(1, dtype=torch.bool), seq_adv=torch.zeros(1))
