"""Supervised local generators (learner/supervise.py) in a real run: a generator killed with
SIGKILL mid-run is restarted and the run finishes; one that cannot start stops the run with one
message quoting its log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_e2e_learner import _scalars

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _args(tiny_model_dir: Path, tmp_path: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", f"model.path={tiny_model_dir}",
            "trainer.accelerator=cpu", "trainer.devices=1", "algo.batch_groups=4", "algo.group_size=4",
            "algo.mini_batches=1", "algo.value_warmup_steps=0", "algo.warmup_steps=0", "algo.eta=0",
            "sampling.max_tokens=16", "eval.every_n_steps=0", "data.n_train=64", "data.n_eval=8",
            "trainer.enable_progress_bar=false", f"controller.transport.endpoint=ipc://{tmp_path}/ctl",
            "checkpoint.every_n_steps=1", "generators.max_prompts=4", "generators.restart_backoff_s=1"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


def test_a_generator_killed_mid_run_is_restarted_and_the_run_finishes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "learner.log"
    out = (tmp_path / "learner.out").open("w")
    proc = subprocess.Popen([*_args(tiny_model_dir, tmp_path, run_dir), "trainer.max_steps=4"], env=_env(),
                            stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "last.ckpt").is_file():  # step 1 done: the generator serves
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.out").read_text()[-3000:]
        time.sleep(0.2)
    pid = int(re.search(r"started generator local-0 \(pid (\d+)\)", log.read_text()).group(1))
    os.killpg(pid, signal.SIGKILL)  # the generator and its engine core, as the OOM killer might
    assert proc.wait(timeout=400) == 0, (tmp_path / "learner.out").read_text()[-4000:]
    text = log.read_text()
    assert "generator local-0 exited with code -9" in text and "generator local-0 restarted" in text, text[-3000:]
    assert (run_dir / "generators" / "generator-0.log.1").is_file()
    served = [ln for ln in (run_dir / "generators" / "generator-0.log").read_text().splitlines() if " serving " in ln]
    # the new one served from its own weights cache (hard links to the welcome's version, which the
    # learner's pruning cannot remove), not from the run's weights directory
    cache = os.path.expanduser("~/.cache/vapo_async/weights")  # GeneratorConfig.weights_cache
    assert served and cache in served[0] and str(run_dir / "weights") not in served[0], served
    assert _scalars(run_dir / "tb")["generators/restarts"][4] == 1.0
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 4


def test_a_generator_that_cannot_start_stops_the_run_quoting_its_log(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([*_args(tiny_model_dir, tmp_path, run_dir), "trainer.max_steps=3",
                           "generators.overrides=['engine.max_model_len=8']"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "local-0 died 3 times in a row" in proc.stderr, proc.stderr[-4000:]
    assert "engine.max_model_len" in proc.stderr  # the generator's own one-line refusal, quoted
    assert time.monotonic() - t0 < 200
    assert len(list((run_dir / "generators").glob("generator-0.log*"))) == 3  # each life's log kept
