"""Typed configuration of ``python -m vapo_async.eval`` (registered in Hydra's ConfigStore).

    python -m vapo_async.eval model=PATH data=synthetic k=32 [top_p=1.0] [limit=64] [out=res.json]

``model=tiny_base`` evaluates the default tiny base (built on first use). ``data`` is a dataset name
(``synthetic``, ``gsm8k``, ``aime``, ``dapo_math``) or a ``.jsonl`` / ``.parquet`` path, read with
``vapo_async.data.load_prompts``; ``data=synthetic`` means the held-out synthetic set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from vapo_async.common.engine import EngineConfig
from vapo_async.data import DataConfig
from vapo_async.rewards import RewardConfig

TINY_BASE = "tiny_base"
"""``model`` value that selects the default tiny base (``data.tiny_base.ensure_tiny_base``)."""


@dataclass
class EvaluatorConfig:
    """One evaluation: a model, a prompt set, how to sample, where to write the result."""

    model: str = TINY_BASE
    """Hugging Face model directory, or ``tiny_base`` for the default tiny base."""
    data: str = "synthetic"
    """Dataset name or file path (see ``DataConfig.name``)."""
    split: str = "eval"
    """Split to evaluate: ``eval`` (held-out / test) or ``train``."""
    k: int = 32
    """Samples per problem (avg@k, pass@k)."""
    temperature: float = 1.0
    """Sampling temperature (VAPO evaluation: 1.0)."""
    top_p: float = 0.7
    """Nucleus mass (VAPO evaluation: 0.7)."""
    max_tokens: int = 512
    """Most tokens per response."""
    limit: int | None = None
    """Evaluate at most this many problems (first ones; None = all)."""
    n_eval: int = 256
    """Synthetic: held-out problems drawn."""
    difficulty: int = 2
    """Synthetic: difficulty level."""
    data_seed: int = 0
    """Synthetic: generator seed."""
    template: str = "auto"
    """Prompt template (``DataConfig.template``)."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    seed: int | None = None
    """Per-request sampling seed; None = the engine's seed (``engine.seed``)."""
    out: str | None = None
    """Result JSON path; None = ``eval-<model>-<data>-k<k>.json`` in the working directory."""
    save_samples: bool = True
    """Also write every sample with its score to ``<out stem>.samples.jsonl``."""
    progress: bool = True
    """Show a progress bar (stderr)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """vLLM engine settings (dtype, KV cache, max_model_len, engine seed)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_tokens < 1:
            raise ValueError(f"eval: k and max_tokens must be >= 1, got k={self.k}, max_tokens={self.max_tokens}")
        if self.split not in ("train", "eval"):
            raise ValueError(f"eval.split must be 'train' or 'eval', got {self.split!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"eval: need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")

    def data_config(self) -> DataConfig:
        """The ``DataConfig`` that ``load_prompts`` reads."""
        return DataConfig(
            name=self.data,
            template=self.template,
            chat_template=self.chat_template,
            limit=self.limit,
            n_eval=self.n_eval,
            n_train=self.n_eval,
            difficulty=self.difficulty,
            seed=self.data_seed,
        )

    def out_path(self, model_dir: Path) -> Path:
        """Where the result JSON goes."""
        if self.out:
            return Path(self.out)
        return Path.cwd() / f"eval-{model_dir.name}-{Path(self.data).stem}-k{self.k}.json"


def to_evaluator_config(dcfg: DictConfig) -> EvaluatorConfig:
    """The composed Hydra config as a validated ``EvaluatorConfig`` (empty ``reward.custom`` -> None)."""
    from omegaconf import OmegaConf

    if not dcfg.reward.custom:
        dcfg.reward.custom = None
    return OmegaConf.to_object(dcfg)  # type: ignore[return-value]


def register_configs() -> None:
    """``eval_schema`` (the dataclass) and ``eval`` (schema + Hydra settings: no output folder, no
    log-file set-up, no chdir) in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(EvaluatorConfig)
    # OmegaConf cannot merge a CLI dict into a None-valued node ("reward.custom={_target_:...}"
    # fails inside _map_merge), so the schema holds an open (non-struct) {} there; ``to_evaluator_config`` maps it back to None.
    schema.reward.custom = {}
    OmegaConf.set_struct(schema.reward.custom, False)
    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=schema)
    cs.store(
        name="eval",
        node={
            "defaults": [
                "eval_schema",
                "_self_",
                {"override hydra/job_logging": "none"},
                {"override hydra/hydra_logging": "none"},
            ],
            "hydra": {"run": {"dir": "."}, "output_subdir": None},
        },
    )
