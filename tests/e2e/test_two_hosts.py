"""Two "hosts" on one machine: the learner in one network namespace, a generator in another,
joined by a veth pair that this test makes and removes (no traffic leaves the machine).

The generator gets no ``model=`` and cannot read the learner's run directory (its own mount
namespace hides it under an empty tmpfs), so the run can only start if version 0 (the base model)
is announced at start and fetched over ZeroMQ; CURVE is on (the keys come from
``python -m vapo_async.transport.keys DIR`` exactly as the README's Scaling-out section types
them). Checks: v0 and v1..v3 reach the generator through its own weights cache (fetched), the
learner trains 4 steps with ``generators.local=0`` and exits 0, and the controller served chunks.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str]]:
    """(learner namespace, generator namespace, learner address): a /24 between two namespaces."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs iproute2 (ip) and util-linux (unshare)")
    tag = f"{os.getpid() % 100000}"
    ns_l, ns_g = f"vapo-l{tag}", f"vapo-g{tag}"
    net = f"10.231.{os.getpid() % 250 + 1}"
    try:
        _sh("ip", "netns", "add", ns_l)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"network namespaces are not allowed here: {getattr(e, 'stderr', e)}")
    try:
        _sh("ip", "netns", "add", ns_g)
        _sh("ip", "link", "add", f"vl{tag}", "type", "veth", "peer", "name", f"vg{tag}")
        _sh("ip", "link", "set", f"vl{tag}", "netns", ns_l)
        _sh("ip", "link", "set", f"vg{tag}", "netns", ns_g)
        for ns, dev, host in ((ns_l, f"vl{tag}", 1), (ns_g, f"vg{tag}", 2)):
            _sh("ip", "-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")  # vLLM's engine core talks over loopback
        yield ns_l, ns_g, f"{net}.1"
    finally:
        for ns in (ns_l, ns_g):  # deleting a namespace removes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


def _scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0})
    mux.AddRunsFromDirectory(str(tb_dir))
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in mux.Scalars(run, tag)})
    return out


def _keys(keys: Path) -> dict[str, str]:
    """The overrides ``python -m vapo_async.transport.keys DIR`` prints, by key."""
    out = subprocess.run([sys.executable, "-m", "vapo_async.transport.keys", str(keys)], env=_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.strip().split("=", 1) for line in out.splitlines() if "=" in line)


def test_remote_generator_without_model_or_shared_files_trains(
        two_hosts: tuple[str, str, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    ns_l, ns_g, addr = two_hosts
    learner_host = tmp_path / "learner_host"  # hidden from the generator
    run_dir = learner_host / "run"
    cache = tmp_path / "generator_host" / "cache"
    keys = _keys(tmp_path / "keys")
    endpoint = f"tcp://{addr}:5555"

    generator_cmd = [
        sys.executable, "-m", "vapo_async.generator", f"controller={endpoint}", "generator_id=remote-0",
        f"transport.curve.server_public_file={keys['transport.curve.server_public_file']}",
        f"transport.curve.client_secret_file={keys['transport.curve.client_secret_file']}",
        f"weights_cache={cache}", "max_prompts=4", "engine.kv_cache_bytes=33554432",
    ]
    learner_host.mkdir()
    # its own mount namespace with an empty tmpfs over the learner's directory: no shared filesystem
    hide = f"mount -t tmpfs tmpfs {learner_host} && exec \"$@\""
    gen_log = open(tmp_path / "generator.log", "w")  # noqa: SIM115 - closed below
    gen = subprocess.Popen(["ip", "netns", "exec", ns_g, "unshare", "--mount", "--propagation", "private",
                            "sh", "-c", hide, "sh", *generator_cmd],
                           env=_env(), stdout=gen_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        learner = subprocess.run(
            ["ip", "netns", "exec", ns_l, sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}",
             f"model.path={tiny_model_dir}", "trainer.accelerator=cpu", "trainer.max_steps=4",
             "generators.local=0", f"controller.transport.endpoint={endpoint}",
             f"controller.transport.curve.server_secret_file={keys['controller.transport.curve.server_secret_file']}",
             f"controller.transport.curve.authorized_keys_dir={keys['controller.transport.curve.authorized_keys_dir']}",
             "algo.batch_groups=2", "algo.group_size=4", "algo.mini_batches=1", "algo.value_warmup_steps=0",
             "algo.warmup_steps=0", "algo.eta=0", "sampling.max_tokens=16", "eval.every_n_steps=0",
             "data.n_train=32", "data.n_eval=8", "checkpoint.keep_weights=5", "trainer.enable_progress_bar=false",
             "batching.batch_timeout_s=300"],
            env=_env(), capture_output=True, text=True, timeout=420)
    finally:
        try:
            os.killpg(gen.pid, signal.SIGTERM)
            gen.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(gen.pid, signal.SIGKILL)
            gen.wait()
        gen_log.close()
    glog = (tmp_path / "generator.log").read_text(errors="replace")
    assert learner.returncode == 0, learner.stderr[-4000:] + "\n--- generator ---\n" + glog[-3000:]

    # the learner published v0 (the base) at start and v1..v4 after its four actor steps
    for v in range(5):
        assert (run_dir / "weights" / f"v{v:08d}" / "MANIFEST.json").is_file()
    # the generator started from v0 out of its own cache (it has no model= and cannot see run_dir)...
    started = re.search(r"serving tcp://\S+ \(engine version 0, context (\d+) tokens, model (\S+)\)", glog)
    assert started, glog[-3000:]
    assert started.group(2).startswith(str(cache)), started.group(2)
    # ... with the context the learner demanded in its welcome (longest prompt + 16, rounded to 64)
    assert int(started.group(1)) % 64 == 0 and int(started.group(1)) >= 16
    # and loaded every later version from its cache too (fetched in chunks over CURVE)
    loaded = {int(v): p for v, p in re.findall(r"weights version (\d+) loaded from (\S+)", glog)}
    assert {1, 2, 3} <= set(loaded), glog[-3000:]  # eta = 0: step k's batch was sampled with version k
    assert all(p.startswith(str(cache)) for p in loaded.values()), loaded
    # the bytes came over ZeroMQ (a readable path would have been hard-linked, not fetched): the
    # controller served at least v0..v3 in chunks
    served = max(_scalars(run_dir / "tb")["transport/fetch_bytes"].values())
    sizes = sum((run_dir / "weights" / f"v{v:08d}" / "model.safetensors").stat().st_size for v in range(4))
    assert served >= sizes, (served, sizes)
    # its weight relay server listened on its own host's address (the route to the learner: x.x.x.2),
    # for generators that would fetch after it
    relay = re.search(r"weight relay server at tcp://(\S+):\d+ ", glog)
    assert relay and relay.group(1) == addr.rsplit(".", 1)[0] + ".2", glog[-3000:]
