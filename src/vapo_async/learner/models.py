"""Actor and critic: Hugging Face models, their forward passes, FSDP2 sharding and weight export.

- Actor: ``AutoModelForCausalLM`` from the base model directory.
- Critic: ``AutoModelForTokenClassification`` with one label (a scalar value per token) on the
  same architecture, initialised from the base model (value head zeroed, so every initial value is
  exactly 0) or from a reward-model directory (its head is kept). Classifier dropout is 0 so the
  values recomputed without gradient equal the ones trained on.
- ``shard``: FSDP2 ``fully_shard`` on every transformer block (the model's ``_no_split_modules``)
  and then on the root, over a 1-D mesh (FSDP, ZeRO-3) or a 2-D (replicate, shard) mesh (HSDP;
  with shard size 1 this is DDP).

Notation: b sequences of a micro-batch, T padded length, Tr padded response length, V vocabulary.

Departures: VAPO initialises the critic from a reward model; with no reward model (the tiny
default) it starts from the base model's backbone, as VC-PPO's ablations and most open
implementations do.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from vapo_async.learner.batching import MicroBatch

log = logging.getLogger(__name__)


def load_actor(path: str | Path, gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The policy, float32 master weights (mixed precision is applied by FSDP2 / autocast)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()  # from_pretrained returns eval mode; no dropout either way


def load_critic(base_path: str | Path, critic_path: str | Path | None = None,
                gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The token-level value model: ``critic_path`` (a reward model with a 1-label head) if given,
    else the base model's backbone with a zero-initialised value head."""
    path = str(critic_path or base_path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_labels = 1
    cfg.id2label = {0: "value"}
    cfg.label2id = {"value": 0}
    cfg.classifier_dropout = 0.0
    cfg.use_cache = False
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the expected "score.* newly initialised / lm_head unused" report
    try:
        model = AutoModelForTokenClassification.from_pretrained(path, config=cfg, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    if critic_path is None:
        head = value_head(model)
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def value_head(critic: nn.Module) -> nn.Linear:
    """The critic's final (hidden -> 1) projection."""
    for name in ("score", "classifier"):
        head = getattr(critic, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise TypeError(f"{type(critic).__name__} has no 'score'/'classifier' linear value head")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` (modules whose class is in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise TypeError(f"cannot find the transformer blocks of {type(model).__name__} "
                        f"(_no_split_modules={sorted(names)})")
    return found


def shard(model: nn.Module, mesh: object, mixed_precision: torch.dtype | None = None,
          reshard_after_forward: bool = True) -> None:
    """Apply FSDP2 ``fully_shard`` per transformer block, then to the root (in place).

    ``mesh``: a 1-D DeviceMesh (shard over it) or a 2-D one (replicate over dim 0, shard over dim 1).
    ``mixed_precision``: compute/all-gather dtype (bf16 on GPU); gradients are reduced in float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32) \
        if mixed_precision is not None else MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def _keep_from(mb: MicroBatch) -> int:
    """First position whose logits are needed: min_i(P_i) - 1 (prompts before it need none)."""
    first = int(mb.resp_index[:, 0].min()) if mb.resp_index.numel() else 0
    return max(first, 0)


def actor_logits(actor: nn.Module, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """(b, Tr, V) float32 next-token logits / temperature at the response positions.

    The behaviour policy sampled from softmax(logits / temperature), so pi_prox and pi_theta use
    the same scaling (otherwise every ratio would be off by the temperature)."""
    start = _keep_from(mb)
    t = mb.input_ids.shape[1]
    out = actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=t - start)
    logits = out.logits  # (b, T - start, V): positions start .. T - 1
    idx = (mb.resp_index - start).clamp(min=0, max=logits.shape[1] - 1)
    picked = logits.gather(1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))
    return picked.float() / temperature


def critic_values(critic: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(b, Tr) float32 values V(s_t) of the state before each response token."""
    out = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    values = out.logits.squeeze(-1)  # (b, T)
    return values.gather(1, mb.resp_index).float()


def export_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the actor's full state dict) as a Hugging Face checkpoint holds it: tied output
    embeddings dropped (safetensors refuses shared tensors; loaders re-tie them)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state
