"""vapo_async.algo: the VAPO algorithm as pure tensor functions (no I/O, no distributed calls).

Notation used in every shape below (and across the project):
    B  responses in a batch            T  padded response length (tokens)
    G  samples per prompt (a group)    V  vocabulary size
    L_i  valid tokens of response i    mask[i, t]  nonzero on the tokens that count
Equation numbers refer to /shared/PAPER.md (VAPO arXiv 2504.05118, DAPO 2503.14476, AReaL 2505.24298).

Modules:
    advantages  advantages in one place: scored responses (+ values) -> advantages and returns
                (``advantages_and_returns``); GAE as the recurrence (decoupled, length-adaptive),
                group advantages, DAPO overlong penalty, terminal-reward placement
    fast        GAE's fast paths (numba on CPU, blocked matmul scan on GPU) and their dispatcher
    losses      decoupled PPO policy loss with clip-higher and behaviour-weight cap, value loss,
                positive-example NLL
    stats       masked mean / variance / whitening, explained variance, log-probs and entropy
    presets     AlgoConfig and the vapo / ppo / grpo / dapo presets, ``vapo_without``

Every module docstring lists its deliberate departures from the papers.
"""

from vapo_async.algo.advantages import (
    GaeLambdas,
    advantages_and_returns,
    gae,
    group_advantages,
    length_adaptive_lambda,
    overlong_penalty,
    place_terminal_rewards,
    score_responses,
    token_advantages,
)
from vapo_async.algo.losses import (
    aggregate,
    policy_loss,
    positive_nll_loss,
    value_loss,
)
from vapo_async.algo.presets import PRESETS, TECHNIQUES, AlgoConfig, preset, vapo_without
from vapo_async.algo.stats import (
    entropy_from_logits,
    explained_variance,
    gather_logprobs,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "PRESETS",
    "TECHNIQUES",
    "AlgoConfig",
    "GaeLambdas",
    "advantages_and_returns",
    "aggregate",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "gather_logprobs",
    "group_advantages",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "place_terminal_rewards",
    "policy_loss",
    "positive_nll_loss",
    "preset",
    "score_responses",
    "token_advantages",
    "value_loss",
    "vapo_without",
]
