"""Typed configuration of ``python -m vapo_async.learner`` (Hydra; ``conf/learner.yaml``).

Every node is a dataclass registered in Hydra's ConfigStore (``learner_schema``), so a typo in an
override is an error. ``trainer`` holds ``lightning.Trainer`` arguments: the common ones are fields
here; any other Trainer argument can be added with ``+trainer.NAME=VALUE`` and is checked against
``Trainer.__init__``. ``algo`` is ``vapo_async.algo.presets.AlgoConfig`` (presets in conf/algo/).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vapo_async.algo.presets import AlgoConfig
from vapo_async.common.sampling import SamplingConfig
from vapo_async.controller.config import ControllerConfig
from vapo_async.data import DataConfig
from vapo_async.data.tiny_base import TinyBaseConfig
from vapo_async.learner.errors import (
    ConfigError as ConfigError,  # re-export: callers import it here
)
from vapo_async.learner.model_presets import check_model_preset
from vapo_async.learner.trainer_config import STRATEGIES, TrainerConfig, trainer_kwargs
from vapo_async.rewards import RewardConfig
from vapo_async.transport.digest import HASHES


def _mutable_mirror(cls: type, name: str) -> type:
    """A non-frozen dataclass with the fields and defaults of frozen ``cls`` (OmegaConf makes frozen
    dataclasses read-only, which would forbid overrides)."""
    hints = typing.get_type_hints(cls)
    specs = [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(cls)]
    mirror = dataclasses.make_dataclass(name, specs)
    mirror.__doc__ = f"Mutable mirror of ``{cls.__module__}.{cls.__name__}`` (field docs there)."
    return mirror


if TYPE_CHECKING:  # same fields; checkers need a static class
    import torch

    TinyModelConfig = TinyBaseConfig
else:
    TinyModelConfig = _mutable_mirror(TinyBaseConfig, "TinyModelConfig")


@dataclass
class ModelConfig:
    """Which model the actor and critic start from."""

    name: str = "tiny"
    """Label of the preset (conf/model/NAME.yaml); ``tiny`` refuses a ``path`` (its knobs fit only
    the tiny base)."""
    path: str | None = None
    """Hugging Face directory (or hub id where the hub is reachable); None = the tiny base model,
    built on first use from ``tiny`` and cached. Given without ``model=``, it means ``model=hf``
    (learner/model_presets.py)."""
    critic_path: str | None = None
    """Reward-model directory to initialise the critic from (one-label token head); None = the
    base model's backbone with a zero value head."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Tiny-base build settings (used when ``path`` is None)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on long responses)."""
    compile: bool = False
    """``torch.compile`` every transformer block of actor and critic (dynamic shapes: one graph for
    every micro-batch length). Off by default: on the tiny model (CPU, one thread) a step took 6.35 s
    compiled vs 8.57 s eager (benchmarks/results/bench_learner_compile.md, _eager.md), at ~30M 106.4 s
    vs 110.4 s (1.04x, bench_learner_30m_compile.md), while the first step pays 11-35 s of
    compilation at every learner start; not yet measured on GPU."""

    def tiny_base_config(self) -> TinyBaseConfig:
        """``tiny`` as the data package's (frozen) ``TinyBaseConfig``."""
        return TinyBaseConfig(**dataclasses.asdict(self.tiny))


@dataclass
class GeneratorsConfig:
    """Generator processes the learner starts itself (more can join from anywhere)."""

    local: int = 1
    """Local generator processes started by learner rank 0 and stopped on exit."""
    max_prompts: int = 16
    """Prompts each local generator keeps in flight (its credit; x G sequences decoded together)."""
    max_model_len: int | None = None
    """Engine context length; None = longest prompt + sampling.max_tokens, rounded up to 64."""
    kv_cache_bytes: int | None = None
    """Engine KV-cache size (CPU default 256 MiB, see the generator config)."""
    overrides: list[str] = field(default_factory=list)
    """Extra Hydra overrides of conf/generator.yaml for local generators (e.g. engine.seed=3)."""
    env: list[str] = field(default_factory=list)
    """Extra environment of local generators, ``KEY=VALUE`` (e.g. VLLM_CPU_OMP_THREADS_BIND=1)."""
    stop_timeout_s: float = 30.0
    """How long local generators get to leave on SIGTERM before SIGKILL."""
    restart_backoff_s: float = 5.0
    """A local generator that dies is restarted after this long, doubled for each death that
    follows a short life (learner/supervise.py)."""
    max_restarts: int = 10
    """Restarts of local generators allowed per hour before the run stops; 0 = never restart."""
    tensor_parallel_size: int = 1
    """Tensor parallelism of each local generator's engine (its number of GPUs)."""
    devices: list[int] | None = None
    """GPU: CUDA devices of the local generators as the learner sees them, tensor_parallel_size
    consecutive entries per generator (e.g. [6,7]); None = the devices the learner does not use,
    then the learner's own (learner/placement.py)."""
    gpu_memory_utilization: float | None = None
    """GPU: share of each of its devices a local generator's vLLM may take; None = an equal part of
    what the learner and the evaluation engine leave there (0.9 on a device of its own)."""
    learner_memory_share: float = 0.5
    """GPU: share of a learner device counted for the learner (weights, optimiser, activations)
    where a local generator or the evaluation engine shares it. PyTorch does not cap it: set it to
    the learner's real peak (tools/device_check.sh prints it)."""


@dataclass
class BatchingConfig:
    """How a global batch is cut for the hardware (does not change the maths)."""

    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward micro-batch (memory bound)."""
    micro_batch_overhead_tokens: int | None = None
    """Cost of one more micro-batch in token-equivalents (launch/Python overhead): micro-batches
    are cut where the padding saved exceeds it. None: 256 on CPU, 8192 on a GPU (an H200 with a
    0.5B model sat idle two thirds of each step on 4k-token micro-batches: tools/device_check.sh)."""
    packing: bool = False
    """Pack whole sequences back to back into rows of up to ``pack_row_tokens`` tokens, positions
    restarting per sequence and attention never crossing sequences (transformers' packed path from
    ``position_ids``: a block-diagonal causal mask with SDPA, varlen kernels with flash attention),
    instead of one right-padded sequence per row. Same log-probs, values, losses and gradients
    either way (tests/learner/test_learner_packing.py). Off by default: on CPU with transformers'
    dense block-diagonal mask it cut padding from 5-7% to 1-2% of tokens but a step was 0-15%
    slower (a row of C tokens pays C^2 in attention); ``packed_attention`` (SDPA per sequence, the
    CPU default since 2026-12-07) removes that cost; at 30M a packed step then times within 2% of a padded one
    (benchmarks/results/bench_learner_30m_rows2048_segments.md), too close to change the default
    without a default run on it."""
    packed_attention: str = "auto"
    """How an SDPA model keeps the sequences of a packed row apart: ``segments`` runs SDPA once per
    sequence (sum_i L_i^2 attention work, no mask; ``learner/attention.py``), ``mask`` uses
    transformers' dense block-diagonal mask (C^2 per row of C tokens), ``auto``: segments on CPU,
    mask on a GPU (one kernel launch per sequence would cost more there; install flash attention
    for the GPU's varlen kernels). Models on another attention implementation keep it."""
    pack_row_tokens: int = 0
    """Capacity C of a packed row in tokens; 0 = the batch's longest sequence (a sequence longer
    than C gets a row of its own). Varlen flash attention does not pay for long rows: up to
    ``micro_batch_tokens`` there (one row per micro-batch)."""
    batch_timeout_s: float = 1800.0
    """Longest wait for rollouts in one step before the learner gives up with an error."""
    max_sampling_rounds: int = 8
    """Dynamic sampling / stale refills: most pulls per step (then train on a partial batch)."""

    def packed_attention_for(self, device_type: str) -> str:
        """``packed_attention``, resolved for a ``torch.device.type`` (``segments`` or ``mask``)."""
        if self.packed_attention not in ("auto", "segments", "mask"):
            raise ValueError(f"batching.packed_attention must be auto, segments or mask, got {self.packed_attention!r}")
        if self.packed_attention != "auto":
            return self.packed_attention
        return "segments" if device_type == "cpu" else "mask"

    def overhead_for(self, device_type: str) -> int:
        """``micro_batch_overhead_tokens``, resolved for a ``torch.device.type``."""
        if self.micro_batch_overhead_tokens is not None:
            return self.micro_batch_overhead_tokens
        return 256 if device_type == "cpu" else 8192


@dataclass
class LoggingConfig:
    """TensorBoard output."""

    histograms_every_n_steps: int = 5
    """Staleness and behaviour-weight histograms every N steps (0 = never)."""
    text_every_n_steps: int = 10
    """Sampled responses as text every N steps (0 = never)."""
    text_samples: int = 4
    """Responses shown each time."""
    print_tensorboard_command: bool = True
    """Print ``tensorboard --logdir ...`` at start-up."""
    mismatch_warn_kl: float = 0.01
    """A warning line when ``mismatch/kl`` (generator vs learner log-probs of the tokens sampled
    with the learner's current version, ``algo/mismatch.py``) passes this value, once per crossing
    (measured on the tiny model on CPU: fp32 pair ~5e-14, a bf16 generator against the fp32 learner
    ~8e-7; k3 is second order in the log-prob gap, so 0.01 means gaps of ~0.1 nat on average)."""


@dataclass
class EvalConfig:
    """Held-out accuracy during training (``eval/accuracy``), sampled on learner rank 0."""

    every_n_steps: int = 0
    """Evaluate every N training steps (0 = never; also at step 0 when > 0)."""
    n_prompts: int = 64
    """Held-out prompts (from ``data``'s eval split)."""
    samples: int = 16
    """Samples per prompt (the metric is avg@samples)."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation."""
    top_p: float = 1.0
    """Nucleus mass of the evaluation (1.0: the distribution the policy trains on; the papers'
    AIME 2024 numbers: 0.7)."""
    data: DataConfig | None = None
    """Held-out prompts from this dataset's eval split instead of ``data``'s (the paper presets:
    ``{name: aime}``, AIME 2024, while training on dapo_math)."""
    max_tokens: int | None = None
    """Response limit; None = sampling.max_tokens."""
    batch_size: int = 256
    """Sequences generated together (``hf`` engine)."""
    background: bool = True
    """Evaluate in a thread beside training (at most one at a time) instead of pausing it."""
    engine: str = "vllm"
    """Sampler: ``vllm`` (one engine in rank 0's process, reloaded per version) or ``hf``
    (transformers generate: no extra engine, much slower on CPU)."""
    gpu_memory_utilization: float = 0.1
    """GPU, engine=vllm: share of CUDA device 0 the evaluation engine may take, counted beside the
    learner's and any local generator's there (learner/placement.py)."""


@dataclass
class CheckpointConfig:
    """Lightning checkpoints under ``RUN_DIR/checkpoints`` and published weights."""

    every_n_steps: int = 10
    """Save ``last.ckpt`` every N training steps (and at the end)."""
    distributed: bool = False
    """FSDP2: each rank writes its shards (a directory) instead of one full file on rank 0."""
    keep_weights: int = 3
    """Published weight versions kept under ``RUN_DIR/weights`` (>= 2)."""
    fingerprint: bool = True
    """Log a sha256 of the optimiser states when saving and after resuming (exact-resume check)."""


@dataclass
class WeightsConfig:
    """Published weight versions under ``RUN_DIR/weights``: what generators and the evaluation load
    (written in the background, ``learner/publish.py``)."""

    dtype: str = "auto"
    """Floating tensors in the files: ``auto`` = bfloat16 when the learner computes in bf16
    (``trainer.precision`` bf16-*), else float32; or float32, bfloat16, float16."""
    hash: str = "xxh3_128"
    """File digests in MANIFEST.json: xxh3_128 (memory speed) or sha256."""
    fsync: bool = True
    """fsync every file before the version is renamed into place (after a machine crash no version
    name holds an empty file)."""
    shard_gib: float = 4.0
    """Largest safetensors file, GiB (each rank's share is cut into files of at most this)."""
    finalize_timeout_s: float = 600.0
    """Rank 0 waits this long for the other ranks' files of a version, then fails the run."""
    delta: bool = False
    """Also write each version's safetensors files as zstd(XOR with the previous version)
    (``transport/delta.py``): generators fetching from the learner that hold the previous version
    take those instead. Off by default: on the measured machine encoding and decoding cost more
    than the bytes saved (benchmarks/results/bench_weight_delta.md)."""
    delta_level: int = 1
    """zstd level of the deltas (1-19; higher = smaller and slower)."""

    def __post_init__(self) -> None:
        if not 1 <= self.delta_level <= 19:
            raise ValueError(f"weights.delta_level must be 1-19, got {self.delta_level}")

    def torch_dtype(self, precision: object) -> torch.dtype:
        """The dtype of the files for a learner at ``trainer.precision``."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if str(precision).startswith("bf16") else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


@dataclass
class LearnerConfig:
    """The whole run: ``python -m vapo_async.learner [overrides]``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Actor/critic initialisation."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm (presets vapo, ppo, grpo, dapo in conf/algo/)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts (train split leased to generators, eval split for ``eval``)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Generator sampling settings."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward settings given to local generators (remote ones must use the same)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """Controller (endpoints, leases, prompt order)."""
    generators: GeneratorsConfig = field(default_factory=GeneratorsConfig)
    """Local generator processes."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Micro-batching and batch assembly."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer flags."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard output."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and published weights."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """Published weight versions: dtype, digests, file size."""
    seed: int = 0
    """Seed of model init randomness and mini-batch shuffling."""
    threads: int | None = None
    """torch CPU threads of each learner process; None = on CPU, the cores left after one per local
    generator, shared by the learner processes of this node (at least 1); on GPU torch's default.
    (Oversubscribed OpenMP threads wait on each other: fewer threads are faster than too many.)"""
    name: str | None = None
    """Run name: the run directory is ``runs/NAME`` (``hydra.run.dir`` still wins), so re-running
    the same command continues the run (``resume``); None = a timestamped directory."""
    resume: bool | None = None
    """Continue from ``RUN_DIR/checkpoints/last.ckpt`` (step, version, controller, optimisers, RNG):
    None = when it exists (fresh otherwise); true = it must exist; false = start fresh (refused where
    a checkpoint would be overwritten). Model, algorithm, group size and dataset must match the
    checkpoint's (learner/resume.py)."""


def validate(cfg: LearnerConfig) -> None:
    """Cross-field checks (each error names its key)."""
    trainer_kwargs(cfg.trainer)
    check_controller_endpoints(cfg)
    from vapo_async.learner.resume import run_dir_for

    try:
        run_dir_for(cfg.name, "stamp")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.trainer.strategy not in STRATEGIES:
        raise ConfigError(f"trainer.strategy={cfg.trainer.strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if cfg.trainer.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps}: must be >= 1")
    for item in cfg.generators.env:
        if "=" not in item or not item.split("=", 1)[0]:
            raise ConfigError(f"generators.env: {item!r} is not KEY=VALUE")
    if cfg.eval.engine not in ("vllm", "hf"):
        raise ConfigError(f"eval.engine={cfg.eval.engine!r}: choose vllm or hf")
    if not 0 < cfg.eval.top_p <= 1:
        raise ConfigError(f"eval.top_p={cfg.eval.top_p}: must be in (0, 1]")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads={cfg.threads}: must be >= 1 or null")
    if cfg.generators.local < 0:
        raise ConfigError(f"generators.local={cfg.generators.local}: must be >= 0")
    check_placement_settings(cfg)
    if cfg.batching.micro_batch_overhead_tokens is not None and cfg.batching.micro_batch_overhead_tokens < 0:
        raise ConfigError(f"batching.micro_batch_overhead_tokens={cfg.batching.micro_batch_overhead_tokens}: "
                          "must be >= 0 (or null: chosen for the device)")
    if cfg.batching.micro_batch_tokens < 1:
        raise ConfigError(f"batching.micro_batch_tokens={cfg.batching.micro_batch_tokens}: must be >= 1")
    if cfg.batching.packed_attention not in ("auto", "segments", "mask"):
        raise ConfigError(f"batching.packed_attention={cfg.batching.packed_attention!r}: must be auto, segments or mask")
    if not 0 <= cfg.batching.pack_row_tokens <= cfg.batching.micro_batch_tokens:
        raise ConfigError(f"batching.pack_row_tokens={cfg.batching.pack_row_tokens}: must be in "
                          f"[0, batching.micro_batch_tokens={cfg.batching.micro_batch_tokens}] (0 = longest sequence)")
    if cfg.checkpoint.keep_weights < 2:
        raise ConfigError(f"checkpoint.keep_weights={cfg.checkpoint.keep_weights}: must be >= 2")
    if cfg.weights.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"weights.dtype={cfg.weights.dtype!r}: choose auto, float32, bfloat16 or float16")
    if cfg.weights.hash not in HASHES:
        raise ConfigError(f"weights.hash={cfg.weights.hash!r}: choose one of {', '.join(HASHES)}")
    if cfg.weights.shard_gib <= 0 or cfg.weights.finalize_timeout_s <= 0:
        raise ConfigError(f"weights.shard_gib={cfg.weights.shard_gib}, weights.finalize_timeout_s="
                          f"{cfg.weights.finalize_timeout_s}: must be > 0")
    if cfg.sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature={cfg.sampling.temperature}: must be > 0 (the learner "
                          "divides logits by it)")
    check_model_preset(cfg.model.name, cfg.model.path)
    if cfg.reward.overlong_shaping:
        raise ConfigError("reward.overlong_shaping=true: use algo.overlong_shaping=true instead (the learner "
                          "adds DAPO's overlong penalty itself, with L_max = sampling.max_tokens and "
                          "L_cache = reward.overlong_cache_tokens, so remote generators need no setting)")
    if cfg.algo.overlong_shaping:
        try:  # the learner's band (module.setup): L_max = sampling.max_tokens
            cfg.reward.overlong_band(cfg.sampling.max_tokens)
        except ValueError as e:
            raise ConfigError(f"{e} with algo.overlong_shaping") from None


_PLACED_BY_LEARNER = {"engine.gpu_memory_utilization": "generators.gpu_memory_utilization",
                      "engine.tensor_parallel_size": "generators.tensor_parallel_size"}
"""Local generator settings the GPU placement decides: ``generators.overrides`` may not set them."""


def check_placement_settings(cfg: LearnerConfig) -> None:
    """The GPU placement settings, checked without a GPU (the plan itself: learner/placement.py)."""
    gen = cfg.generators
    if gen.tensor_parallel_size < 1:
        raise ConfigError(f"generators.tensor_parallel_size={gen.tensor_parallel_size}: must be >= 1")
    if gen.devices is not None and len(gen.devices) != gen.local * gen.tensor_parallel_size:
        raise ConfigError(f"generators.devices={gen.devices}: needs generators.local x generators.tensor_parallel_size "
                          f"= {gen.local * gen.tensor_parallel_size} entries (or null: chosen automatically)")
    if gen.gpu_memory_utilization is not None and not 0 < gen.gpu_memory_utilization <= 1:
        raise ConfigError(f"generators.gpu_memory_utilization={gen.gpu_memory_utilization}: must be in (0, 1] or null")
    if not 0 <= gen.learner_memory_share < 1:
        raise ConfigError(f"generators.learner_memory_share={gen.learner_memory_share}: must be in [0, 1)")
    if not 0 < cfg.eval.gpu_memory_utilization <= 1:
        raise ConfigError(f"eval.gpu_memory_utilization={cfg.eval.gpu_memory_utilization}: must be in (0, 1]")
    for item in gen.overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in _PLACED_BY_LEARNER:
            raise ConfigError(f"generators.overrides: {item!r} is set by the GPU placement; use "
                              f"{_PLACED_BY_LEARNER[key]}")
    if any(item.split("=", 1)[0] == "CUDA_VISIBLE_DEVICES" for item in gen.env):
        raise ConfigError("generators.env: CUDA_VISIBLE_DEVICES is set by the GPU placement; use generators.devices")


def check_controller_endpoints(cfg: LearnerConfig) -> None:
    """The controller's endpoints obey the CURVE rule (keys off loopback) and its key files exist:
    checked at start, before any model loads, as a one-line ``ConfigError`` naming the keys."""
    from pathlib import Path

    from vapo_async.transport.sockets import InsecureEndpointError, use_curve

    t = cfg.controller.transport
    try:
        use_curve(t, [t.endpoint, t.resolved_pub_endpoint()], "server")
    except (InsecureEndpointError, ValueError) as e:
        raise ConfigError(f"controller.transport.endpoint={t.endpoint}: {e}") from None
    for key in ("server_secret_file", "authorized_keys_dir"):
        path = getattr(t.curve, key)
        if path and not Path(path).expanduser().exists():
            raise ConfigError(f"controller.transport.curve.{key}={path}: not found")


def register_configs() -> None:
    """Register ``LearnerConfig`` as ``learner_schema`` and every ``algo.presets.PRESETS`` entry as
    ``algo/NAME_preset`` in Hydra's ConfigStore, the ``vapo.batch_groups`` resolver that
    conf/algo/NAME.yaml uses to turn the model preset's scale into its shape, and ``vapo.run_dir``
    (conf/learner.yaml: ``runs/NAME`` or a timestamp)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from vapo_async.algo.presets import PRESETS, batch_groups_for
    from vapo_async.learner.resume import run_dir_for

    OmegaConf.register_new_resolver("vapo.batch_groups", batch_groups_for, replace=True)
    OmegaConf.register_new_resolver("vapo.run_dir", run_dir_for, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="learner_schema", node=LearnerConfig)
    for name, preset in PRESETS.items():  # conf/algo/NAME.yaml builds on these
        cs.store(group="algo", name=f"{name}_preset", node=preset)
