"""Benchmark: peak memory of log-probs + entropy + their backward at Qwen's 151,936-word vocabulary.

    python benchmarks/bench_logits_memory.py            # ~2-4 min on 2 CPU cores
    python benchmarks/bench_logits_memory.py --tokens 2048 4096

For N tokens (default 2048, 4096, 8192) of hidden size 896 (Qwen2.5-0.5B) with random fp32 weights, each
variant runs in a fresh process and reports its peak RSS above what it held before the call
(hidden states, the output embedding and their gradient buffers excluded), and its seconds:
- ``full logits`` (the learner before issue 19): logits = h W^T / T, then ``gather_logprobs`` and
  ``entropy_from_logits`` on the (N, V) tensor, backward through autograd;
- ``chunked`` (the learner now): ``algo.chunked.logprob_entropy``, the function
  ``learner.models.actor_logprobs`` calls, with its default chunk.
Target: chunked peak <= 1/8 of the full-logits peak. The ceiling (N x V x 4 bytes, one fp32 copy of
the logits) is printed beside them. Results: benchmarks/results/bench_logits_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB, HIDDEN, TEMPERATURE = 151_936, 896, 0.7


def child(variant: str, tokens: int) -> None:
    import torch

    from vapo_async.algo.chunked import DEFAULT_CHUNK, logprob_entropy
    from vapo_async.algo.stats import entropy_from_logits, gather_logprobs

    torch.manual_seed(0)
    h = torch.randn(tokens, HIDDEN).requires_grad_()
    w = torch.randn(VOCAB, HIDDEN).mul_(0.02).requires_grad_()  # in place: no temporary in the baseline peak
    ids = torch.randint(0, VOCAB, (tokens,))
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)  # gradient buffers exist before the call
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if variant == "full":
        logits = (h @ w.t())[None] / TEMPERATURE  # (1, N, V)
        logp, ent = gather_logprobs(logits, ids[None])[0], entropy_from_logits(logits)[0]
    else:
        logp, ent = logprob_entropy(h, w, ids, TEMPERATURE, DEFAULT_CHUNK)
    (logp.sum() + 0.01 * ent.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": variant, "peak_above_start_gib": (peak - before) / 2**20, "seconds": seconds,
                      "chunk": DEFAULT_CHUNK, "logp_mean": float(logp.detach().mean()), "entropy_mean": float(ent.detach().mean())}))


def run_variant(variant: str, tokens: int, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(tokens)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:  # the full-logits path is killed by the kernel when it does not fit
        return {"variant": variant, "tokens": tokens, "failed": f"exit {out.returncode}"
                + (" (SIGKILL: out of memory)" if out.returncode == -9 else ""), "stderr": out.stderr[-500:]}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--child", choices=["full", "chunked"])
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens[0])
        return
    meta = run_meta("default", f"log-prob + entropy + backward, {args.tokens} tokens x {VOCAB} words",
                    ["full", "chunked"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")]))
    rows = []
    for tokens in args.tokens:
        for variant in ("full", "chunked"):
            rows.append(run_variant(variant, tokens, env))
            print(rows[-1], flush=True)
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = ["| tokens | variant | peak above start GiB | seconds | one fp32 logits copy GiB |", "|---" * 5 + "|"]
    verdicts = []
    for tokens in args.tokens:
        full, chunked = (next(r for r in rows if r["tokens"] == tokens and r["variant"] == v) for v in ("full", "chunked"))
        for r in (full, chunked):
            label = r["variant"] + (f" (chunk {r['chunk']})" if "chunk" in r and r["variant"] == "chunked" else "")
            cells = (f"{r['peak_above_start_gib']:.2f} | {r['seconds']:.1f}" if "failed" not in r
                     else f"{r['failed']} | -")
            table.append(f"| {tokens} | {label} | {cells} | {tokens * VOCAB * 4 / 2**30:.2f} |")
        if "failed" in chunked:
            verdicts.append(f"{tokens} tokens: chunked failed ({chunked['failed']}): MISSED")
        elif "failed" in full:
            verdicts.append(f"{tokens} tokens: the full-logits path does not fit in this machine's memory "
                            f"({full['failed']}); chunked peaks at {chunked['peak_above_start_gib']:.2f} GiB")
        else:
            ratio = chunked["peak_above_start_gib"] / full["peak_above_start_gib"]
            verdicts.append(f"{tokens} tokens: chunked / full = {ratio:.3f} (1/{1 / ratio:.0f}): "
                            f"{'met' if ratio <= 1 / 8 else 'MISSED'} (target <= 1/8)")
    md = ("# bench_logits_memory\n\n"
          f"Commit {meta['commit']}, {meta['date']}, {meta['machine']}, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; load average at start {meta['load_avg_start']}, at end "
          f"{meta['load_avg_end']}. Hidden {HIDDEN}, vocabulary {VOCAB}, fp32, CPU; peak RSS above the inputs and "
          "their gradient buffers (the V x H weight gradient that both variants return is inside the figure), "
          "each variant in a fresh process.\n\n" + "\n".join(table) + "\n\n"
          + "\n".join(f"- {v}" for v in verdicts) + "\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_logits_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / "bench_logits_memory.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
