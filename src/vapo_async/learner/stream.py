"""The rollout data stream: rank 0 pulls a global batch of groups, every rank receives its share.

Once per training step, on learner rank 0:

1. pull ``batch_groups`` groups from the source (the ``Controller``); drop groups staler than eta
   versions (``async/dropped_stale``) and, with dynamic sampling (DAPO), groups whose responses are
   all right or all wrong; dropped groups go back to the controller (``mark_dropped``, which frees
   their admission slots) and more are pulled until the batch is full (at most
   ``max_sampling_rounds`` pulls; then the step trains on what it has);
2. concatenate the groups into one ``RolloutBatch``, add the DAPO length shaping and the group
   advantage (GRPO/DAPO), and plan mini-batches, rank shares and micro-batches
   (``batching.make_plan``);
3. send every rank its share (``RolloutBatch.select_responses``) as plain tensors: a ``broadcast``
   of a small header and a ``scatter`` per array of ``RolloutBatch.flat`` and the micro-batch slots
   (no pickling: ``broadcast_object_list`` would unpickle on every rank).

After the optimizer step, ``finish`` tells the source which groups were trained and that the step
is done (with the new weights' announcement, so new leases require them). A stop (SIGTERM,
learner/stopping.py) is a third header status: every rank raises ``StopRequested`` at that batch.

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
from vapo_async.learner.batching import MinibatchNorms, Plan, make_plan
from vapo_async.learner.reports import StepReports
from vapo_async.learner.rollout_stats import rollout_stats
from vapo_async.transport.batch import RolloutBatch
from vapo_async.transport.messages import WeightAnnouncement

STATUS_OK, STATUS_EMPTY, STATUS_STOP = 0, 1, 2
HEALTH_POLL_S = 1.0  # longest wait for rollouts between two checks of ``health`` and ``stop``


class StopRequested(Exception):
    """A stop (SIGTERM) before this batch, raised on every rank; groups already taken are untrained
    and a resume re-issues them (``ControllerState.load_state_dict``)."""
"""While waiting for rollouts, check generator health this often."""


def _flat_dtypes() -> list[str]:
    """dtype of every scattered array: ``RolloutBatch.flat``, then the micro-batch slot and the row
    within the micro-batch of each response."""
    return [*RolloutBatch.flat_dtypes(), "<i8", "<i8"]


class GroupSource(Protocol):
    """Where rank 0 gets groups (``vapo_async.controller.Controller`` or ``ListSource``)."""

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutBatch]: ...
    def mark_trained(self, groups: Sequence[RolloutBatch]) -> None: ...
    def mark_dropped(self, groups: Sequence[RolloutBatch]) -> None: ...
    def step_done(self, ann: WeightAnnouncement | None = None, trained: int | None = None) -> None: ...
    def announce(self, ann: WeightAnnouncement) -> None: ...


class ListSource:
    """Replays a fixed list of groups in a cycle (offline training, learner benchmarks, tests);
    with ``restamp`` every token is labelled with the current policy version, as if the current
    policy had just sampled it, otherwise the groups keep their versions."""

    def __init__(self, groups: Sequence[RolloutBatch], restamp: bool = True) -> None:
        if not groups:
            raise ValueError("ListSource needs at least one group")
        self.groups = list(groups)
        self.restamp = restamp
        self.cursor = 0
        self.version = 0
        self.trained = 0
        self.dropped = 0
        self.steps = 0

    def next_batch(self, n_groups: int, timeout_s: float | None = None) -> list[RolloutBatch]:
        out = []
        for _ in range(n_groups):
            g = self.groups[self.cursor % len(self.groups)]
            self.cursor += 1
            out.append(g.replace(versions=np.full_like(g.versions, self.version)) if self.restamp else g)
        return out

    def mark_trained(self, groups: Sequence[RolloutBatch]) -> None:
        self.trained += len(groups)

    def mark_dropped(self, groups: Sequence[RolloutBatch]) -> None:
        self.dropped += len(groups)

    def step_done(self, ann: WeightAnnouncement | None = None, trained: int | None = None) -> None:
        self.steps += 1
        if ann is not None:
            self.announce(ann)

    def announce(self, ann: WeightAnnouncement) -> None:
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
    packing: bool = False
    """Plan packed rows of whole sequences instead of one padded sequence per row."""
    pack_row_tokens: int = 0
    """Packed row capacity (0: the batch's longest sequence; see ``batching.make_plan``)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose responses are all right or all wrong, refill the batch."""
    max_sampling_rounds: int = 8
    """Most pulls per step when groups are dropped (then train on a partial batch)."""
    group_advantage: bool = False
    """Compute the GRPO/DAPO group advantage into the batch's ``seq_adv``."""
    overlong: tuple[int, int] | None = None
    """DAPO soft overlong punishment (L_max, L_cache) added to the rewards, or None."""
    timeout_s: float | None = 1800.0
    """Longest wait for one pull (None = forever)."""
    seed: int = 0
    """Mini-batch shuffling seed (combined with the step number)."""


@dataclass
class LocalBatch:
    """One rank's share of a global batch."""

    seqs: RolloutBatch
    """This rank's responses (each a group of one with its prompt; ``info`` empty)."""
    micro_slot: torch.Tensor
    """(S_r,) int64 flat micro-batch slot of each sequence."""
    micro_row: torch.Tensor
    """(S_r,) int64 row of each sequence within its micro-batch (``batching.Plan.micro_row``)."""
    n_micro: list[int]
    """(M,) micro-batches per mini-batch (equal on every rank)."""
    norms: list[MinibatchNorms]
    """(M,) global loss denominators."""
    groups: list[RolloutBatch] = field(default_factory=list)
    """Rank 0 only: the groups trained on (as received, one prompt each)."""
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


def _staleness(g: RolloutBatch, version: int) -> int:
    oldest = g.oldest_version()
    return version - oldest if oldest >= 0 else 0


def _all_equal(g: RolloutBatch) -> bool:
    c = np.asarray(g.correct)
    return bool(c.all() or not c.any())


class RolloutStream:
    """Global batch assembly on rank 0 and tensor distribution to all ranks."""

    def __init__(self, cfg: StreamConfig, source: GroupSource | None, rank: int, world: int,
                 device: torch.device, health: Callable[[], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> None:
        if rank == 0 and source is None:
            raise ValueError("rank 0 needs a group source")
        self.cfg = cfg
        self.source = source
        self.rank = rank
        self.world = world
        self.device = device
        self._pending: list[RolloutBatch] = []
        self.reports: StepReports | None = None
        """Rank 0: step reports waiting for their version's announcement (made on first use)."""
        self.health = health
        """Called while waiting for rollouts; raises when no rollouts can come (dead generators)."""
        self.stop = stop
        """Rank 0: True once the run should stop (checked before and while waiting for rollouts)."""

    # ---- rank 0: pulling and filtering ----

    def _pull(self, version: int) -> tuple[list[RolloutBatch], dict[str, float]]:
        assert self.source is not None
        cfg = self.cfg
        kept: list[RolloutBatch] = []
        seen: list[RolloutBatch] = []
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
        return kept, rollout_stats(seen, version, wait, n_stale, n_filtered, rounds)

    def _next_groups(self, n: int) -> list[RolloutBatch]:
        """``source.next_batch(n)`` in slices of ``HEALTH_POLL_S``, checking ``stop`` and ``health``
        between them."""
        assert self.source is not None
        timeout = self.cfg.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_stop()
            if self.health is not None:
                self.health()
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self.source.next_batch(n, HEALTH_POLL_S if left is None else max(0.0, min(left, HEALTH_POLL_S)))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def _score(self, groups: list[RolloutBatch]) -> RolloutBatch:
        batch = RolloutBatch.concat(groups)
        group_size = None
        if self.cfg.group_advantage and batch.n_responses:
            sizes = set(batch.group_sizes.tolist())
            if len(sizes) != 1:
                raise ValueError(f"group advantages need equal group sizes, got {sorted(sizes)}")
            group_size = sizes.pop()
        # the sequence-level half of algo's advantages_and_returns: DAPO eq. 13 shaping
        # (R = correctness reward + R_len(|y|)) and the group advantage, over whole groups
        rewards, seq_adv = score_responses(torch.from_numpy(batch.rewards.copy()), torch.from_numpy(batch.response_lens),
                                           group_size=group_size, overlong=self.cfg.overlong)
        return batch.replace(rewards=rewards.numpy(), seq_adv=seq_adv.numpy())

    # ---- all ranks ----

    def next(self, step: int, version: int) -> LocalBatch:
        """This rank's share of the next global batch (collective: every rank must call it)."""
        if self.rank == 0:
            try:
                self._check_stop()
                groups, stats = self._pull(version)
            except StopRequested:
                if self.world > 1:  # the other ranks wait in _receive: they raise it too
                    self._bcast(torch.tensor([STATUS_STOP, 0], dtype=torch.int64))
                raise
            batch = self._score(groups)
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
            plan = make_plan(batch, self.world, self.cfg.n_minibatches, self.cfg.micro_batch_tokens, gen,
                             self.cfg.micro_batch_overhead_tokens, self.cfg.packing,
                             self.cfg.pack_row_tokens) if batch.n_responses else None
            if plan is not None:
                stats["perf/padding_fraction"] = plan.padding_fraction
            stats["batch/tokens"] = float(batch.seq_lens.sum())
            stats["batch/sequences"] = float(batch.n_responses)
            self._pending = groups
            local = self._send(batch, plan)
            local.groups, local.stats = groups, stats
            return local
        return self._receive()

    def _check_stop(self) -> None:  # rank 0
        if self.stop is not None and self.stop():
            raise StopRequested("stop requested")

    def finish(self, needs_version: int | None) -> None:
        """Rank 0, after the step: the batch's groups were trained; the step is reported done
        (admission advances) once ``needs_version``, the version it made (None: none), is
        announced (``learner/reports.py``). Other ranks: no-op."""
        if self.rank != 0:
            return
        assert self.source is not None
        trained = len(self._pending)  # B, or fewer when dynamic sampling gave up (a short step)
        if self._pending:
            self.source.mark_trained(self._pending)
        self._pending = []
        self._reports().add(needs_version, trained)

    def published(self, ann: WeightAnnouncement) -> None:
        """Rank 0, from the weight writer: version ``ann.version`` is complete; announce it and
        release the step reports that waited for it."""
        if self.rank == 0:
            self._reports().published(ann)

    def _reports(self) -> StepReports:
        assert self.source is not None
        if self.reports is None:
            self.reports = StepReports(self.source, announced=-1)
        return self.reports

    # ---- tensor transport ----

    def _send(self, batch: RolloutBatch, plan: Plan | None) -> LocalBatch:
        if plan is None:
            if self.world > 1:
                self._bcast(torch.tensor([STATUS_EMPTY, 0], dtype=torch.int64))
            return _empty()
        parts = [[*batch.select_responses(idx).flat(), np.asarray(plan.micro_id[r], dtype=np.int64),
                  np.asarray(plan.micro_row[r], dtype=np.int64)] for r, idx in enumerate(plan.rank_index)]
        if self.world > 1:
            m = len(plan.n_micro)
            self._bcast(torch.tensor([STATUS_OK, m], dtype=torch.int64))
            sizes = torch.tensor([[len(a) for a in p] for p in parts], dtype=torch.int64)  # (R, K)
            self._bcast(torch.cat([sizes.view(-1), torch.tensor(plan.n_micro, dtype=torch.int64)]))
            self._bcast(_norms_tensor(plan.norms))
            mine = [self._scatter([_to_torch(p[k]) for p in parts], sizes[:, k], dt)
                    for k, dt in enumerate(_flat_dtypes())]
        else:
            mine = parts[0]
        return _local(mine, list(plan.n_micro), list(plan.norms))

    def _receive(self) -> LocalBatch:
        head = self._bcast(torch.zeros(2, dtype=torch.int64))
        if int(head[0]) == STATUS_STOP:
            raise StopRequested("rank 0 stops the run")
        if int(head[0]) == STATUS_EMPTY:
            return _empty()
        m, k = int(head[1]), len(_flat_dtypes())
        meta = self._bcast(torch.zeros(self.world * k + m, dtype=torch.int64))
        sizes = meta[: self.world * k].view(self.world, k)
        norms = _norms_list(self._bcast(torch.zeros(m * 4, dtype=torch.float64)))
        mine = [self._scatter(None, sizes[:, j], dt) for j, dt in enumerate(_flat_dtypes())]
        return _local(mine, meta[self.world * k:].tolist(), norms)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dev = t.to(self.device)
        dist.broadcast(dev, src=0)
        return dev.cpu()

    def _scatter(self, bufs: list[torch.Tensor] | None, sizes: torch.Tensor, dtype: str) -> np.ndarray:
        """Scatter rank r's 1-D ``bufs[r]`` (length ``sizes[r]``), padded to the longest; this
        rank's part as a numpy array of ``dtype``."""
        n_max = max(1, int(sizes.max()))  # gloo/nccl dislike empty buffers
        t_dtype = _to_torch(np.zeros(0, dtype)).dtype
        out = torch.zeros(n_max, dtype=t_dtype, device=self.device)
        scatter_list = None
        if bufs is not None:
            scatter_list = []
            for b in bufs:
                padded = torch.zeros(n_max, dtype=t_dtype)
                padded[: b.shape[0]] = b
                scatter_list.append(padded.to(self.device))
        dist.scatter(out, scatter_list, src=0)
        return _to_numpy(out[: int(sizes[self.rank])].cpu(), dtype)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """Bools travel as uint8 (not every backend reduces or scatters torch.bool)."""
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a.view(np.uint8) if a.dtype == np.bool_ else a)


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    a = t.numpy()
    return a.view(np.bool_) if np.dtype(dtype) == np.bool_ else a.astype(dtype, copy=False)


def _local(arrays: list[np.ndarray], n_micro: list[int], norms: list[MinibatchNorms]) -> LocalBatch:
    """This rank's ``LocalBatch`` from its scattered arrays (``RolloutBatch.flat`` + micro slots + rows)."""
    slot, row = (torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays[-2:])
    return LocalBatch(RolloutBatch.from_flat(arrays[:-2]), slot, row, n_micro, norms)


def _empty() -> LocalBatch:
    return LocalBatch(RolloutBatch.empty(), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [], [])


def _norms_tensor(norms: list[MinibatchNorms]) -> torch.Tensor:
    return torch.tensor([[n.tokens, n.seqs, n.pos_tokens, n.pos_seqs] for n in norms], dtype=torch.float64).view(-1)


def _norms_list(t: torch.Tensor) -> list[MinibatchNorms]:
    return [MinibatchNorms(*row.tolist()) for row in t.view(-1, 4)]
