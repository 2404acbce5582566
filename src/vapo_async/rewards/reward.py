"""Rule-based reward: answer extraction + equivalence + optional DAPO overlong shaping.

    fn = build_reward_fn(RewardConfig())
    score = fn(response_text, ground_truth, num_tokens)   # Score(reward, correct, formatted)

Reward = (``correct`` if the extracted answer is equivalent to the ground truth, else ``wrong``;
``unformatted`` when no answer marker is found) + R_len(|y|) when ``overlong_shaping`` is on, with
R_len the soft overlong punishment of DAPO (PAPER.md, DAPO bullet):
    R_len(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max
L_cache is resolved in one place, ``RewardConfig.overlong_band`` (null: 20% of L_max, DAPO's 4096 of
20480); the learner applies the same band with L_max = sampling.max_tokens (``algo.overlong_shaping``).

Departures (deliberate): DAPO grades only the ``Answer:`` line; we also accept ``\\boxed{}`` and
``#### N`` (``answer_formats`` restricts that) and use math-verify for equivalence instead of
string match after normalisation. A custom reward (``custom``) replaces extraction and
verification; its time bound is its own responsibility (it runs in the calling thread).

One ``RewardFn`` per process, shared by its threads; ``close()`` stops its math-verify workers.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .extract import ALL_FORMATS, extract_answer
from .verify import Verdict, Verifier


@dataclass(frozen=True, slots=True)
class Score:
    """Outcome of scoring one response."""

    reward: float
    """Scalar reward (correctness reward plus overlong shaping when enabled)."""
    correct: bool
    """The extracted answer is equivalent to the ground truth."""
    formatted: bool
    """An answer marker (``Answer:``, ``\\boxed{}``, ``####``) with a non-empty answer was found."""


@dataclass
class RewardConfig:
    """How responses are scored (``reward.*`` in the Hydra config)."""

    correct: float = 1.0
    """Reward for a correct answer (DAPO: +1)."""
    wrong: float = -1.0
    """Reward for a wrong answer (DAPO: -1; set 0.0 for a 1 / 0 reward)."""
    unformatted: float | None = None
    """Reward when no answer is found; None means the same as ``wrong``."""
    overlong_shaping: bool = False
    """Add DAPO's soft overlong punishment R_len(|y|) (PAPER.md, DAPO)."""
    max_response_tokens: int = 1024
    """L_max: responses longer than this get R_len = -1 (should equal the sampling max_tokens)."""
    overlong_cache_tokens: int | None = None
    """L_cache: length of the linear penalty ramp before L_max; None = 20% of L_max rounded down
    (DAPO's proportion, 4096 of 20480; 256 -> 51). ``overlong_band`` resolves it."""
    timeout_s: float = 5.0
    """Hard bound on one math-verify check (the worker is killed after it); the sample is wrong."""
    verify_workers: int = 1
    """math-verify worker processes per scoring process (only non-numeric answers reach them)."""
    worker_memory_mb: int = 2048
    """Address-space limit of each worker, so memory bombs fail fast; 0 = unlimited."""
    answer_formats: list[str] = field(default_factory=lambda: list(ALL_FORMATS))
    """Accepted answer markers: ``answer_line``, ``boxed``, ``gsm8k``."""
    answer_tail_chars: int = 300
    """The ``Answer:`` line is searched in this many final characters (DAPO: 300)."""
    max_answer_chars: int = 512
    """Longer extracted answers are wrong without parsing."""
    max_brace_depth: int = 12
    """Answers with braces nested deeper than this are wrong without parsing."""
    custom: Any = None
    """Hydra node ``{"_target_": "pkg.module.fn", "_partial_": true, ...}`` (a mapping) or None,
    for a custom reward ``(response, ground_truth, num_tokens) -> Score | float`` that replaces the
    rule-based score. Typed ``Any`` on purpose: OmegaConf cannot merge a command-line mapping
    (``reward.custom={_target_:pkg.fn,_partial_:true}``) into a None-valued ``Dict`` node, but it
    can set one on an ``Any`` node; ``__post_init__`` checks the shape instead."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.overlong_cache_tokens is not None and self.overlong_cache_tokens < 0:
            raise ValueError(f"reward.overlong_cache_tokens={self.overlong_cache_tokens}: must be >= 0 "
                             "(or null: 20% of L_max)")
        if self.overlong_shaping:
            self.overlong_band(self.max_response_tokens, "reward.max_response_tokens")
        unknown = set(self.answer_formats) - set(ALL_FORMATS)
        if unknown or not self.answer_formats:
            raise ValueError(
                f"reward.answer_formats must be a non-empty subset of {ALL_FORMATS}, "
                f"got {self.answer_formats}"
            )
        if self.custom is not None and not isinstance(self.custom, Mapping):
            raise ValueError(
                "reward.custom must be a mapping with a '_target_' key or null, "
                f"got {type(self.custom).__name__} {self.custom!r:.80}"
            )
        if self.custom is not None and "_target_" not in self.custom:
            raise ValueError(
                f"reward.custom needs a '_target_' key, got keys {sorted(self.custom)}"
            )

    def overlong_band(self, max_len: int, max_key: str = "sampling.max_tokens") -> tuple[int, int]:
        """(L_max, L_cache) of DAPO's soft overlong punishment for responses of at most ``max_len``
        tokens (``max_key`` names that setting in errors). The one place L_cache is resolved:
        ``overlong_cache_tokens``, or None = ``max_len // 5`` (20% rounded down: 20480 -> 4096,
        256 -> 51). ValueError naming reward.overlong_cache_tokens unless 0 <= L_cache < L_max:
        at L_cache = L_max the band would start at length 0 and penalise every response."""
        cache = max_len // 5 if self.overlong_cache_tokens is None else self.overlong_cache_tokens
        if max_len < 1 or not 0 <= cache < max_len:
            raise ValueError(f"reward.overlong_cache_tokens={self.overlong_cache_tokens}: L_cache={cache} must be "
                             f"in [0, {max_key}={max_len}) (the soft band is the last L_cache tokens before L_max)")
        return max_len, cache


def overlong_penalty(num_tokens: int, max_len: int, cache_len: int) -> float:
    """R_len(|y|) of DAPO's soft overlong punishment (PAPER.md, DAPO bullet) for one response;
    values in [-1, 0]. The formula lives once, in ``vapo_async.algo.advantages.overlong_penalty``
    (imported here, on first use: ``vapo_async.rewards`` stays free of torch at import)."""
    import torch

    from vapo_async.algo.advantages import overlong_penalty as algo_overlong_penalty

    lengths = torch.tensor([num_tokens], dtype=torch.int64)
    return float(algo_overlong_penalty(lengths, max_len, cache_len, dtype=torch.float64)[0])


RewardCallable = Callable[[str, str, int], "Score | float"]


def load_custom(node: dict[str, Any]) -> RewardCallable:
    """Instantiate a Hydra ``_target_`` node into a reward callable; errors name the target."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = node.get("_target_")
    try:
        fn = instantiate(node)
    except InstantiationException as e:
        hint = "" if node.get("_partial_") else " (for a plain function add '_partial_: true')"
        raise ValueError(f"reward.custom: cannot instantiate {target!r}{hint}: {e}") from e
    if not callable(fn):
        raise TypeError(
            f"reward.custom: {target!r} produced a {type(fn).__name__}, not a callable "
            "(response, ground_truth, num_tokens) -> Score | float"
        )
    return fn


class RewardFn:
    """Callable ``(response, ground_truth, num_tokens) -> Score``; thread-safe, bounded time."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.custom = load_custom(dict(cfg.custom)) if cfg.custom is not None else None
        self.verifier = Verifier(
            timeout_s=cfg.timeout_s,
            workers=cfg.verify_workers,
            max_answer_chars=cfg.max_answer_chars,
            max_brace_depth=cfg.max_brace_depth,
            memory_mb=cfg.worker_memory_mb,
        )
        self._formats = tuple(cfg.answer_formats)
        self._overlong = (cfg.overlong_band(cfg.max_response_tokens, "reward.max_response_tokens")
                          if cfg.overlong_shaping else None)

    def _custom_score(self, response: str, ground_truth: str, num_tokens: int) -> Score:
        assert self.custom is not None
        out = self.custom(response, ground_truth, num_tokens)
        if isinstance(out, Score):
            return out
        if isinstance(out, numbers.Real) and not isinstance(out, bool):
            return Score(reward=float(out), correct=float(out) > 0, formatted=True)
        raise TypeError(
            f"reward.custom {self.cfg.custom!r} returned {type(out).__name__}; "
            "expected Score or a number"
        )

    def _rule_score(self, response: str, ground_truth: str) -> Score:
        cfg = self.cfg
        found = extract_answer(response, self._formats, cfg.answer_tail_chars, cfg.max_answer_chars)
        if found is None:
            reward = cfg.wrong if cfg.unformatted is None else cfg.unformatted
            return Score(reward=reward, correct=False, formatted=False)
        ok = not found.too_long and self.verifier.check(ground_truth, found.answer) is Verdict.EQUAL
        return Score(reward=cfg.correct if ok else cfg.wrong, correct=ok, formatted=True)

    def __call__(self, response: str, ground_truth: str, num_tokens: int) -> Score:
        if not isinstance(response, str):
            raise TypeError(f"response must be str, got {type(response).__name__}")
        if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
            ground_truth = str(ground_truth)
        if not isinstance(ground_truth, str):
            raise TypeError(f"ground_truth must be str, got {type(ground_truth).__name__}")
        if self.custom is not None:
            score = self._custom_score(response, ground_truth, num_tokens)
        else:
            score = self._rule_score(response, ground_truth)
        if self._overlong is None:
            return score
        r_len = overlong_penalty(num_tokens, *self._overlong)
        return Score(reward=score.reward + r_len, correct=score.correct, formatted=score.formatted)

    def metrics(self) -> dict[str, float]:
        """How checks were decided so far: fast, slow, cached, rejected, timeout, error."""
        return {f"reward/verify_{k}": float(v) for k, v in self.verifier.counts.items()}

    def warmup(self) -> None:
        """Start the math-verify workers now rather than on the first non-numeric answer."""
        self.verifier.warmup()

    def close(self) -> None:
        """Stop the math-verify workers (also happens at garbage collection / exit)."""
        self.verifier.close()

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_reward_fn(cfg: RewardConfig) -> RewardFn:
    """The reward function described by ``cfg`` (see the module docstring)."""
    return RewardFn(cfg)
