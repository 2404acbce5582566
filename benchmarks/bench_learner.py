"""bench_learner: the learner's training step on CPU at three model sizes (the tiny preset's model,
~30M and ~120M parameters), each with ``batching.packing`` off and on: trained tokens/s, achieved
FLOP/s as a fraction of the fp32 matmul rate measured in the same run, padding fraction of the
plan, peak RSS, and the machine's load average at the start and end of every configuration.

    python benchmarks/bench_learner.py                    # every size, both layouts (see "How long")
    python benchmarks/bench_learner.py --quick --sizes tiny            # ~1 min
    python benchmarks/bench_learner.py --sizes 30m --layouts packed --threads 2 --name bench_learner_30m
    python benchmarks/bench_learner.py --sizes tiny --layouts padded --quick --compile --name bench_learner_compile

What is timed: one learner training step as ``LearnerModule`` runs it on one device, with the
learner's own functions (``vapo_async.learner.batching``: ``make_plan`` and ``collate``, the
micro-batches built as ``LearnerModule._micro_batches`` builds them; ``vapo_async.learner.update``:
pi_prox/value recompute, decoupled GAE + whitening, the PPO mini-batch updates of actor and critic
with AdamW as ``configure_optimizers`` sets it up). The clock covers collate + recompute + GAE +
updates; the plan (made by the rollout stream in the product) is not timed. The global batch is
shaped like the tiny preset (``algo`` defaults: 16 groups x G = 8, 4 mini-batches, 1 PPO epoch;
prompts of 40-80 tokens, responses of 20-200 tokens, the synthetic task's range), the same
(seed 0) at every size and layout. Micro-batching uses the learner's CPU defaults
(``BatchingConfig``: 16384-token budget, a cut price of 256 tokens; packed rows of up to the
batch's longest sequence), each overridable by a flag. One warm-up step, then ``--steps`` timed
steps (3; 1 with ``--quick``), the median reported. Threads: ``--threads`` (1: the learner's core
in the asynchronous layout).

Sizes (``SIZES``; random weights, built in this script: speed does not depend on the weights):

- ``tiny``: the tiny base's architecture (``TinyBaseConfig``: hidden 128, MLP 384, 4 layers, 4/2
  heads, untied head) with its BPE tokenizer trained here on synthetic-task text (397 words):
  890,240 parameters (actor; critic 839,553).
- ``30m``: Qwen2, vocabulary 32,768, hidden 512, MLP 1024, 6 layers, 8 query / 2 key-value heads
  (head dim 64), tied embeddings: 30,157,824 parameters (actor; critic 30,158,337).
- ``120m``: Qwen2, vocabulary 32,768, hidden 768, MLP 2816, 12 layers, 12 query / 2 key-value
  heads (head dim 64), tied embeddings: 119,569,152 parameters (actor; critic 119,569,921).

Every (size, layout) runs in a fresh process (multiprocessing spawn), so its peak RSS
(``ru_maxrss``: imports, actor + critic, gradients, AdamW state, activations) is its own and no
allocator state carries over.

FLOPs (counted on real tokens only, so padding, and the dense block-diagonal attention of packed
rows, show up as lost efficiency): per token and layer, 2 x (matmul parameters) for the projections
and MLP, plus 4 x hidden x (causal context length) for attention scores and values; the LM head
(actor) on response tokens only (the learner keeps only those logits), the 1-unit value head
(critic) everywhere; embedding lookups, norms, RoPE, softmax and the optimizer count nothing.
Recompute = 1 forward, training = 3 forwards (forward + backward) per PPO epoch, for actor and
critic. The shapes are read from the loaded model's config. The reference rate is a 1024^3 fp32
``torch.mm`` on the same number of threads, measured before the first and after every
configuration; the best is kept (a shared machine only ever lowers it).

How long (one thread; 4 steps per configuration with the warm-up, 2 with ``--quick``): tiny 0.29
TFLOP, ~5 s a step on a quiet core (about 1 min for both layouts with ``--quick``, process starts
included). 30m and 120m are estimates from their model FLOPs at an assumed 60-120 GFLOP/s achieved
(the tiny model reached 60 of a 190 GFLOP/s core; not yet measured): 30m 6.3 TFLOP, ~1-2 min a step;
120m 34 TFLOP, ~5-10 min a step. All sizes and layouts: about 1-1.5 h (``--quick``: 25-45 min); a
loaded machine is proportionally slower. Every step's time is printed as it ends, and the results
are rewritten after every configuration.

Writes benchmarks/results/bench_learner.{json,md,png} (``--name``: another file stem in
benchmarks/results/, or a path stem).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no weight-loading bars (spawned processes inherit it)

from vapo_async.algo.presets import preset  # noqa: E402
from vapo_async.data.hf_dir import TinyQwen2Shape, write_random_qwen2  # noqa: E402
from vapo_async.data.tiny_base import TinyBaseConfig  # noqa: E402
from vapo_async.learner.attention import set_packed_attention  # noqa: E402
from vapo_async.learner.batching import MicroBatch, Plan, collate, make_plan, padding_micro_batch  # noqa: E402
from vapo_async.learner.config import BatchingConfig  # noqa: E402
from vapo_async.learner.models import compile_blocks, load_actor, load_critic  # noqa: E402
from vapo_async.learner.update import compute_advantages, ppo_updates, recompute  # noqa: E402
from vapo_async.transport.batch import GroupInfo, RolloutBatch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DEFAULT_NAME = "bench_learner"
LAYOUTS = ("padded", "packed")
TARGET = 0.5
"""Achieved model FLOP/s as a fraction of the fp32 matmul rate, for the sizes in TARGET_SIZES."""
TARGET_SIZES = ("30m", "120m")
TEMPERATURE = 1.0


@dataclass(frozen=True)
class Size:
    """A model size: its architecture and vocabulary (random weights)."""

    shape: TinyQwen2Shape
    """Hidden, MLP, layers, heads."""
    vocab: int | None
    """Vocabulary; None: the tiny base's BPE tokenizer trained on synthetic-task text."""
    tied: bool
    """Output layer tied to the input embedding (Qwen2.5's small models are tied)."""


SIZES = {
    "tiny": Size(TinyBaseConfig().shape(), None, tied=False),
    "30m": Size(TinyQwen2Shape(hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                               num_attention_heads=8, num_key_value_heads=2), 32768, tied=True),
    "120m": Size(TinyQwen2Shape(hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                                num_attention_heads=12, num_key_value_heads=2), 32768, tied=True),
}


# ---- the batch and its FLOPs ----


def make_batch(n_groups: int, g: int, vocab: int, seed: int) -> list[RolloutBatch]:
    """``n_groups`` random groups of ``g`` responses (one-prompt batches, as the controller hands them over)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n_groups):
        p = int(rng.integers(40, 81))
        lens = rng.integers(20, 201, size=g)
        correct = rng.random(g) < 0.5
        out.append(RolloutBatch.from_group(
            GroupInfo(lease_id=k, prompt_index=k, generator_id="bench"), prompt_ids=rng.integers(3, vocab, p).astype(np.int32),
            response_ids=[rng.integers(3, vocab, int(n)).astype(np.int32) for n in lens],
            logprobs=[rng.uniform(-2.0, -0.01, int(n)).astype(np.float32) for n in lens],
            versions=[np.zeros(int(n), np.int32) for n in lens], rewards=np.where(correct, 1.0, -1.0).astype(np.float32),
            correct=correct, truncated=np.zeros(g, bool)))
    return out


def flop_parts(seqs: RolloutBatch, d: int, f: int, n_l: int, heads: int, kv_heads: int, vocab: int) -> dict[str, float]:
    """One forward pass of actor + critic over the real tokens of ``seqs``, split into
    ``matmul`` (projections and MLP of both bodies), ``attention`` (scores and values of both),
    ``lm_head`` (actor, response tokens) and ``value_head`` (critic, every token)."""
    kv = d // heads * kv_heads
    per_layer_params = d * d * 2 + d * kv * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    total_tok = float(seqs.seq_lens.sum())
    ctx = float(sum(n * (n + 1) / 2 for n in seqs.seq_lens.tolist()))  # sum over tokens of context length
    return {"matmul": 2 * n_l * 2 * per_layer_params * total_tok, "attention": 2 * n_l * 4 * d * ctx,
            "lm_head": 2 * d * vocab * float(seqs.response_lens.sum()), "value_head": 2 * d * total_tok}


def model_flops(seqs: RolloutBatch, d: int, f: int, n_l: int, heads: int, kv_heads: int, vocab: int, epochs: int) -> float:
    """Actor + critic model FLOPs of one step: hidden ``d``, MLP ``f``, ``n_l`` layers, recompute
    (1 forward) + ``epochs`` x training (3 forwards) (also used by tools/device_check.sh)."""
    return (1 + 3 * epochs) * sum(flop_parts(seqs, d, f, n_l, heads, kv_heads, vocab).values())


def config_shape(cfg) -> tuple[int, int, int, int, int, int]:
    """(hidden, MLP, layers, heads, key-value heads, vocabulary) of a Hugging Face Qwen2 config."""
    return (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size)


# ---- the models ----


def build_model_dir(size: Size, out: Path) -> Path:
    """Write a random Qwen2 of ``size`` as a Hugging Face directory (config + safetensors) at ``out``."""
    if size.vocab is None:  # the tiny preset: its tokenizer decides the vocabulary
        texts = [f"Ann has {a} apples and buys {b}. Answer: {a + b}" for a in range(60) for b in range(0, 60, 7)]
        return write_random_qwen2(out, texts, vocab_size=TinyBaseConfig().vocab_size, shape=size.shape, seed=0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = size.shape
    cfg = Qwen2Config(vocab_size=size.vocab, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.max_position_embeddings,
                      tie_word_embeddings=size.tied, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      use_cache=False, torch_dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    return out


def pad_id(model) -> int:
    """The pad id ``LearnerModule`` collates with (pad, else EOS, else 0)."""
    cfg = model.config
    return int(cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- one configuration (in its own process) ----


@dataclass(frozen=True)
class Job:
    """One (size, layout) configuration."""

    size: str
    layout: str
    model_dir: str
    steps: int
    """Timed steps (after one warm-up step)."""
    threads: int
    micro_batch_tokens: int
    overhead_tokens: float
    pack_row_tokens: int
    compile: bool = False
    """``model.compile``: ``compile_blocks`` on actor and critic, as ``configure_model`` does."""
    packed_attention: str = "segments"
    """``batching.packed_attention`` resolved (``segments`` or ``mask``): packed layouts only."""


def step_micro_batches(local: RolloutBatch, plan: Plan, packed: bool, pad: int) -> list[MicroBatch]:
    """Rank 0's micro-batches, one per flat slot, as ``LearnerModule._micro_batches`` builds them:
    ``local`` holds the sequences of ``plan.rank_index[0]`` in that order."""
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(plan.micro_id[0]):
        by_slot.setdefault(s, []).append(i)
    rows = plan.micro_row[0]
    out = []
    for slot in range(sum(plan.n_micro)):
        idx = by_slot.get(slot)
        out.append(collate(local, idx, pad, [rows[i] for i in idx] if packed else None) if idx
                   else padding_micro_batch(pad))
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_job(job: Job) -> dict:
    """Time ``job``: one warm-up step and ``job.steps`` timed steps on a fresh actor + critic."""
    load_start = os.getloadavg()[0]
    # the learner's optimiser setting (imported here: the module imports Lightning)
    from vapo_async.learner.module import WEIGHT_DECAY

    torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    rss_before = peak_rss_bytes()
    algo = preset("vapo")
    actor, critic = load_actor(job.model_dir), load_critic(job.model_dir)
    if job.layout == "packed":  # as configure_model does with batching.packing=true
        set_packed_attention((actor, critic), job.packed_attention)
    if job.compile:
        compile_blocks(actor)
        compile_blocks(critic)
    opt_a = torch.optim.AdamW(actor.parameters(), lr=algo.actor_lr, weight_decay=WEIGHT_DECAY)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr, weight_decay=WEIGHT_DECAY)
    shape = config_shape(actor.config)
    seqs = RolloutBatch.concat(make_batch(algo.batch_groups, algo.group_size, shape[-1], seed=0))
    packed, pad = job.layout == "packed", pad_id(actor)
    times, phases, pads, n_micro, n_rows = [], [], [], [], []
    for s in range(job.steps + 1):
        plan = make_plan(seqs, 1, algo.mini_batches, job.micro_batch_tokens, torch.Generator().manual_seed(s),
                         job.overhead_tokens, packing=packed, row_tokens=job.pack_row_tokens)
        local = seqs.select_responses(plan.rank_index[0])
        t0 = time.perf_counter()
        mbs = step_micro_batches(local, plan, packed, pad)
        t1 = time.perf_counter()
        prep = recompute(actor, critic, mbs, TEMPERATURE)
        compute_advantages(prep, algo)
        t2 = time.perf_counter()
        ppo_updates(actor, critic, opt_a, opt_c, prep, [plan.slots(m) for m in range(len(plan.n_micro))],
                    plan.norms, algo, TEMPERATURE, train_actor=True, backward=lambda loss: loss.backward(), seed=s)
        t3 = time.perf_counter()
        print(f"[{job.size} {job.layout}{' compile' if job.compile else ''}] {'warm-up' if s == 0 else f'step {s}/{job.steps}'}: {t3 - t0:.2f} s "
              f"(collate {t1 - t0:.2f}, recompute + GAE {t2 - t1:.2f}, updates {t3 - t2:.2f})", file=sys.stderr, flush=True)
        if s > 0:  # the first step warms up allocators, kernels and the AdamW state
            times.append(t3 - t0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
            pads.append(plan.padding_fraction)
            n_micro.append(sum(plan.n_micro))
            n_rows.append(sum(int(mb.input_ids.shape[0]) for mb in mbs))
    med = float(np.median(times))
    tokens = float(seqs.seq_lens.sum())
    parts = flop_parts(seqs, *shape)
    flops = (1 + 3 * algo.ppo_epochs) * sum(parts.values())
    return {
        "size": job.size, "layout": job.layout, "compile": job.compile, "actor_params": n_params(actor), "critic_params": n_params(critic),
        "shape": dict(zip(("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab"),
                          shape, strict=True)), "tied_embeddings": bool(actor.config.tie_word_embeddings),
        "micro_batch_tokens": job.micro_batch_tokens, "overhead_tokens": job.overhead_tokens,
        "pack_row_tokens": job.pack_row_tokens, "threads": job.threads,
        "n_micro": float(np.mean(n_micro)), "n_rows": float(np.mean(n_rows)), "sequences": seqs.n_responses,
        "step_s_median": med, "step_s_all": times,
        "phase_s_median": dict(zip(("collate", "recompute_gae", "updates"), np.median(phases, axis=0).tolist(), strict=True)),
        "tokens_per_step": tokens, "response_tokens_per_step": float(seqs.response_lens.sum()), "tokens_per_s": tokens / med,
        "flops_per_step": flops, "forward_flop_parts": parts, "achieved_flops": flops / med,
        "padding_fraction": float(np.mean(pads)), "peak_rss_bytes": peak_rss_bytes(), "rss_before_models_bytes": rss_before,
        "load_start": load_start, "load_end": os.getloadavg()[0],
    }


def run_in_fresh_process(job: Job) -> dict:
    """``run_job`` in a new (spawned) process: its peak RSS is this configuration's alone."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(run_job, job).result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"bench_learner: the process of {job.size}/{job.layout} died (out of memory? "
                               f"peak RSS grows with --micro-batch-tokens)") from e


def matmul_rate(n: int = 1024, repeats: int = 10) -> float:
    """fp32 (n, n) @ (n, n) FLOP/s on the current torch threads, best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# ---- the report ----


def result_paths(name: str) -> dict[str, Path]:
    """``name``'s .json/.md/.png: in benchmarks/results/ for a bare stem, else the path stem as given."""
    stem = Path(name) if os.sep in name else RESULTS / name
    return {ext: stem.with_name(stem.name + "." + ext) for ext in ("json", "md", "png")}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _verdict(c: dict, peak: float) -> str:
    if c["size"] not in TARGET_SIZES:
        return "reported"
    return "met" if c["achieved_flops"] / peak >= TARGET else "missed"


def _size_line(name: str, cs: list[dict]) -> str:
    """One line per size: architecture, parameters, and its forward FLOP mix."""
    c = cs[0]
    s, parts = c["shape"], c["forward_flop_parts"]
    total = sum(parts.values())
    mix = ", ".join(f"{k.replace('_', ' ')} {100 * v / total:.0f}%" for k, v in parts.items())
    return (f"- **{name}**: hidden {s['hidden_size']}, MLP {s['intermediate_size']}, {s['num_layers']} layers, "
            f"{s['num_heads']}/{s['num_kv_heads']} heads, vocabulary {s['vocab']}, "
            f"{'tied' if c['tied_embeddings'] else 'untied'} output layer: {c['actor_params']:,} parameters "
            f"(actor), {c['critic_params']:,} (critic). Model FLOPs per step {c['flops_per_step'] / 1e12:.2f} T; "
            f"forward mix: {mix}.")


def _target_line(name: str, cs: list[dict], peak: float) -> str:
    got = "; ".join(f"{c['layout']} {100 * c['achieved_flops'] / peak:.1f}% ({_verdict(c, peak)})" for c in cs)
    if name not in TARGET_SIZES:
        return f"- {name}: reported as measured, no target: {got}."
    best = max(c["achieved_flops"] for c in cs) / peak
    return f"- {name}: {got} -> **{'met' if best >= TARGET else 'missed'}** (best layout {100 * best:.1f}%)."


def _packing_line(name: str, cs: list[dict]) -> str | None:
    by = {c["layout"]: c for c in cs}
    if set(by) != set(LAYOUTS):
        return None
    a, b = by["padded"], by["packed"]
    return (f"- {name}: padding {100 * a['padding_fraction']:.1f}% -> {100 * b['padding_fraction']:.1f}%, rows "
            f"{a['n_rows']:.0f} -> {b['n_rows']:.0f}, tokens/s x{b['tokens_per_s'] / a['tokens_per_s']:.2f} with packing.")


def markdown(res: dict) -> str:
    peak = res["matmul_flops"]
    by_size: dict[str, list[dict]] = {}
    for c in res["configs"]:
        by_size.setdefault(c["size"], []).append(c)
    rows = "\n".join(
        f"| {c['size']} | {c['layout']}{' + compile' if c.get('compile') else ''} | {c['n_micro']:.0f} | {c['n_rows']:.0f} | {c['step_s_median']:.2f} | "
        f"{c['tokens_per_s']:.0f} | {c['achieved_flops'] / 1e9:.2f} | {100 * c['achieved_flops'] / peak:.1f}% | "
        f"{100 * c['padding_fraction']:.1f}% | {_gib(c['peak_rss_bytes'])} | {c['load_start']:.1f} -> {c['load_end']:.1f} | "
        f"{_verdict(c, peak)} |" for c in res["configs"])
    packing = [line for n, cs in by_size.items() if (line := _packing_line(n, cs))]
    b = res["batching"]
    return f"""# bench_learner: the learner's training step on CPU, by model size, padded and packed

Machine: {res['machine']}; torch {res['torch']}, torch threads: {res['threads']}. 1-min load average
{res['load_start'][0]:.1f} at the start and {res['load_end'][0]:.1f} at the end of the run (per configuration
in the table; above the thread count other jobs share the cores and the figures are lower bounds).
Batch (every configuration): {res['batch']}, {res['tokens_per_step']:.0f} tokens per step. One step =
recompute + GAE + {res['mini_batches']} mini-batch updates of actor and critic (ppo_epochs = {res['ppo_epochs']}), AdamW,
the learner's own functions. Micro-batches: budget {b['micro_batch_tokens']} tokens, cut price
{b['overhead_tokens']:.0f} tokens; packed rows up to {b['pack_row_tokens'] or 'the longest sequence'}{'' if not b['pack_row_tokens'] else ' tokens'},
packed attention: {b.get('packed_attention', 'mask (before 2026-12-07)')}.
Median of {res['steps']} timed step(s) after a warm-up step; each configuration in a fresh process.
Reference: fp32 1024^3 torch.mm on {res['threads']} thread(s), best of {len(res['matmul_all'])} measurements
(before the first and after every configuration): **{peak / 1e9:.1f} GFLOP/s** (lowest {min(res['matmul_all']) / 1e9:.1f}).

| size | layout | micro-batches | rows | step s (median) | tokens/s | achieved GFLOP/s | of matmul rate | padding | peak RSS | load 1-min start -> end | target |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

Sizes (random weights; model FLOPs on real tokens: module docstring):

{chr(10).join(_size_line(n, cs) for n, cs in by_size.items())}

## Targets: >= {100 * TARGET:.0f}% of the matmul rate at {' and '.join(TARGET_SIZES)}

{chr(10).join(_target_line(n, cs, peak) for n, cs in by_size.items())}

## Packing (``batching.packing``)

{chr(10).join(packing) if packing else 'Only one layout measured.'}

Reading: achieved FLOP/s counts model FLOPs on real tokens only, so padding and the dense
block-diagonal attention mask of packed rows (SDPA on CPU pays C^2 per row of C tokens) are lost
efficiency, as are everything outside the matmuls (RMSNorm, RoPE, softmax, log-softmax over the
vocabulary, the AdamW steps, Python and module dispatch), whose share falls as the model widens.
Peak RSS is the process's, imports included ({_gib(res['configs'][0]['rss_before_models_bytes'])} before
the models were loaded in the first configuration).
"""


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = res["matmul_flops"]
    sizes = list(dict.fromkeys(c["size"] for c in res["configs"]))
    layouts = list(dict.fromkeys(c["layout"] for c in res["configs"]))
    by = {(c["size"], c["layout"]): c for c in res["configs"]}
    fig, (ax_f, ax_t) = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.8 / len(layouts)
    for k, layout in enumerate(layouts):
        xs = [i + (k - (len(layouts) - 1) / 2) * width for i in range(len(sizes))]
        cs = [by.get((s, layout)) for s in sizes]
        ax_f.bar(xs, [100 * c["achieved_flops"] / peak if c else 0 for c in cs], width, label=layout)
        ax_t.bar(xs, [c["tokens_per_s"] if c else 0 for c in cs], width, label=layout)
    ax_f.axhline(100 * TARGET, color="r", ls=":", label=f"target {100 * TARGET:.0f}% ({', '.join(TARGET_SIZES)})")
    ax_f.set_ylabel(f"% of fp32 matmul rate ({peak / 1e9:.0f} GFLOP/s)")
    ax_t.set_ylabel("trained tokens/s")
    tps = [c["tokens_per_s"] for c in res["configs"]]
    if max(tps) > 10 * min(tps):  # sizes far apart: a log axis (else linear from 0, bars comparable)
        ax_t.set_yscale("log")
    ax_f.set_ylim(0, max(100 * TARGET, *(100 * c["achieved_flops"] / peak for c in res["configs"])) * 1.15)
    for ax in (ax_f, ax_t):
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_xlabel("model size")
        ax.legend(fontsize=8)
    fig.suptitle(f"Learner step on CPU ({res['threads']} thread(s)), model FLOPs on real tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(res: dict, name: str) -> Path:
    """Write ``name``'s .json/.md/.png; returns the .md path."""
    paths = result_paths(name)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(res, indent=1))
    paths["md"].write_text(markdown(res))
    plot(res, paths["png"])
    return paths["md"]


# ---- the command line ----


def parse_list(text: str, valid: tuple[str, ...]) -> list[str]:
    """Comma-separated choices of ``valid``, in the order given, each once; raises on anything else."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad or not items:
        what = f"{', '.join(bad)} not in" if bad else "give one or more of"
        raise argparse.ArgumentTypeError(f"{what} {', '.join(valid)} (comma-separated)")
    return list(dict.fromkeys(items))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpu = BatchingConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda t: parse_list(t, tuple(SIZES)), default=list(SIZES),
                    help=f"comma-separated, of {','.join(SIZES)} (default: all)")
    ap.add_argument("--layouts", type=lambda t: parse_list(t, LAYOUTS), default=list(LAYOUTS),
                    help=f"comma-separated, of {','.join(LAYOUTS)} (default: both)")
    ap.add_argument("--quick", action="store_true", help="1 timed step per configuration (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (overrides --quick)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the learner's core)")
    ap.add_argument("--micro-batch-tokens", type=int, default=cpu.micro_batch_tokens)
    ap.add_argument("--overhead-tokens", type=float, default=float(cpu.overhead_for("cpu")),
                    help="cut price of a micro-batch in tokens (the learner's CPU default)")
    ap.add_argument("--pack-row-tokens", type=int, default=cpu.pack_row_tokens,
                    help="packed row capacity (0: the batch's longest sequence)")
    ap.add_argument("--packed-attention", choices=("segments", "mask"), default=cpu.packed_attention_for("cpu"),
                    help="batching.packed_attention for packed layouts (default: the learner's CPU choice)")
    ap.add_argument("--compile", action="store_true",
                    help="model.compile: torch.compile every transformer block (the warm-up step compiles)")
    ap.add_argument("--name", default=DEFAULT_NAME, help="results file stem in benchmarks/results/, or a path stem")
    args = ap.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    for flag, value, low in (("--steps", args.steps, 1), ("--threads", args.threads, 1),
                             ("--micro-batch-tokens", args.micro_batch_tokens, 1), ("--pack-row-tokens", args.pack_row_tokens, 0)):
        if value < low:
            ap.error(f"{flag}={value}: must be >= {low}")
    if args.overhead_tokens < 0:
        ap.error(f"--overhead-tokens={args.overhead_tokens}: must be >= 0")
    if not args.name or args.name.endswith(os.sep):
        ap.error(f"--name={args.name!r}: give a file stem (no extension)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    algo = preset("vapo")
    res = {
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "torch": torch.__version__, "threads": args.threads,
        "steps": args.steps, "compile": args.compile, "load_start": list(os.getloadavg()), "matmul_all": [matmul_rate()],
        "batch": f"{algo.batch_groups} groups x G={algo.group_size}, prompts 40-80 tokens, responses 20-200 tokens",
        "mini_batches": algo.mini_batches, "ppo_epochs": algo.ppo_epochs,
        "batching": {"micro_batch_tokens": args.micro_batch_tokens, "overhead_tokens": args.overhead_tokens,
                     "pack_row_tokens": args.pack_row_tokens, "packed_attention": args.packed_attention},
        "sizes": {n: {**asdict(SIZES[n].shape), "vocab": SIZES[n].vocab, "tied": SIZES[n].tied} for n in args.sizes},
        "configs": [],
    }
    md = None
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_model_dir(SIZES[size], Path(tmp) / size)
            for layout in args.layouts:
                job = Job(size, layout, str(model_dir), args.steps, args.threads, args.micro_batch_tokens,
                          args.overhead_tokens, args.pack_row_tokens, args.compile, args.packed_attention)
                res["configs"].append(run_in_fresh_process(job))
                res["matmul_all"].append(matmul_rate())
                res["matmul_flops"] = max(res["matmul_all"])  # a shared machine only ever lowers it
                res["tokens_per_step"] = res["configs"][0]["tokens_per_step"]
                res["load_end"] = list(os.getloadavg())
                md = write_report(res, args.name)  # after every configuration: a stopped run keeps its results
    print(md.read_text())


if __name__ == "__main__":
    main()
