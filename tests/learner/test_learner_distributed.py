"""A training step on 2 CPU ranks (gloo) with FSDP2 and with DDP (replicate-only FSDP2) equals the
single-device step on the same batch: same published actor weights and critic weights. The 2-rank
version is published by both ranks, one shard file each, and equals the actor gathered by torch's
own full-state-dict API bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def _single_device(model_dir: Path, run_dir: Path) -> tuple[dict, dict]:
    sys.path.insert(0, str(HERE))
    from dist_step_script import build, critic_state

    module, trainer = build(str(model_dir), str(run_dir), "single", 1)
    trainer.fit(module)
    module.publishing.close()
    assert module.state.version == 1
    return _published(run_dir / "weights" / "v00000001"), critic_state(module)


def _published(d: Path) -> dict:
    out: dict = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _two_ranks(model_dir: Path, run_dir: Path, strategy: str) -> tuple[dict, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    strategy, _, layout = strategy.partition("+")
    proc = subprocess.run([sys.executable, str(HERE / "dist_step_script.py"), str(model_dir), str(run_dir),
                           strategy, "2", layout], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = run_dir / "weights" / "v00000001"
    assert sorted(p.name for p in d.glob("*.safetensors")) == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    published, gathered = _published(d), load_file(str(run_dir / "actor.safetensors"))
    assert set(published) == set(index) and set(gathered) >= set(published)
    for k, v in published.items():  # each rank wrote its share; together: the actor, bit for bit
        assert torch.equal(v, gathered[k]), k
    return published, load_file(str(run_dir / "critic.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    return _single_device(tiny_model_dir, tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "fsdp+packed"])
def test_two_rank_step_equals_single_device(strategy, reference, tiny_model_dir, tmp_path):
    """``fsdp+packed``: the 2 ranks plan packed rows (``batching.packing``) against the padded
    single-device reference: the rows reach every rank and the step is the same."""
    actor_1, critic_1 = reference
    actor_2, critic_2 = _two_ranks(tiny_model_dir, tmp_path, strategy)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(actor_1) == set(actor_2) == set(base)
    moved = 0
    for k in actor_1:
        torch.testing.assert_close(actor_2[k], actor_1[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"actor {k}: {m}")
        moved += int(not torch.equal(actor_1[k], base[k]))
    assert moved > len(base) // 2  # the step really changed the actor
    assert set(critic_1) == set(critic_2)
    for k in critic_1:
        torch.testing.assert_close(critic_2[k], critic_1[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"critic {k}: {m}")
