"""A reward any model can learn fast, for the learning test: which half of the alphabet dominates.

Loaded by ``reward.custom={_target_:charreward.first_half_letters,_partial_:true}`` (Hydra
``_target_``; the test puts this folder on PYTHONPATH so the generator process imports it too).
A random model samples letters from both halves about equally, so about half its responses score
+1; raising the logits of the tokens rich in a-m letters (a bias the output layer can learn in a
few steps) raises the reward.
"""

from __future__ import annotations

FIRST = frozenset("abcdefghijklmABCDEFGHIJKLM")
SECOND = frozenset("nopqrstuvwxyzNOPQRSTUVWXYZ")


def first_half_letters(response: str, ground_truth: str, num_tokens: int) -> float:
    """+1 when letters a-m outnumber letters n-z in ``response``, else -1."""
    first = sum(c in FIRST for c in response)
    second = sum(c in SECOND for c in response)
    return 1.0 if first > second else -1.0
