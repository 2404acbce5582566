"""One learner training step on a fixed batch with a given strategy; writes the weights it publishes
and the critic's state. Run as a script (Lightning re-runs it for ranks > 0):

    python tests/learner/dist_step_script.py MODEL_DIR RUN_DIR STRATEGY DEVICES
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(model_dir: str, run_dir: str, strategy: str, devices: int, packing: bool = False):
    """The module and trainer of the step (shared with the in-process single-device test)."""
    import lightning as L
    from learner_helpers import make_groups

    from vapo_async.algo.presets import preset
    from vapo_async.learner.config import LearnerConfig
    from vapo_async.learner.module import LearnerModule
    from vapo_async.learner.prepare import build_strategy
    from vapo_async.learner.stream import ListSource

    cfg = LearnerConfig()
    cfg.algo = dataclasses.replace(preset("vapo"), value_warmup_steps=0, batch_groups=4, group_size=4,
                                   mini_batches=2, actor_lr=1e-3, critic_lr=1e-3, warmup_steps=0)
    cfg.trainer.strategy = strategy
    cfg.trainer.devices = devices
    cfg.trainer.accelerator = "cpu"
    cfg.batching.micro_batch_tokens = 48
    cfg.batching.packing = packing
    cfg.sampling.temperature = 0.8
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    module = LearnerModule(cfg, model_dir, run_dir, source=ListSource(make_groups(4, 4, vocab=300, seed=21)) if rank0 else None)
    lstrategy, precision = build_strategy(cfg)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=lstrategy, precision=precision, max_steps=1,
                        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    return module, trainer


def full_state(model) -> dict:
    """The full state dict on CPU, gathered by torch's own API (rank 0 under FSDP2; a collective):
    the reference the published shards are compared with."""
    import torch
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def critic_state(module) -> dict:
    return full_state(module.critic)


if __name__ == "__main__":
    model_dir, run_dir, strategy, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    module, trainer = build(model_dir, run_dir, strategy, devices, packing="packed" in sys.argv[5:])
    trainer.fit(module)
    state = critic_state(module)  # collectives under FSDP2
    actor = full_state(module.actor)
    module.publishing.close()
    if trainer.global_rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(run_dir) / "critic.safetensors"))
        save_file({k: v.contiguous() for k, v in actor.items()}, str(Path(run_dir) / "actor.safetensors"))
