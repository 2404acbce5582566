"""Fixtures of the generator tests: published weight versions and a shared vLLM engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from genhelp import Published, make_engine
from safetensors.torch import load_file

from vapo_async.transport.publisher import WeightPublisher


@pytest.fixture(scope="package")
def published(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    root = tmp_path_factory.mktemp("gen_weights") / "weights"
    pub = WeightPublisher(root, tiny_model_dir, keep=100)
    yield Published(root.resolve(), pub, load_file(tiny_model_dir / "model.safetensors"))
    pub.close()


@pytest.fixture(scope="package")
def engine(published: Published) -> Iterator[object]:
    """A multiprocess vLLM engine started from version 0 (tests reload it as they need)."""
    eng = make_engine(published.dir(0), 0)
    yield eng
    eng.shutdown()
