"""One rank of a 2-rank FSDP2 (gloo, CPU) publisher: the tiny model with test version V's weights,
sharded over both ranks, published with the learner's ``WeightPublishing`` (each rank writes its
share). Run twice, with RANK=0 and RANK=1 (and MASTER_ADDR/MASTER_PORT/WORLD_SIZE) in the environment:

    python tests/generator/publish_ranks_script.py MODEL_DIR ROOT VERSION DTYPE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    import torch
    import torch.distributed as dist
    from genhelp import version_state_dict
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    from vapo_async.learner.publish import WeightPublishing

    model_dir, root, version, dtype = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(version_state_dict(load_file(str(model_dir / "model.safetensors")), version), strict=False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pub = WeightPublishing(root, str(model_dir), keep=2, rank=rank, world=world,
                           dtype=getattr(torch, dtype), finalize_timeout_s=120)
    ann = pub.publish(model, version)
    pub.close()
    if rank == 0:
        print("PUBLISHED", ann.path, flush=True)
    dist.destroy_process_group()
    os._exit(0)
