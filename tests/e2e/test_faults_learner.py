"""Learner faults (issue 6) with real processes.

- ``test_learner_sigkill_then_resume``: ``python -m vapo_async.learner`` is SIGKILLed mid-run (a
  scripted generator process keeps running beside it), then restarted with ``resume=true``. It
  continues from its last checkpoint (step, version, controller state, optimiser states: the
  learner's own sha256 fingerprint must match), the generator reconnects without a restart, the
  in-flight work at the crash is re-issued, and no group is trained twice (the controller ledger in
  the final checkpoint: every admitted prompt done exactly once, trained = steps x B). During the
  resumed run two fuzzer processes fire 1,300 malformed messages at its socket: all are counted in
  its TensorBoard (``transport/rejected``) and the run still ends with exact accounting.
- ``test_cli_errors_are_one_line``: invalid overrides, a missing model, unreadable / malformed
  datasets, for the learner, the generator and the evaluator: each exits non-zero with one line
  that names the problem (file and line where relevant), never a traceback.

A scripted generator (``vapo_async.transport.synthetic``: valid groups with random tokens, no vLLM)
stands in for the vLLM generator to keep this file inside its time budget; the vLLM generator's
own reconnect and fault paths are covered in test_faults_generator.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vapo_async.common.procs import stop_processes

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = pytest.mark.slow

B, G, STEPS, KILL_AFTER = 4, 4, 8, 3
N_FUZZ = 650
"""Malformed messages per fuzzer process (two: one greeted, one anonymous) sent at the resumed learner."""
HELPERS = Path(__file__).resolve().parent / "fault_helpers.py"
FRAME_LIMIT = 256 << 10
"""The learner's frame limit here: the fuzzers' oversized frames are this + 4 bytes (cheap to send)."""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


def _module(name: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    f = open(log, "ab")  # noqa: SIM115 - the child owns it; closed when the test ends
    return subprocess.Popen([sys.executable, "-m", name, *args], env=_env(), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _learner_args(run_dir: Path, model: Path, endpoint: str) -> list[str]:
    return [f"hydra.run.dir={run_dir}", f"model.path={model}", "trainer.accelerator=cpu", "trainer.devices=1",
            "generators.local=0", f"controller.transport.endpoint={endpoint}", "controller.lease_timeout_s=5",
            f"algo.batch_groups={B}", f"algo.group_size={G}", "algo.mini_batches=2", "algo.value_warmup_steps=0",
            "algo.warmup_steps=0", "algo.eta=1", "sampling.max_tokens=16", "eval.every_n_steps=0",
            "data.n_train=64", "data.n_eval=8", "checkpoint.every_n_steps=1", "checkpoint.keep_weights=4",
            "trainer.enable_progress_bar=false", f"trainer.max_steps={STEPS}", "threads=1",
            f"controller.transport.limits.max_frame_bytes={FRAME_LIMIT}"]


def _ckpt(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


def _controller_state(obj: object) -> dict:
    """The controller's state_dict inside the Lightning checkpoint (the Runtime callback's state)."""
    if isinstance(obj, dict):
        if "ledger" in obj and "admission" in obj:
            return obj
        for v in obj.values():
            try:
                return _controller_state(v)
            except LookupError:
                pass
    raise LookupError("no controller state in the checkpoint")


def _scalar(tb_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard scalar over all event files of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            out.update({int(e.step): float(e.value) for e in acc.Scalars(tag)})
    return out


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    last = run_dir / "checkpoints" / "last.ckpt"
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step}:\n" + log.read_text(errors="replace")[-4000:]
        if last.is_file():
            try:
                ckpt = _ckpt(run_dir)
            except (RuntimeError, EOFError, OSError):  # being renamed into place
                ckpt = {"global_step": -1}
            if ckpt["global_step"] >= step:
                return ckpt
        time.sleep(0.5)


def test_learner_sigkill_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir, endpoint = tmp_path / "run", f"ipc://{tmp_path}/ctl"
    logs = tmp_path / "logs"
    logs.mkdir()
    gen = _module("vapo_async.transport.synthetic", ["--endpoint", endpoint, "--id", "kept", "--group-size", str(G),
                                                     "--max-prompts", "4", "--delay", "0.25"],  # ~1 s/step
                  logs / "gen.log")
    learner = None
    try:
        learner = _module("vapo_async.learner", _learner_args(run_dir, tiny_model_dir, endpoint), logs / "l1.log")
        _wait_for_step(run_dir, KILL_AFTER, learner, logs / "l1.log", timeout_s=240)
        time.sleep(0.3)  # mid-step: rollouts leased and buffered, maybe a step beyond the checkpoint
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait(10)
        stop_processes([learner], signal.SIGKILL, group=True)  # nothing of the learner may survive (no orphaned threads/processes)
        saved = _ckpt(run_dir)
        step, version = saved["global_step"], saved["vapo"]["version"]
        state = _controller_state(saved)
        inflight = len(state["ledger"]["inflight"])
        assert step >= KILL_AFTER and gen.poll() is None

        learner = _module("vapo_async.learner", [*_learner_args(run_dir, tiny_model_dir, endpoint), "resume=true"],
                          logs / "l2.log")
        # malformed traffic at the resumed learner's socket: counted in its TensorBoard
        fuzzers = [subprocess.Popen([sys.executable, str(HELPERS), "fuzz", "--endpoint", endpoint, "--n", str(N_FUZZ),
                                     "--seed", str(seed), "--vocab", "320", "--max-frame-bytes", str(FRAME_LIMIT),
                                     *(["--anonymous"] if seed else [])],
                                    env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for seed in (0, 1)]
        fuzzed = 0
        for f in fuzzers:
            out, err = f.communicate(timeout=120)
            assert f.returncode == 0, err[-2000:]
            report = json.loads(out.strip().splitlines()[-1])
            fuzzed += sum(report["sent"].values()) + report["probes"]
        assert learner.wait(300) == 0, (logs / "l2.log").read_text(errors="replace")[-4000:]
        assert gen.poll() is None, "the generator died across the learner restart"
    finally:
        if learner is not None:
            stop_processes([learner], signal.SIGKILL, group=True)
        gen.send_signal(signal.SIGTERM)
        try:
            gen.wait(15)
        except subprocess.TimeoutExpired:
            stop_processes([gen], signal.SIGKILL, group=True)
    out = (logs / "l2.log").read_text(errors="replace")
    resumed = re.search(r"resumed from \S+: step (\d+), version (\d+); optimizer state sha256 \w+ (matches|DIFFERS)", out)
    assert resumed, out[-3000:]
    assert (int(resumed.group(1)), int(resumed.group(2))) == (step, version)  # from the last checkpoint
    assert resumed.group(3) == "matches"  # optimiser states restored bit for bit
    final = _ckpt(run_dir)
    assert final["global_step"] == STEPS and final["vapo"]["version"] > version
    ledger = _controller_state(final)["ledger"]
    counts = ledger["counts"]
    done = ledger["done_watermark"] + len(ledger["done_above"])
    # exactly once across the crash: the resumed ledger continues the checkpoint's; each of the
    # STEPS steps trained B groups, every done item was trained or dropped once, none twice
    assert counts["trained"] + counts.get("dropped", 0) == done
    assert counts["trained"] == STEPS * B, counts
    assert counts.get("reissued", 0) >= inflight > 0, (counts, inflight)  # in-flight work re-issued, not lost
    assert "Traceback" not in out
    rejected = _scalar(run_dir / "tb", "transport/rejected")
    # every malformed message counted (plus the kept generator's messages to the dead controller's
    # session: its heartbeats and any group of a lease that died with it, rejected after the restart)
    assert rejected and fuzzed <= rejected[max(rejected)] <= fuzzed + 50, (fuzzed, rejected)


# ---- configuration and data errors ----


def _cases(model: Path, tmp: Path) -> list[tuple[str, list[str], str]]:
    """(module, arguments, text the one error line must contain)."""
    rows = tmp / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    garbage = tmp / "garbage.parquet"
    garbage.write_bytes(os.urandom(4096))
    learner = [f"hydra.run.dir={tmp / 'run'}", "generators.local=0", "eval.every_n_steps=0",
               f"controller.transport.endpoint=ipc://{tmp}/ctl"]
    return [
        ("vapo_async.learner", [*learner, f"model.path={tmp / 'no_model'}"], str(tmp / "no_model")),
        ("vapo_async.learner", [*learner, f"model.path={model}", f"data.name={tmp / 'none.jsonl'}"], "none.jsonl"),
        ("vapo_async.learner", [*learner, f"model.path={model}", f"data.name={rows}"], f"{rows}:2"),
        ("vapo_async.learner", [*learner, f"model.path={model}", f"data.name={garbage}"], "garbage.parquet"),
        ("vapo_async.learner", [*learner, "trainer.max_steps=abc"], "trainer.max_steps"),
        # checked before the engine starts
        ("vapo_async.generator", ["controller=http://127.0.0.1:1", f"model={model}"], "controller"),
        ("vapo_async.generator", ["max_prompts=0", f"model={model}"], "max_prompts"),
        ("vapo_async.generator", ["sampling.top_p=2", f"model={model}"], "top_p"),
        ("vapo_async.eval", [f"model={model}", f"data={rows}", "split=train", "k=2", f"out={tmp / 'e.json'}"],
         f"{rows}:2"),
        ("vapo_async.eval", [f"model={tmp / 'no_model'}", "k=2"], str(tmp / "no_model")),
    ]


def test_cli_errors_are_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    cases = _cases(tiny_model_dir, tmp_path)
    procs = [subprocess.Popen([sys.executable, "-m", mod, *args], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for mod, args, _ in cases]
    failures = []
    for (mod, args, needle), proc in zip(cases, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            stop_processes([proc], signal.SIGKILL, group=True)  # type: ignore[arg-type]
            failures.append(f"{mod} {args[-1]}: still running after 240 s")
            continue
        errors = [ln for ln in err.splitlines() if ln.startswith(f"{mod}: error:")]
        if proc.returncode == 0 or len(errors) != 1 or needle not in errors[0] or "Traceback" in err:
            failures.append(f"{mod} {args}: exit {proc.returncode}, error lines {errors}, needs {needle!r}\n"
                            f"{err[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_sigint_stops_a_learner_started_with_sigint_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A shell script's background job (`python -m vapo_async.learner ... &`) starts with SIGINT
    ignored; the learner restores the KeyboardInterrupt handler, so a harness's SIGINT still stops
    it (here while it waits for rollouts from generators that never come)."""
    args = [f"hydra.run.dir={tmp_path / 'run'}", "generators.local=0", "eval.every_n_steps=0",
            f"model.path={tiny_model_dir}", f"controller.transport.endpoint=ipc://{tmp_path}/ctl",
            "trainer.enable_progress_bar=false"]
    proc = subprocess.Popen([sys.executable, "-m", "vapo_async.learner", *args], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "ctl").exists():  # the controller is bound: training is waiting for data
            assert proc.poll() is None, f"learner exited early: {proc.stderr.read()[-2000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the learner never bound its controller socket"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            stop_processes([proc], signal.SIGKILL, group=True)  # type: ignore[arg-type]
    assert proc.returncode != 0 and proc.returncode != -signal.SIGKILL
