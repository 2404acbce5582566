"""vapo_async.data: prompt datasets (jsonl/parquet: GSM8K, AIME, DAPO-Math-17k), templates, tasks.

    from vapo_async.data import DataConfig, load_prompts
    records = load_prompts(DataConfig(name="gsm8k"), split="eval")   # list[PromptRecord]

``synthetic`` (the embedded default task), ``tiny_base`` and ``hf_dir`` import torch or build
models; import them directly, they are not re-exported here.
"""

from .datasets import DataConfig, DatasetError, PromptRecord, load_prompts
from .templates import DAPO_TEMPLATE, apply_template

__all__ = [
    "DAPO_TEMPLATE",
    "DataConfig",
    "DatasetError",
    "PromptRecord",
    "apply_template",
    "load_prompts",
]
