"""A custom reward for the eval CLI test: "correct" iff the response has an odd token count.

Loaded by ``reward.custom={_target_:oddreward.odd_length,_partial_:true}`` (Hydra ``_target_``), it
makes correctness vary across samples in a way the test can recompute from the samples file.
"""

from __future__ import annotations


def odd_length(response: str, ground_truth: str, num_tokens: int) -> float:
    """+1 for an odd number of tokens, -1 otherwise."""
    return 1.0 if num_tokens % 2 else -1.0
