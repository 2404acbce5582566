"""How responses are sampled: one type for the learner's ``sampling`` node and a generator's.

The learner owns the settings (``SamplingConfig``); its controller sends them, with the group size
G (``algo.group_size``) as ``n``, in every generator's welcome (``WELCOME_SAMPLING_KEYS``). A
generator samples G responses per prompt, so its node is a ``GroupSamplingConfig``: the same
fields plus ``group_size``, overridden by the welcome (``with_welcome``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any

WELCOME_SAMPLING_KEYS = {"n": "group_size", "temperature": "temperature", "top_p": "top_p",
                         "max_tokens": "max_tokens", "seed": "seed"}
"""Keys of the controller's ``welcome.sampling`` map -> ``GroupSamplingConfig`` field names."""


@dataclass
class SamplingConfig:
    """How responses are sampled (the behaviour policy)."""

    temperature: float = 1.0
    """Softmax temperature; the learner divides its logits by the same value (generator/engine.py)."""
    top_p: float = 1.0
    """Nucleus mass; keep 1.0 for training (top_p < 1 truncates the behaviour distribution)."""
    max_tokens: int = 256
    """Most tokens per response (responses hitting it are marked truncated)."""
    seed: int | None = None
    """None: the engine's own random stream (fastest). An int: each group is sampled with its own
    seed, ``request_seed(seed, prompt index, policy version)``, so what a prompt draws does not
    depend on what else the engine batches or on timing (reproducible runs: with ``algo.eta=0``,
    one generator and ``generators.max_prompts=1``; vLLM's per-request generators cost some
    sampler speed)."""

    def __post_init__(self) -> None:
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise ValueError(f"sampling.seed={self.seed}: must be in [0, 2**31)")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={self.max_tokens}: must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}")


@dataclass
class GroupSamplingConfig(SamplingConfig):
    """A generator's sampling: ``SamplingConfig`` for groups of ``group_size`` responses per prompt."""

    group_size: int = 8
    """G: responses sampled per prompt (one group)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 1:
            raise ValueError(f"sampling.group_size={self.group_size}: must be >= 1")

    def with_welcome(self, sampling: dict[str, Any]) -> GroupSamplingConfig:
        """A copy with the controller's ``welcome.sampling`` applied (unknown keys are an error)."""
        unknown = set(sampling) - set(WELCOME_SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"controller sent unknown sampling keys {sorted(unknown)}; "
                             f"this generator understands {sorted(WELCOME_SAMPLING_KEYS)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({WELCOME_SAMPLING_KEYS[k]: v for k, v in sampling.items()})
        return GroupSamplingConfig(**values)


def request_seed(seed: int, prompt_index: int, version: int) -> int:
    """The vLLM request seed of one group: a hash of the run's ``sampling.seed``, the prompt's index
    and the policy version that samples it, in [0, 2**31) (the G samples of the group get
    seed + 0..G-1 from vLLM)."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**16)
