"""How responses are sampled: one type for the learner's ``sampling`` node and a generator's.

The learner owns the settings (``SamplingConfig``); its controller sends them, with the group size
G (``algo.group_size``) as ``n``, in every generator's welcome (``WELCOME_SAMPLING_KEYS``). A
generator samples G responses per prompt, so its node is a ``GroupSamplingConfig``: the same
fields plus ``group_size``, overridden by the welcome (``with_welcome``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

WELCOME_SAMPLING_KEYS = {"n": "group_size", "temperature": "temperature", "top_p": "top_p",
                         "max_tokens": "max_tokens"}
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

    def __post_init__(self) -> None:
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
