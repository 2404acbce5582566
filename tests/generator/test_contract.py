"""The controller's welcome is the generator contract: a generator whose configured context is
shorter than the learner's demand refuses at start with one line, before its engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vapo_async.common.engine import DEFAULT_MAX_MODEL_LEN, EngineConfig
from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.config import TransportConfig

SRC = Path(__file__).resolve().parents[2] / "src"


class _Prompt:
    prompt = "What is 1 + 1?"
    answer = "2"


def test_for_demand_takes_refuses_or_keeps() -> None:
    assert EngineConfig().for_demand(640).context() == 640  # unset: the controller's demand
    assert EngineConfig().for_demand(0).context() == DEFAULT_MAX_MODEL_LEN  # no demand: the default
    assert EngineConfig(max_model_len=1024).for_demand(640).context() == 1024  # longer than asked: kept
    with pytest.raises(ValueError, match=r"engine\.max_model_len=512 .* 640 tokens"):
        EngineConfig(max_model_len=512).for_demand(640)


def test_generator_with_too_short_context_refuses_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/ctl"
    cfg = ControllerConfig(transport=TransportConfig(endpoint=endpoint), max_model_len=640,
                           sampling={"n": 2, "max_tokens": 600})
    with Controller(cfg, [_Prompt()], batch_groups=1, eta=0, vocab_size=320):
        env = dict(os.environ, PYTHONPATH=str(SRC))
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "vapo_async.generator", f"controller={endpoint}", f"model={tiny_model_dir}",
             "engine.max_model_len=256", "connect_timeout_s=60", f"weights_cache={tmp_path}/cache"],
            env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("vapo_async.generator: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and "engine.max_model_len=256" in errors[0] and "640" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # refused before the vLLM engine start (~20 s here): interpreter, Hydra and one round trip
    assert elapsed < 15, f"refusal took {elapsed:.1f} s: the engine was started first"
