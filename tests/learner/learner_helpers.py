"""Hand-made rollout groups for learner tests (deterministic, no engine needed)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from vapo_async.transport.batch import GroupInfo, RolloutBatch


def make_groups(n_groups: int, group_size: int, vocab: int, seed: int = 0, version: int = 0,
                max_prompt: int = 9, max_response: int = 14, min_response: int = 1) -> list[RolloutBatch]:
    """Random groups: prompt/response lengths vary, log-probs in [-3, -0.05], rewards +-1 with the
    correct flag matching the reward; every group has both signs unless G == 1."""
    rng = np.random.default_rng(seed)
    groups = []
    for k in range(n_groups):
        p = int(rng.integers(2, max_prompt + 1))
        lens = rng.integers(min_response, max_response + 1, size=group_size)
        correct = rng.random(group_size) < 0.5
        if group_size > 1:
            correct[0], correct[1] = True, False
        groups.append(RolloutBatch.from_group(
            GroupInfo(lease_id=k, prompt_index=k, generator_id="test"),
            prompt_ids=rng.integers(3, vocab, size=p).astype(np.int32),
            response_ids=[rng.integers(3, vocab, size=int(n)).astype(np.int32) for n in lens],
            logprobs=[rng.uniform(-3.0, -0.05, size=int(n)).astype(np.float32) for n in lens],
            versions=[np.full(int(n), version, dtype=np.int32) for n in lens],
            rewards=np.where(correct, 1.0, -1.0).astype(np.float32),
            correct=correct.astype(bool),
            truncated=(lens == max_response),
        ))
    return groups


def random_actor_critic(vocab: int, max_positions: int = 512) -> tuple[Qwen2ForCausalLM, Qwen2ForTokenClassification]:
    """A random 2-layer Qwen2 actor (hidden 64, 4/2 heads, tied output embedding, seed 0) and a
    critic of the same shape with a random one-label value head, both fp32 in train mode."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      use_cache=False, tie_word_embeddings=True)
    actor = Qwen2ForCausalLM(cfg).float().train()
    critic_cfg = copy.deepcopy(cfg)
    critic_cfg.num_labels, critic_cfg.classifier_dropout = 1, 0.0
    critic = Qwen2ForTokenClassification(critic_cfg).float().train()
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.05)
    return actor, critic
