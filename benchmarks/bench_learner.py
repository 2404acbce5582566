"""bench_learner: learner training tokens/s and achieved FLOP/s on the tiny preset vs the fp32
matmul rate measured in the same run, with the padding fraction.

    python benchmarks/bench_learner.py              # ~5 min on one core
    python benchmarks/bench_learner.py --quick      # fewer steps and configurations

What is timed: one learner training step exactly as ``LearnerModule`` runs it on one device
(``vapo_async.learner.update``: pi_prox/value recompute, decoupled GAE + whitening, the PPO
mini-batch updates of actor and critic with AdamW), on a global batch shaped like the tiny preset
(``algo`` defaults: 16 groups x G = 8, 4 mini-batches; prompts of 40-80 tokens, responses of
20-200 tokens, the synthetic task's range). The model has the tiny base's architecture
(``TinyBaseConfig``) with random weights (speed does not depend on the weights). One thread (the
learner's core in the asynchronous layout).

FLOPs (counted on real tokens only, so padding shows up as lost efficiency): per token and layer,
2 x (matmul parameters) for the projections and MLP, plus 4 x hidden x (causal context length)
for attention scores and values; the LM head (actor) on response tokens only (the learner keeps
only those logits), the 1-unit value head (critic) everywhere. Recompute = 1 forward, training =
3 forwards (forward + backward), for actor and critic. The reference rate is a 1024^3 fp32
``torch.mm`` on the same thread, measured in the same run.

Writes benchmarks/results/bench_learner.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vapo_async.algo.presets import preset  # noqa: E402
from vapo_async.data.hf_dir import write_random_qwen2  # noqa: E402
from vapo_async.data.tiny_base import TinyBaseConfig  # noqa: E402
from vapo_async.learner.batching import collate, make_plan  # noqa: E402
from vapo_async.learner.models import load_actor, load_critic  # noqa: E402
from vapo_async.learner.update import compute_advantages, ppo_updates, recompute  # noqa: E402
from vapo_async.transport.batch import GroupInfo, RolloutBatch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


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


def step_flops(seqs: RolloutBatch, tb: TinyBaseConfig, vocab: int, epochs: int) -> float:
    """Model FLOPs of one training step on the real tokens of ``seqs`` (see module docstring)."""
    return model_flops(seqs, tb.hidden_size, tb.intermediate_size, tb.num_layers, tb.num_heads, tb.num_kv_heads,
                       vocab, epochs)


def model_flops(seqs: RolloutBatch, d: int, f: int, n_l: int, heads: int, kv_heads: int, vocab: int, epochs: int) -> float:
    """Actor + critic model FLOPs of one step: hidden ``d``, MLP ``f``, ``n_l`` layers (also used by
    tools/device_check.sh)."""
    kv = d // heads * kv_heads
    per_layer_params = d * d * 2 + d * kv * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    total_tok = float(seqs.seq_lens.sum())
    ctx = float(sum(n * (n + 1) / 2 for n in seqs.seq_lens.tolist()))  # sum over tokens of context length
    body = n_l * (2 * per_layer_params * total_tok + 4 * d * ctx)
    resp = float(seqs.response_lens.sum())
    actor_fwd = body + 2 * d * vocab * resp
    critic_fwd = body + 2 * d * total_tok
    return (1 + 3 * epochs) * (actor_fwd + critic_fwd)


def matmul_rate(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bench_config(model_dir: Path, groups: list[RolloutBatch], micro_tokens: int, overhead: float, steps: int,
                 tb: TinyBaseConfig, vocab: int) -> dict:
    algo = preset("vapo")
    actor, critic = load_actor(model_dir), load_critic(model_dir)
    opt_a = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    seqs = RolloutBatch.concat(groups)
    times, pads = [], []
    for s in range(steps + 1):
        plan = make_plan(seqs, 1, algo.mini_batches, micro_tokens, torch.Generator().manual_seed(s), overhead)
        by_slot: dict[int, list[int]] = {}
        for i, slot in zip(plan.rank_index[0], plan.micro_id[0], strict=True):
            by_slot.setdefault(slot, []).append(i)
        t0 = time.perf_counter()
        mbs = [collate(seqs, by_slot[k], 0) for k in range(sum(plan.n_micro))]
        prep = recompute(actor, critic, mbs, 1.0)
        compute_advantages(prep, algo)
        ppo_updates(actor, critic, opt_a, opt_c, prep, [plan.slots(m) for m in range(len(plan.n_micro))],
                    plan.norms, algo, 1.0, train_actor=True, backward=lambda loss: loss.backward(), seed=s)
        if s > 0:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - t0)
            pads.append(plan.padding_fraction)
    flops = step_flops(seqs, tb, vocab, algo.ppo_epochs)
    med = float(np.median(times))
    return {"micro_batch_tokens": micro_tokens, "overhead_tokens": overhead, "n_micro": sum(plan.n_micro),
            "step_s_median": med, "step_s_all": times,
            "tokens_per_step": float(seqs.seq_lens.sum()), "tokens_per_s": float(seqs.seq_lens.sum()) / med,
            "flops_per_step": flops, "achieved_flops": flops / med, "padding_fraction": float(np.mean(pads))}


def _overhead(o: float) -> str:
    return "greedy fill" if o >= 1e8 else f"{o:.0f}"


def write_report(res: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_learner.json").write_text(json.dumps(res, indent=1))
    peak = res["matmul_flops"]
    rows = "\n".join(
        f"| {c['micro_batch_tokens']} | {_overhead(c['overhead_tokens'])} | {c['n_micro']} | {c['step_s_median']:.2f} | {c['tokens_per_s']:.0f} | "
        f"{c['achieved_flops'] / 1e9:.2f} | {100 * c['achieved_flops'] / peak:.1f}% | {100 * c['padding_fraction']:.1f}% |"
        for c in res["configs"])
    best = max(c["achieved_flops"] for c in res["configs"]) / peak
    md = f"""# bench_learner: learner training throughput on the tiny preset

Machine: {res['machine']}; torch threads: {res['threads']}; 1-min load average at the end {res['load_end']:.1f}
(other jobs may share the machine: read the load; figures are then lower bounds). Model: tiny-base architecture (hidden {res['model']['hidden_size']},
{res['model']['num_layers']} layers, vocab {res['model']['vocab']}, {res['model']['params_m']:.2f} M parameters per model),
random weights. Batch: {res['batch']}. One step = recompute + GAE + {res['mini_batches']} mini-batch updates of actor and critic.
Reference: fp32 1024^3 torch.mm on the same thread: **{peak / 1e9:.1f} GFLOP/s**.

| micro-batch tokens | cut price (tokens) | micro-batches | step s (median) | tokens/s | achieved GFLOP/s | of matmul rate | padding |
|---|---|---|---|---|---|---|---|
{rows}

Target: >= 50% of the matmul rate. Best configuration: **{100 * best:.1f}%** -> {'met' if best >= 0.5 else 'NOT met'}.

Reading: at hidden {res['model']['hidden_size']} every matmul is small (tokens x {res['model']['hidden_size']} @ {res['model']['hidden_size']} x {res['model'].get('intermediate_size', '?')}), so per-op
overheads (Python and module dispatch of Hugging Face Qwen2 layers, RMSNorm/RoPE/softmax kernels,
optimizer steps, log-softmax over the vocabulary) weigh as much as the matmuls; larger micro-batches
amortise them but pad more; the learner's cut price trades the two (``batching.micro_batches``). The figure is a property of the tiny model on a CPU thread, not of the
learner's algorithm; the GPU check (tools/device_check.sh) measures the same code on a ~0.5B model.
"""
    (RESULTS / "bench_learner.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [f"{c['micro_batch_tokens']}\n{_overhead(c['overhead_tokens'])}" for c in res["configs"]]
    ax.bar(xs, [c["achieved_flops"] / 1e9 for c in res["configs"]], label="learner (model FLOPs on real tokens)")
    ax.axhline(peak / 1e9, color="k", ls="--", label="fp32 matmul 1024^3")
    ax.axhline(0.5 * peak / 1e9, color="r", ls=":", label="target 50%")
    ax.set_xlabel("micro-batch token budget / cut price")
    ax.set_ylabel("GFLOP/s (one thread)")
    ax.legend(fontsize=8)
    ax.set_title("Learner step on the tiny preset")
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_learner.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tb = TinyBaseConfig()
    steps = 2 if args.quick else 4
    # (token budget, price of a cut): the learner's default is (16384, 256); 1e9 = fill greedily
    configs = [(16384, 256.0)] if args.quick else [(16384, 1e9), (16384, 256.0), (16384, 1024.0),
                                                          (4096, 256.0), (2048, 256.0), (1024, 256.0)]
    with tempfile.TemporaryDirectory() as tmp:
        texts = [f"Ann has {a} apples and buys {b}. Answer: {a + b}" for a in range(60) for b in range(0, 60, 7)]
        model_dir = write_random_qwen2(Path(tmp) / "m", texts, vocab_size=tb.vocab_size, shape=tb.shape(), seed=0)
        vocab = load_actor(model_dir).config.vocab_size
        algo = preset("vapo")
        groups = make_batch(algo.batch_groups, algo.group_size, vocab, seed=0)
        peak = matmul_rate()
        results = [bench_config(model_dir, groups, m, o, steps, tb, vocab) for m, o in configs]
        peak = max(peak, matmul_rate())  # measured before and after: keep the better (shared machine)
        params = sum(p.numel() for p in load_actor(model_dir).parameters())
    res = {
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "threads": args.threads,
        "load_end": os.getloadavg()[0], "matmul_flops": peak, "configs": results,
        "batch": f"{algo.batch_groups} groups x G={algo.group_size}, prompts 40-80 tokens, responses 20-200 tokens",
        "mini_batches": algo.mini_batches,
        "model": {**dataclasses.asdict(tb.shape()), "hidden_size": tb.hidden_size, "num_layers": tb.num_layers,
                  "vocab": vocab, "params_m": params / 1e6},
    }
    write_report(res)
    print((RESULTS / "bench_learner.md").read_text())


if __name__ == "__main__":
    main()
