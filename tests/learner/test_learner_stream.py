"""Batch assembly on rank 0: stale groups dropped and counted, dynamic sampling refills, group
advantages and the overlong penalty applied (hand-derived values)."""

from __future__ import annotations

import numpy as np
import torch
from learner_helpers import make_groups

from vapo_async.learner.stream import ListSource, RolloutStream, StreamConfig
from vapo_async.transport.batch import GroupInfo, RolloutBatch


def _stream(source, **kw) -> RolloutStream:
    cfg = StreamConfig(batch_groups=kw.pop("batch_groups", 4), group_size=4, eta=kw.pop("eta", 2),
                       n_minibatches=1, micro_batch_tokens=4096, **kw)
    return RolloutStream(cfg, source, rank=0, world=1, device=torch.device("cpu"))


def test_stale_groups_are_dropped_counted_and_refilled():
    # versions 0 (stale at version 5 with eta 2: 5 - 0 > 2) alternate with versions 4 (fresh: 1 <= 2)
    groups = [g for k in range(4) for g in (make_groups(1, 4, 50, seed=k, version=0)[0],
                                             make_groups(1, 4, 50, seed=10 + k, version=4)[0])]
    source = ListSource(groups, restamp=False)
    batch = _stream(source, eta=2).next(step=7, version=5)
    # the source alternates stale (s) and fresh (f): pull 1 = s f s f (2 kept), pull 2 asks for 2 =
    # s f (3 kept), pull 3 asks for 1 = s, pull 4 asks for 1 = f (4 kept): 4 dropped in 4 rounds
    assert batch.stats["async/dropped_stale"] == 4.0
    assert batch.stats["rollout/sampling_rounds"] == 4.0
    assert len(batch.groups) == 4 and all(g.oldest_version() == 4 for g in batch.groups)
    assert source.dropped == 4
    assert batch.seqs.n_responses == 16
    assert batch.stats["async/staleness_mean"] == 1.0  # every kept token: 5 - 4


def test_all_stale_gives_an_empty_batch_after_max_rounds():
    source = ListSource(make_groups(3, 4, 50, seed=1, version=0), restamp=False)
    batch = _stream(source, eta=0, max_sampling_rounds=3).next(step=0, version=2)
    assert batch.empty and batch.seqs.n_responses == 0
    assert batch.stats["async/dropped_stale"] == 12.0  # 3 rounds x 4 groups
    source_steps = source.steps
    _stream(source).finish(None)
    assert source.steps == source_steps + 1


def test_dynamic_sampling_drops_all_equal_groups():
    groups = make_groups(6, 4, 50, seed=3)
    for g in groups[::2]:  # every other group: all correct -> no learning signal
        g.correct[:] = True
        g.rewards[:] = 1.0
    source = ListSource(groups)
    batch = _stream(source, batch_groups=3, dynamic_sampling=True).next(step=0, version=0)
    assert len(batch.groups) == 3
    assert all(0 < int(np.sum(g.correct)) < 4 for g in batch.groups)
    assert batch.stats["rollout/dropped_filtered"] == 3.0
    # rollout accuracy counts every fresh group pulled, before filtering
    assert batch.stats["rollout/groups"] == 6.0


def test_group_advantage_and_overlong_penalty():
    lens = [3, 3, 3, 10]
    g = RolloutBatch.from_group(
        GroupInfo(lease_id=0, prompt_index=0, generator_id="test"), prompt_ids=np.arange(3, 8),
        response_ids=[np.arange(10, 10 + n) for n in lens], logprobs=[np.full(n, -1.0) for n in lens],
        versions=[np.zeros(n) for n in lens], rewards=[1.0, -1.0, 1.0, 1.0], correct=[True, False, True, True])
    stream = _stream(ListSource([g]), batch_groups=1, group_advantage=True, overlong=(10, 4))
    seqs = stream._score([g])
    # R_len: L_max - L_cache = 6; lengths 3 -> 0; length 10 -> (6 - 10) / 4 = -1 => rewards 1, -1, 1, 0
    torch.testing.assert_close(torch.from_numpy(seqs.rewards), torch.tensor([1.0, -1.0, 1.0, 0.0]))
    # group advantage: mean 0.25, unbiased std sqrt(((.75)^2 * 2 + 1.25^2 + .25^2) / 3) = sqrt(2.75 / 3)
    std = (2.75 / 3) ** 0.5
    expected = (torch.tensor([1.0, -1.0, 1.0, 0.0]) - 0.25) / (std + 1e-6)
    torch.testing.assert_close(torch.from_numpy(seqs.seq_adv), expected)
