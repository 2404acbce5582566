"""``python -m vapo_async.eval model=PATH data=PATH_OR_NAME k=32 [key=value ...]``

Setup -> run -> cleanup: resolve the model (``tiny_base`` builds the default base on first use) and
the prompts (``vapo_async.data.load_prompts``), sample ``k`` responses per prompt with a vLLM engine
(progress bar on stderr), score them with ``vapo_async.rewards``, print one JSON object on stdout
and write it to ``out`` (and every sample to ``<out stem>.samples.jsonl``). Fields:
``vapo_async/eval/config.py`` (``EvaluatorConfig``). Configuration errors exit with code 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep stdout for the result (before vllm import)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from vapo_async.data import load_prompts  # noqa: E402
from vapo_async.eval.config import TINY_BASE, EvaluatorConfig, register_configs, to_evaluator_config  # noqa: E402
from vapo_async.eval.runner import ProblemResult, evaluate  # noqa: E402

log = logging.getLogger("vapo_async.eval")


def resolve_model(model: str) -> Path:
    """The model directory for ``model`` (``tiny_base`` -> the cached default tiny base)."""
    if model == TINY_BASE:
        from vapo_async.data.tiny_base import TinyBaseConfig, ensure_tiny_base

        return ensure_tiny_base(TinyBaseConfig())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model={model!r}: no Hugging Face directory (config.json) there")
    return path


def write_samples(path: Path, results: list[ProblemResult]) -> None:
    """One JSON line per problem: uid, answer, and each sample's text, tokens and score."""
    with path.open("w", encoding="utf-8") as f:
        for r in results:
            samples = [
                {"text": t, "tokens": n, "truncated": tr, "reward": s.reward, "correct": s.correct,
                 "formatted": s.formatted}
                for t, n, tr, s in zip(r.texts, r.token_counts, r.truncated, r.scores, strict=True)
            ]
            f.write(json.dumps({"uid": r.record.uid, "answer": r.record.answer, "samples": samples}) + "\n")


def run(cfg: EvaluatorConfig) -> dict[str, object]:
    """Evaluate as configured; returns the result object (also written to ``cfg.out``)."""
    model_dir = resolve_model(cfg.model)
    tokenizer = None
    if cfg.chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(cfg.data_config(), cfg.split, tokenizer=tokenizer)
    results: list[ProblemResult] = []
    metrics = evaluate(
        str(model_dir), prompts, cfg.k, cfg.temperature, cfg.top_p, cfg.max_tokens,
        seed=cfg.seed, reward=cfg.reward, engine=cfg.engine, progress=cfg.progress, results_out=results,
    )
    out = cfg.out_path(model_dir)
    result: dict[str, object] = {
        **metrics,
        "model": str(model_dir),
        "data": cfg.data,
        "split": cfg.split,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.save_samples:
        samples = out.with_name(out.stem + ".samples.jsonl")
        write_samples(samples, results)
        result["samples_file"] = str(samples)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


register_configs()


@hydra.main(config_path=None, config_name="eval", version_base=None)
def main(dcfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        cfg = to_evaluator_config(dcfg)
        result = run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"vapo_async.eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
