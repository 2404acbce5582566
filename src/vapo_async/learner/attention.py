"""Packed-row attention without a dense mask: SDPA once per sequence of a row ("sdpa_segments").

A packed row holds several sequences back to back, ``position_ids`` restarting at 0 for each
(``learner/batching.py``). Transformers' SDPA path keeps them apart with a dense (T, T)
block-diagonal causal mask, so a row of C tokens pays C^2 in attention however its sequences
split it, and the mask itself is materialised per micro-batch. Varlen flash attention (GPU) pays
sum_i L_i^2 instead; this module is that on any device: it is registered with transformers as
the attention implementation ``SEGMENTS`` and runs ``scaled_dot_product_attention`` with
``is_causal`` on each sequence's slice of the row, which is exactly the block-diagonal causal
attention (a token attends to its own sequence's earlier tokens, nothing else).

Notation: B rows, Hq query heads, Hkv key/value heads, T row length, D head size, L one
sequence's length.

- Mask creation is skipped for packed rows (``segments_mask`` returns None when there is no 2-D
  padding mask, the packed case), so no (B, 1, T, T) tensor exists.
- A padded micro-batch (a 2-D attention mask, one right-padded sequence per row) goes through
  transformers' own SDPA path unchanged, mask included.
- Segments are where ``position_ids`` stops counting up by one (transformers' own rule,
  ``masking_utils.find_packed_sequence_indices``); a row's padding tail, numbered 0.. by
  ``collate``, is one more segment whose outputs nothing reads.

Cost: one SDPA call per sequence per layer (a Python loop over ~C / L_mean slices): on CPU a few
microseconds each against milliseconds of matmuls; on a GPU it is one kernel launch per sequence,
which is why ``batching.packed_attention`` resolves to the dense mask there (flash attention,
where installed, is the GPU's varlen path). The loop is excluded from ``torch.compile``
(``model.compile``): a graph per segment structure would recompile every micro-batch.

Departures: none (attention is the model's own; only the kernel's iteration differs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SEGMENTS = "sdpa_segments"
"""The name under which this implementation is registered with transformers."""


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids`` (B, T), the [start, end) column ranges of its sequences: a new
    sequence starts at column 0 and wherever a position is not the previous one plus 1."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    t = position_ids.shape[1]
    out = []
    for row in starts.tolist():
        cuts = [i for i, s in enumerate(row) if s] + [t]
        out.append(list(zip(cuts[:-1], cuts[1:], strict=True)))
    return out


@torch.compiler.disable
def segments_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention output (B, T, Hq, D) of query (B, Hq, T, D) against key/value (B, Hkv, T, D):
    with ``position_ids`` (B, T) or (1, T) in ``kwargs`` and no mask (packed rows), causal SDPA
    on each sequence's slice; otherwise transformers' SDPA as is (padded rows, decoding)."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("attention by segments has no sliding window (use_segments leaves such models on "
                         "SDPA): set batching.packed_attention=mask")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "is_causal")}
    bounds = segment_bounds(position_ids.expand(query.shape[0], -1))
    if all(len(segs) == 1 for segs in bounds):  # one sequence per row: a single causal call
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    rows = []
    for r, segs in enumerate(bounds):
        parts = [sdpa_attention_forward(module, query[r:r + 1, :, s:e], key[r:r + 1, :, s:e],
                                        value[r:r + 1, :, s:e], None, dropout=dropout, scaling=scaling,
                                        is_causal=True, **kwargs)[0]  # (1, L, Hq, D)
                 for s, e in segs]
        rows.append(torch.cat(parts, dim=1))  # (1, T, Hq, D)
    return torch.cat(rows, dim=0), None


def segments_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask transformers builds for ``SEGMENTS``: none for packed rows (no 2-D padding mask:
    the attention finds the sequences in ``position_ids``), SDPA's own mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make ``SEGMENTS`` a transformers attention implementation (idempotent)."""
    AttentionInterface.register(SEGMENTS, segments_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTS, segments_mask)


def set_packed_attention(models: Iterable[torch.nn.Module | None], mode: str) -> None:
    """Give every model of ``models`` (None skipped) the packed-row attention ``mode``:
    ``segments`` switches SDPA models to ``SEGMENTS``; ``mask`` keeps transformers' dense mask."""
    if mode not in ("segments", "mask"):
        raise ValueError(f"packed attention must be segments or mask, got {mode!r}")
    for m in models:
        if m is not None and mode == "segments":
            use_segments(m)


def use_segments(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers model on SDPA) to ``SEGMENTS``; True if it switched.
    Other implementations (flash attention's varlen kernels, eager) and models with sliding-window
    layers (their window is in transformers' mask) are left as they are."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False  # the window lives in transformers' mask, which SEGMENTS does not build
    register()
    model.set_attn_implementation(SEGMENTS)
    return model.config._attn_implementation == SEGMENTS
