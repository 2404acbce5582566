"""Shared fixtures: tiny random Qwen2 models made in the test (no model hub is reachable)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _corpus() -> list[str]:
    """Arithmetic-flavoured text so the tokenizer learns digits, operators and 'Answer:'."""
    lines = []
    for a in range(40):
        for b in range(0, 40, 3):
            lines.append(f"Question: what is {a} + {b} * 2? Step: {b} * 2 = {2 * b}. "
                         f"Step: {a} + {2 * b} = {a + 2 * b}.\nAnswer: {a + 2 * b}")
    return lines


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (hidden 128, ~0.5M params) with a 320-token BPE tokenizer."""
    from vapo_async.data.hf_dir import write_random_qwen2

    out = tmp_path_factory.mktemp("tiny_qwen2")
    return write_random_qwen2(out, _corpus(), vocab_size=320, seed=0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (GSM8K, AIME 2024); tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA
