"""vapo_async.rewards: answer extraction, bounded math-verify scoring, DAPO overlong shaping.

from vapo_async.rewards import RewardConfig, build_reward_fn
fn = build_reward_fn(RewardConfig())
fn("... so 2 + 3 = 5.\nAnswer: 5", "5", num_tokens=12)
# -> Score(reward=1.0, correct=True, formatted=True)
"""

from .extract import Extraction, extract_answer
from .reward import RewardConfig, RewardFn, Score, build_reward_fn, overlong_penalty
from .verify import RewardError, Verdict, Verifier

__all__ = [
    "Extraction",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "Score",
    "Verdict",
    "Verifier",
    "build_reward_fn",
    "extract_answer",
    "overlong_penalty",
]
