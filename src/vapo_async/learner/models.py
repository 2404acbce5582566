"""Actor and critic: Hugging Face models, their forward passes, FSDP2 sharding and weight export.

- Actor: ``AutoModelForCausalLM`` from the base model directory.
- Critic: ``AutoModelForTokenClassification`` with one label (a scalar value per token) on the
  same architecture, initialised from the base model (value head zeroed, so every initial value is
  exactly 0) or from a reward-model directory (its head is kept). Classifier dropout is 0 so the
  values recomputed without gradient equal the ones trained on.
- ``shard``: FSDP2 ``fully_shard`` on every transformer block (the model's ``_no_split_modules``)
  and then on the root, over a 1-D mesh (FSDP, ZeRO-3) or a 2-D (replicate, shard) mesh (HSDP;
  with shard size 1 this is DDP).

Notation: b sequences and n rows of a micro-batch (n = b when padded), T row length, Tr padded
response length, H hidden size, V vocabulary. The actor's log-probs and entropy come from its
final hidden states in token chunks (``actor_logprobs``): no (b, Tr, V) logits tensor exists in a
step.

Packed micro-batches (``MicroBatch.packed``) go through transformers' own packed-sequence path:
``position_ids`` restarting at 0 per sequence and no attention mask, from which the model builds a
block-diagonal causal mask (SDPA, eager) or runs variable-length kernels (flash attention), so
attention never crosses sequences and positions are each sequence's own. With
``batching.packed_attention=segments`` (the CPU default) an SDPA model runs
``learner/attention.py`` instead: SDPA per sequence, no dense mask.

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
from vapo_async.learner.attention import SEGMENTS
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


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` the forward of every transformer block of ``model`` in place
    (``nn.Module.compile``: parameter names and state dicts are unchanged), with dynamic shapes so
    micro-batches of every length share one graph. Call after ``shard``: FSDP2's hooks stay
    outside the compiled region."""
    for block in blocks(model):
        block.compile(dynamic=True)


PACKED_ATTENTION = ("sdpa", SEGMENTS, "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations that keep packed sequences apart given their ``position_ids``."""


def model_inputs(model: nn.Module, mb: MicroBatch) -> dict[str, torch.Tensor | bool]:
    """Keyword arguments of ``model``'s forward for ``mb``: the attention mask when padded;
    ``position_ids`` without a mask and without a KV cache when packed (transformers detects
    packed rows only then; with a cache it would silently attend across sequences)."""
    if not mb.packed:
        return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        raise ValueError(f"packed micro-batches need one of the attention implementations {PACKED_ATTENTION}, "
                         f"{type(model).__name__} uses {impl!r}: set batching.packing=false")
    assert mb.position_ids is not None
    return {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}


def _keep_from(mb: MicroBatch) -> int:
    """First position whose logits are needed: min_i(P_i) - 1 (prompts before it need none)."""
    first = int(mb.resp_index[:, 0].min()) if mb.resp_index.numel() else 0
    return max(first, 0)


def actor_logprobs(actor: nn.Module, mb: MicroBatch, temperature: float,
                   chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, Tr) float32 log pi(response token) and (b, Tr) entropy of pi at the response positions
    (0 where ``mb.resp_mask`` is 0), pi = softmax(logits / temperature), without the (b, Tr, V)
    logits (``algo/chunked.py``).

    The behaviour policy sampled from softmax(logits / temperature), so pi_prox and pi_theta use
    the same scaling (otherwise every ratio would be off by the temperature). The output layer runs
    inside the model's own forward (its ``forward`` is swapped for the call), so FSDP2 has gathered
    its weight there and takes its gradient back as for any layer."""
    start = _keep_from(mb)
    head = actor.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("actor_logprobs: an output layer with a bias is not supported")
    b, tr = mb.response_ids.shape
    width = mb.input_ids.shape[1] - start  # kept columns start .. T - 1 of every row
    # only the K real response tokens go through the output layer (a packed micro-batch mixes
    # short and long responses: its (b, Tr) view is mostly padding)
    valid = (mb.resp_mask.reshape(-1) > 0).nonzero().squeeze(1)  # (K,) into the flat (b * Tr) view
    rows = mb.resp_row[:, None].expand(b, tr).reshape(-1)[valid]  # (K,) row of each token's predictor
    cols = (mb.resp_index - start).clamp(min=0).reshape(-1)[valid]  # (K,) its column among the kept ones
    targets = mb.response_ids.reshape(-1)[valid]  # (K,)

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (n, width, H) -> (1, b * Tr, 2), 0 on padding
        logp, ent = logprob_entropy(hidden[rows, cols], head.weight, targets, temperature, chunk)  # (K,) each
        pair = torch.stack([logp, ent], dim=-1)  # (K, 2)
        return pair.new_zeros(b * tr, 2).index_put((valid,), pair)[None]

    head.forward = forward  # an instance attribute: nn.Module.__call__ takes it over the class's
    try:
        out = actor(**model_inputs(actor, mb), logits_to_keep=width)
    finally:
        del head.forward
    pair = out.logits.view(b, tr, 2)
    return pair[..., 0], pair[..., 1]


def critic_values(critic: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(b, Tr) float32 values V(s_t) of the state before each response token."""
    out = critic(**model_inputs(critic, mb))
    values = out.logits.squeeze(-1)  # (n, T)
    return values[mb.resp_row[:, None], mb.resp_index].float()


def export_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the actor's full state dict) as a Hugging Face checkpoint holds it: tied output
    embeddings dropped (safetensors refuses shared tensors; loaders re-tie them)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state
