"""Python values as Hydra command-line overrides (``key=value``), for the commands this project
starts itself: local generators (``learner/launch.py``) and benchmark runs (``benchmarks/``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def hydra_value(value: Any) -> str:
    """A Python value as a Hydra override value (None -> null, bools lower-case, floats repr)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def as_overrides(overrides: Sequence[str] | Mapping[str, Any] | None) -> list[str]:
    """``["key=value", ...]`` from a list of overrides (kept as they are), a ``{key: value}``
    mapping (values through ``hydra_value``) or None (none)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={hydra_value(value)}" for key, value in overrides.items()]
    return list(overrides)
