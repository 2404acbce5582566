"""A real generator process killed with SIGKILL leaves no process behind: vLLM's EngineCore and
its worker (and any other descendant) die with it, within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vapo_async.controller.config import ControllerConfig
from vapo_async.controller.server import Controller
from vapo_async.transport.config import TransportConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SRC = str(Path(__file__).resolve().parents[2] / "src")


class _Prompt:
    prompt = "What is 1 + 1?"
    answer = "2"


def test_sigkilled_generator_leaves_no_descendants(tiny_model_dir: Path, tmp_path: Path) -> None:
    # a real controller: the generator builds its engine only once welcomed (the welcome sets its context)
    endpoint = f"ipc://{tmp_path}/ctl"
    cfg = ControllerConfig(transport=TransportConfig(endpoint=endpoint), max_model_len=256,
                           sampling={"n": 2, "max_tokens": 16})
    with Controller(cfg, [_Prompt()], batch_groups=1, eta=0, vocab_size=320):
        _kill_and_watch(tiny_model_dir, tmp_path, endpoint)


def _kill_and_watch(tiny_model_dir: Path, tmp_path: Path, endpoint: str) -> None:
    log_path = tmp_path / "generator.log"
    cmd = [sys.executable, "-m", "vapo_async.generator", f"controller={endpoint}",
           f"model={tiny_model_dir}", "generator_id=orphan-test", f"weights_cache={tmp_path}/cache"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "w") as log:  # own session: the finally below can clean up after a failure
        gen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        # the engine is up once the generator says it is serving
        while "serving" not in log_path.read_text():
            assert gen.poll() is None, f"generator exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engine did not start:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        descendants = psutil.Process(gen.pid).children(recursive=True)
        names = sorted(_names(descendants))  # a short-lived helper may exit while we look
        assert any("EngineCore" in n for n in names), f"expected vLLM's EngineCore among {names}"
        gen.send_signal(signal.SIGKILL)  # kill -9 / the OOM killer: no cleanup code runs in the generator
        gen.wait(10)
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, (f"descendants outlived the SIGKILLed generator by 15 s: "
                           f"{_names(alive)} of {names}\n{log_path.read_text()[-2000:]}")
    finally:
        for p in [psutil.Process(gen.pid), *descendants] if gen.poll() is None else descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        gen.wait(10)


def _names(procs: list[psutil.Process]) -> list[str]:
    """Names of those of ``procs`` still running."""
    out = []
    for p in procs:
        try:
            out.append(p.name())
        except psutil.NoSuchProcess:
            pass
    return out
