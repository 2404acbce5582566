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

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_sigkilled_generator_leaves_no_descendants(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "generator.log"
    cmd = [sys.executable, "-m", "vapo_async.generator", f"controller=ipc://{tmp_path}/nobody",
           f"model={tiny_model_dir}", "engine.max_model_len=256", "generator_id=orphan-test"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "w") as log:  # own session: the finally below can clean up after a failure
        gen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        # the engine is up once the generator says hello (to nobody: no controller is needed here)
        while "connecting to controller" not in log_path.read_text():
            assert gen.poll() is None, f"generator exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engine did not start:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        descendants = psutil.Process(gen.pid).children(recursive=True)
        names = sorted(p.name() for p in descendants)
        assert any("EngineCore" in n for n in names), f"expected vLLM's EngineCore among {names}"
        gen.send_signal(signal.SIGKILL)  # kill -9 / the OOM killer: no cleanup code runs in the generator
        gen.wait(10)
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, (f"descendants outlived the SIGKILLed generator by 15 s: "
                           f"{[(p.pid, p.name()) for p in alive]} of {names}\n{log_path.read_text()[-2000:]}")
    finally:
        for p in [psutil.Process(gen.pid), *descendants] if gen.poll() is None else descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        gen.wait(10)
