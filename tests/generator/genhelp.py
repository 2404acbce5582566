"""Helpers of the generator tests: published weight versions, engines, transformers references.

Weight versions are written with the real ``WeightPublisher`` (MANIFEST, checksums) under one
weights root. Version v is the tiny random model with its output layer scaled up (a random tiny
model is almost uniform over the vocabulary, which would make log-prob comparisons weak) plus
seeded noise, so different versions give clearly different distributions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from vapo_async.common.sampling import GroupSamplingConfig
from vapo_async.generator.engine import Completion
from vapo_async.transport.messages import WeightAnnouncement
from vapo_async.transport.publisher import WeightPublisher

LM_HEAD_SCALE = 20.0
"""Logit std ~ 0.02 * sqrt(128) * 20 ~ 4.5 nats: peaked next-token distributions."""


def version_state_dict(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """Weights of test version ``version``: base + N(0, (0.3 * std)^2) noise, sharpened head."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for name, w in base.items():
        noisy = w + 0.3 * w.float().std().clamp_min(1e-3) * torch.randn(w.shape, generator=g)
        out[name] = noisy * LM_HEAD_SCALE if name == "lm_head.weight" else noisy
    return out


@dataclass
class Published:
    """Versions published under ``root`` on demand."""

    root: Path
    publisher: WeightPublisher
    base: dict[str, torch.Tensor]
    anns: dict[int, WeightAnnouncement] = field(default_factory=dict)

    def publish(self, version: int) -> WeightAnnouncement:
        if version not in self.anns:
            self.anns[version] = self.publisher.publish(version, version_state_dict(self.base, version))
        return self.anns[version]

    def dir(self, version: int) -> Path:
        return Path(self.publish(version).path)


def generate(engine, prompts: list[str], sampling: GroupSamplingConfig) -> list[Completion]:
    """Sample ``prompts`` to completion (request ids r0, r1, ...), sorted by request id."""
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, sampling)
    done: list[Completion] = []
    while engine.has_work():
        done += engine.step()
    return sorted(done, key=lambda c: c.request_id)


def make_engine(model_dir: Path, version: int, multiprocessing: bool = True):  # -> VLLMEngine
    from vapo_async.common.engine import EngineConfig
    from vapo_async.generator.engine import VLLMEngine

    cfg = EngineConfig(max_model_len=384, seed=0, multiprocessing=multiprocessing)
    return VLLMEngine(model_dir, cfg, version=version)


_HF: dict[Path, Qwen2ForCausalLM] = {}


def hf(path: Path) -> Qwen2ForCausalLM:
    if path not in _HF:
        _HF[path] = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    return _HF[path]


def _gather(logits: torch.Tensor, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """logits (L, V), tokens (L,) -> log_softmax(logits / T)[t, tokens[t]] (L,)."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


@torch.no_grad()
def hf_logprobs(model: Qwen2ForCausalLM, prompt: np.ndarray, resp: np.ndarray, temperature: float) -> np.ndarray:
    """Teacher-forced log pi(resp_t | prompt, resp_<t) with one set of weights, (L,)."""
    ids = torch.as_tensor(np.concatenate([prompt, resp]), dtype=torch.long)[None]
    P, L = len(prompt), len(resp)
    return _gather(model(ids).logits[0, P - 1:P + L - 1], resp, temperature)


@torch.no_grad()
def hf_logprobs_switched(old: Qwen2ForCausalLM, new: Qwen2ForCausalLM, prompt: np.ndarray, resp: np.ndarray,
                         k: int, temperature: float) -> np.ndarray:
    """What vLLM computes when weights change after response token k-1 was sampled (1 <= k < L):
    the old weights computed the KV of prompt + resp[:k-1] and the distributions of resp[0..k-1];
    the new weights compute resp[k-1]'s KV onwards, attending to the old KV, and the
    distributions of resp[k..L-1]. (L,)"""
    P, L = len(prompt), len(resp)
    ctx = torch.as_tensor(np.concatenate([prompt, resp[:k - 1]]), dtype=torch.long)[None]
    out = old(ctx, use_cache=True)
    head = _gather(out.logits[0, P - 1:], resp[:k], temperature)
    rest = torch.as_tensor(resp[k - 1:L - 1], dtype=torch.long)[None]
    tail = _gather(new(rest, past_key_values=out.past_key_values).logits[0], resp[k:], temperature)
    return np.concatenate([head, tail])
