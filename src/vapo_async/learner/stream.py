"""The rollout data stream: rank 0 pulls a global batch of groups, every rank receives its share.

Once per training step, on learner rank 0:

1. pull ``batch_groups`` groups from the source (the ``Controller``); drop groups staler than eta
   versions (``async/dropped_stale``) and, with dynamic sampling (DAPO), groups whose responses are
   all right or all wrong; dropped groups go back to the controller (``mark_dropped``, which frees
   their admission slots) and more are pulled until the batch is full (at most
   ``max_sampling_rounds`` pulls; then the step trains on what it has);
2. flatten the groups into sequences, add the group advantage (GRPO/DAPO), and plan mini-batches,
   rank shares and micro-batches (``batching.make_plan``);
3. send every rank its share as plain tensors: one ``broadcast`` of a small header and one
   ``scatter`` per buffer (no pickling: ``broadcast_object_list`` would unpickle on every rank).

After the optimizer step, ``finish`` tells the source which groups were trained and that the step
is done (with the new weights' announcement, so new leases require them).

Departures (documented choices): a group's staleness is the current version minus the *oldest*
version of any of its tokens (a response sampled across a weight change counts as its oldest part);
dynamic sampling filters on correctness being all-equal (DAPO: accuracy 0 or 1), not on reward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from vapo_async.algo.advantages import score_responses
from vapo_async.learner.batching import MinibatchNorms, Plan, Sequences, make_plan
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.rollout import RolloutGroup

STATUS_OK, STATUS_EMPTY = 0, 1
HEALTH_POLL_S = 5.0
"""While waiting for rollouts, check generator health this often."""
_SEQ_INT_COLS = 6  # prompt_len, response_len, correct, truncated, group, micro slot
_SEQ_FLOAT_COLS = 2  # reward, seq_adv


class GroupSource(Protocol):
    """Where rank 0 gets groups (``vapo_async.controller.Controller`` or ``ListSource``)."""

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutGroup]: ...
    def mark_trained(self, groups: Sequence[RolloutGroup]) -> None: ...
    def mark_dropped(self, groups: Sequence[RolloutGroup]) -> None: ...
    def step_done(self, ann: WeightAnnouncement | None = None) -> None: ...


class ListSource:
    """Replays a fixed list of groups in a cycle (offline training, learner benchmarks, tests);
    with ``restamp`` every token is labelled with the current policy version, as if the current
    policy had just sampled it, otherwise the groups keep their versions."""

    def __init__(self, groups: Sequence[RolloutGroup], restamp: bool = True) -> None:
        if not groups:
            raise ValueError("ListSource needs at least one group")
        self.groups = list(groups)
        self.restamp = restamp
        self.cursor = 0
        self.version = 0
        self.trained = 0
        self.dropped = 0
        self.steps = 0

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        out = []
        for _ in range(n_groups):
            g = self.groups[self.cursor % len(self.groups)]
            self.cursor += 1
            out.append(RolloutGroup(
                lease_id=g.lease_id, prompt_index=g.prompt_index, generator_id=g.generator_id,
                prompt_ids=g.prompt_ids, response_ids=g.response_ids, logprobs=g.logprobs,
                versions=[np.full_like(np.asarray(v), self.version) for v in g.versions] if self.restamp
                else g.versions,
                rewards=g.rewards, correct=g.correct, truncated=g.truncated))
        return out

    def mark_trained(self, groups: Sequence[RolloutGroup]) -> None:
        self.trained += len(groups)

    def mark_dropped(self, groups: Sequence[RolloutGroup]) -> None:
        self.dropped += len(groups)

    def step_done(self, ann: WeightAnnouncement | None = None) -> None:
        self.steps += 1
        if ann is not None:
            self.version = ann.version


@dataclass
class StreamConfig:
    """How rank 0 assembles a global batch (filled from the algorithm and learner configs)."""

    batch_groups: int
    """Groups per training step (B/G)."""
    group_size: int
    """G responses per group."""
    eta: int
    """Staleness bound in versions; older groups are dropped."""
    n_minibatches: int
    """Mini-batches per global batch (one optimizer step each)."""
    micro_batch_tokens: int
    """Padded-token budget of one micro-batch."""
    micro_batch_overhead_tokens: int = 256
    """Price of one more micro-batch in token-equivalents (see ``batching.micro_batches``)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose responses are all right or all wrong, refill the batch."""
    max_sampling_rounds: int = 8
    """Most pulls per step when groups are dropped (then train on a partial batch)."""
    group_advantage: bool = False
    """Compute the GRPO/DAPO group advantage into ``Sequences.seq_adv``."""
    overlong: tuple[int, int] | None = None
    """DAPO soft overlong punishment (L_max, L_cache) added to the rewards, or None."""
    timeout_s: float | None = 1800.0
    """Longest wait for one pull (None = forever)."""
    seed: int = 0
    """Mini-batch shuffling seed (combined with the step number)."""


@dataclass
class LocalBatch:
    """One rank's share of a global batch."""

    seqs: Sequences
    """This rank's sequences."""
    micro_slot: torch.Tensor
    """(S_r,) int64 flat micro-batch slot of each sequence."""
    n_micro: list[int]
    """(M,) micro-batches per mini-batch (equal on every rank)."""
    norms: list[MinibatchNorms]
    """(M,) global loss denominators."""
    groups: list[RolloutGroup] = field(default_factory=list)
    """Rank 0 only: the groups trained on."""
    stats: dict[str, float] = field(default_factory=dict)
    """Rank 0 only: rollout and stream metrics of this batch."""

    @property
    def empty(self) -> bool:
        """No sequence anywhere (every pulled group was dropped)."""
        return not self.n_micro

    def slots(self, m: int) -> range:
        """Flat micro-batch slots of mini-batch m."""
        start = sum(self.n_micro[:m])
        return range(start, start + self.n_micro[m])


def _staleness(g: RolloutGroup, version: int) -> int:
    oldest = g.oldest_version()
    return version - oldest if oldest >= 0 else 0


def _all_equal(g: RolloutGroup) -> bool:
    c = np.asarray(g.correct)
    return bool(c.all() or not c.any())


class RolloutStream:
    """Global batch assembly on rank 0 and tensor distribution to all ranks."""

    def __init__(self, cfg: StreamConfig, source: GroupSource | None, rank: int, world: int,
                 device: torch.device, health: Callable[[], None] | None = None) -> None:
        if rank == 0 and source is None:
            raise ValueError("rank 0 needs a group source")
        self.cfg = cfg
        self.source = source
        self.rank = rank
        self.world = world
        self.device = device
        self._pending: list[RolloutGroup] = []
        self.health = health
        """Called while waiting for rollouts; raises when no rollouts can come (dead generators)."""

    # ---- rank 0: pulling and filtering ----

    def _pull(self, version: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        assert self.source is not None
        cfg = self.cfg
        kept: list[RolloutGroup] = []
        seen: list[RolloutGroup] = []
        n_stale = n_filtered = rounds = 0
        t0 = time.monotonic()
        while len(kept) < cfg.batch_groups and (rounds == 0 or rounds < cfg.max_sampling_rounds):
            groups = self._next_groups(cfg.batch_groups - len(kept))
            rounds += 1
            stale = [g for g in groups if _staleness(g, version) > cfg.eta]
            fresh = [g for g in groups if _staleness(g, version) <= cfg.eta]
            flat = [g for g in fresh if cfg.dynamic_sampling and _all_equal(g)]
            if stale or flat:
                self.source.mark_dropped(stale + flat)
            n_stale += len(stale)
            n_filtered += len(flat)
            seen += fresh
            kept += [g for g in fresh if not (cfg.dynamic_sampling and _all_equal(g))]
        wait = time.monotonic() - t0
        return kept, _rollout_stats(seen, version, wait, n_stale, n_filtered, rounds)

    def _next_groups(self, n: int) -> list[RolloutGroup]:
        """``source.next_batch(n)`` in slices of ``HEALTH_POLL_S``, checking ``health`` between them."""
        assert self.source is not None
        timeout = self.cfg.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.health is not None:
                self.health()
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self.source.next_batch(n, HEALTH_POLL_S if left is None else max(0.0, min(left, HEALTH_POLL_S)))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def _sequences(self, groups: list[RolloutGroup]) -> Sequences:
        seqs = Sequences.from_groups(groups)
        group_size = None
        if self.cfg.group_advantage and seqs.n:
            sizes = {g.group_size for g in groups}
            if len(sizes) != 1:
                raise ValueError(f"group advantages need equal group sizes, got {sorted(sizes)}")
            group_size = sizes.pop()
        # the sequence-level half of algo's advantages_and_returns: DAPO eq. 13 shaping
        # (R = correctness reward + R_len(|y|)) and the group advantage, over whole groups
        seqs.rewards, seqs.seq_adv = score_responses(seqs.rewards, seqs.response_lens, group_size=group_size,
                                                     overlong=self.cfg.overlong)
        return seqs

    # ---- all ranks ----

    def next(self, step: int, version: int) -> LocalBatch:
        """This rank's share of the next global batch (collective: every rank must call it)."""
        if self.rank == 0:
            groups, stats = self._pull(version)
            seqs = self._sequences(groups)
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
            plan = make_plan(seqs, self.world, self.cfg.n_minibatches, self.cfg.micro_batch_tokens, gen,
                             self.cfg.micro_batch_overhead_tokens) if seqs.n else None
            if plan is not None:
                stats["perf/padding_fraction"] = plan.padding_fraction
            stats["batch/tokens"] = float(seqs.seq_lens.sum())
            stats["batch/sequences"] = float(seqs.n)
            self._pending = groups
            local = self._send(seqs, plan)
            local.groups, local.stats = groups, stats
            return local
        return self._receive()

    def finish(self, ann: WeightAnnouncement | None) -> None:
        """Rank 0, after the step: the batch's groups were trained; admission may advance (and,
        with ``ann``, new leases require the new version). Other ranks: no-op."""
        if self.rank != 0:
            return
        assert self.source is not None
        if self._pending:
            self.source.mark_trained(self._pending)
        self._pending = []
        self.source.step_done(ann)

    # ---- tensor transport ----

    def _send(self, seqs: Sequences, plan: Plan | None) -> LocalBatch:
        if plan is None:
            if self.world > 1:
                self._bcast(torch.tensor([STATUS_EMPTY, 0], dtype=torch.int64))
            return LocalBatch(Sequences.from_groups([]), torch.zeros(0, dtype=torch.int64), [], [])
        parts = [_pack(seqs.select(idx), plan.micro_id[r]) for r, idx in enumerate(plan.rank_index)]
        if self.world > 1:
            m = len(plan.n_micro)
            self._bcast(torch.tensor([STATUS_OK, m], dtype=torch.int64))
            sizes = torch.tensor([[b.shape[0] for b in p] for p in parts], dtype=torch.int64)  # (R, 5)
            meta = torch.cat([sizes.view(-1), torch.tensor(plan.n_micro, dtype=torch.int64)])
            self._bcast(meta)
            self._bcast(_norms_tensor(plan.norms))
            mine = [self._scatter([p[k] for p in parts], sizes[:, k]) for k in range(len(parts[0]))]
        else:
            mine = parts[0]
        s, slot = _unpack(mine)
        return LocalBatch(s, slot, list(plan.n_micro), list(plan.norms))

    def _receive(self) -> LocalBatch:
        head = self._bcast(torch.zeros(2, dtype=torch.int64))
        if int(head[0]) == STATUS_EMPTY:
            return LocalBatch(Sequences.from_groups([]), torch.zeros(0, dtype=torch.int64), [], [])
        m = int(head[1])
        meta = self._bcast(torch.zeros(self.world * 5 + m, dtype=torch.int64))
        sizes = meta[: self.world * 5].view(self.world, 5)
        n_micro = meta[self.world * 5:].tolist()
        norms = _norms_list(self._bcast(torch.zeros(m * 4, dtype=torch.float64)))
        mine = [self._scatter(None, sizes[:, k], _BUF_SPECS[k]) for k in range(5)]
        s, slot = _unpack(mine)
        return LocalBatch(s, slot, n_micro, norms)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dev = t.to(self.device)
        dist.broadcast(dev, src=0)
        return dev.cpu()

    def _scatter(self, bufs: list[torch.Tensor] | None, sizes: torch.Tensor,
                 spec: tuple[torch.dtype, int] | None = None) -> torch.Tensor:
        """Scatter rank r's ``bufs[r]`` (first dim ``sizes[r]``), padded to the largest."""
        n_max = max(1, int(sizes.max()))  # gloo/nccl dislike empty buffers
        if bufs is not None:
            dtype, cols = bufs[0].dtype, (bufs[0].shape[1] if bufs[0].dim() == 2 else 0)
        else:
            assert spec is not None
            dtype, cols = spec
        shape = (n_max, cols) if cols else (n_max,)
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        scatter_list = None
        if bufs is not None:
            scatter_list = []
            for b in bufs:
                padded = torch.zeros(shape, dtype=dtype)
                padded[: b.shape[0]] = b
                scatter_list.append(padded.to(self.device))
        dist.scatter(out, scatter_list, src=0)
        return out[: int(sizes[self.rank])].cpu()


_BUF_SPECS: list[tuple[torch.dtype, int]] = [
    (torch.int64, _SEQ_INT_COLS), (torch.float32, _SEQ_FLOAT_COLS), (torch.int64, 0),
    (torch.float32, 0), (torch.int64, 0)]
"""(dtype, columns) of the five scattered buffers: per-sequence ints and floats, tokens,
behaviour log-probs, token versions."""


def _pack(s: Sequences, micro: list[int]) -> list[torch.Tensor]:
    ints = torch.stack([s.prompt_lens, s.response_lens, s.correct.long(), s.truncated.long(), s.group,
                        torch.tensor(micro, dtype=torch.int64)], dim=1) if s.n else \
        torch.zeros((0, _SEQ_INT_COLS), dtype=torch.int64)
    floats = torch.stack([s.rewards, s.seq_adv], dim=1) if s.n else torch.zeros((0, _SEQ_FLOAT_COLS))
    return [ints, floats, s.tokens, s.logp_behav, s.versions]


def _unpack(bufs: list[torch.Tensor]) -> tuple[Sequences, torch.Tensor]:
    ints, floats, tokens, logp, versions = bufs
    s = Sequences(tokens=tokens, prompt_lens=ints[:, 0].clone(), response_lens=ints[:, 1].clone(),
                  logp_behav=logp, versions=versions, rewards=floats[:, 0].clone(),
                  correct=ints[:, 2].bool(), truncated=ints[:, 3].bool(), group=ints[:, 4].clone(),
                  seq_adv=floats[:, 1].clone())
    return s, ints[:, 5].clone()


def _norms_tensor(norms: list[MinibatchNorms]) -> torch.Tensor:
    return torch.tensor([[n.tokens, n.seqs, n.pos_tokens, n.pos_seqs] for n in norms], dtype=torch.float64).view(-1)


def _norms_list(t: torch.Tensor) -> list[MinibatchNorms]:
    return [MinibatchNorms(*row.tolist()) for row in t.view(-1, 4)]


def _rollout_stats(groups: list[RolloutGroup], version: int, wait_s: float, n_stale: int,
                   n_filtered: int, rounds: int) -> dict[str, float]:
    """Rollout metrics over the fresh groups of a step (before dynamic-sampling filtering)."""
    out = {"async/dropped_stale": float(n_stale), "rollout/dropped_filtered": float(n_filtered),
           "rollout/sampling_rounds": float(rounds), "perf/wait_s": wait_s}
    if not groups:
        return out
    rewards = np.concatenate([np.asarray(g.rewards, dtype=np.float64) for g in groups])
    correct = np.concatenate([np.asarray(g.correct, dtype=np.float64) for g in groups])
    trunc = np.concatenate([np.asarray(g.truncated, dtype=np.float64) for g in groups])
    lens = np.array([n for g in groups for n in g.lengths], dtype=np.float64)
    vers = np.concatenate([np.asarray(v, dtype=np.int64) for g in groups for v in g.versions] or [np.zeros(0, np.int64)])
    stale = (version - vers).astype(np.float64)
    out.update({
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/accuracy": float(correct.mean()),
        "rollout/response_length_mean": float(lens.mean()),
        "rollout/response_length_max": float(lens.max()),
        "rollout/truncated_fraction": float(trunc.mean()),
        "rollout/groups": float(len(groups)),
        "rollout/response_tokens": float(lens.sum()),
        "async/staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "async/staleness_max": float(stale.max()) if stale.size else 0.0,
        "rollout/token_version_min": float(vers.min()) if vers.size else -1.0,
        "rollout/token_version_max": float(vers.max()) if vers.size else -1.0,
        "rollout/gen_time_s_mean": float(np.mean([g.gen_time_s for g in groups])),
    })
    return out


def token_staleness(groups: list[RolloutGroup], version: int) -> np.ndarray:
    """(sum L_i,) current version minus each response token's version (for the histogram)."""
    parts = [version - np.asarray(v, dtype=np.int64) for g in groups for v in g.versions]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
