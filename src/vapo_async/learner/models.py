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
The actor's log-probs and entropy come from its final hidden states in token chunks
(``actor_logprobs``): no (b, Tr, V) logits tensor exists in a step.

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

from vapo_async.algo.chunked import DEFAULT_CHUNK, logprob_entropy
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


def actor_logprobs(actor: nn.Module, mb: MicroBatch, temperature: float,
                   chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, Tr) float32 log pi(response token) and (b, Tr) entropy of pi at the response positions,
    pi = softmax(logits / temperature), without the (b, Tr, V) logits (``algo/chunked.py``).

    The behaviour policy sampled from softmax(logits / temperature), so pi_prox and pi_theta use
    the same scaling (otherwise every ratio would be off by the temperature). The output layer runs
    inside the model's own forward (its ``forward`` is swapped for the call), so FSDP2 has gathered
    its weight there and takes its gradient back as for any layer."""
    start = _keep_from(mb)
    head = actor.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("actor_logprobs: an output layer with a bias is not supported")
    b, tr = mb.response_ids.shape
    idx = (mb.resp_index - start).clamp(min=0)  # (b, Tr) rows of the kept positions start .. T - 1

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (b, T - start, H) -> (b, Tr, 2)
        h = hidden.gather(1, idx[:, :, None].expand(-1, -1, hidden.shape[-1])).reshape(b * tr, -1)
        logp, ent = logprob_entropy(h, head.weight, mb.response_ids.reshape(-1), temperature, chunk)
        return torch.stack([logp, ent], dim=-1).view(b, tr, 2)

    head.forward = forward  # an instance attribute: nn.Module.__call__ takes it over the class's
    try:
        out = actor(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                    logits_to_keep=mb.input_ids.shape[1] - start)
    finally:
        del head.forward
    return out.logits[..., 0], out.logits[..., 1]


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
