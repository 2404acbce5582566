"""bench_async: synchronous (eta = 0) vs asynchronous (eta = 4) training throughput against the
ideal overlap bound, one generator and one learner, each pinned to its own core.

    python benchmarks/bench_async.py                 # ~10 min on 2 cores
    python benchmarks/bench_async.py --steps 6       # shorter
    python benchmarks/bench_async.py --report-only   # rebuild md/png from the JSON

Each run: ``taskset -c 0 python -m vapo_async.learner generators.local=0 algo.eta=ETA ...`` (one
torch thread) and ``taskset -c 1 python -m vapo_async.generator controller=...`` (vLLM's OpenMP
threads bound to core 1), the tiny base model (random tiny weights with ``--random-model``), the
VAPO preset without value pretraining (every step trains actor and critic).

Stand-alone stage timings come from the eta = 0 run itself, where the stages cannot overlap:
T_gen = the learner's wait for a batch (the generator produces the whole batch after the previous
step is done), T_train = the learner's busy time per step (recompute, updates, publishing). The
ideal speed-up of overlapping them is (T_gen + T_train) / max(T_gen, T_train); the measured
speed-up is trained tokens/s at eta = 4 over eta = 0 (steady state: the first ``--skip`` steps are
dropped). Target: measured >= 90% of the bound. The learner idle fraction is its wait / step time.

Writes benchmarks/results/bench_async.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def model_dir(random_model: bool, tmp: Path) -> str:
    sys.path.insert(0, str(REPO / "src"))
    if random_model:
        from vapo_async.data.hf_dir import write_random_qwen2
        from vapo_async.data.tiny_base import TinyBaseConfig

        tb = TinyBaseConfig()
        texts = [f"Ann has {a} apples and buys {b}.\nAnswer: {a + b}" for a in range(60) for b in range(0, 60, 7)]
        return str(write_random_qwen2(tmp / "random", texts, vocab_size=tb.vocab_size, shape=tb.shape(), seed=0))
    from vapo_async.data.tiny_base import TinyBaseConfig, ensure_tiny_base

    return str(ensure_tiny_base(TinyBaseConfig()))


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, wall_time, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.wall_time, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def run(eta: int, steps: int, model: str, work: Path, max_tokens: int) -> dict:
    run_dir = work / f"eta{eta}"
    endpoint = f"ipc://{work}/ctl{eta}"
    learner = subprocess.Popen(
        ["taskset", "-c", "0", PY, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", f"model.path={model}",
         "generators.local=0", f"algo.eta={eta}", "algo.value_warmup_steps=0", f"trainer.max_steps={steps}",
         "trainer.accelerator=cpu", "eval.every_n_steps=0", f"sampling.max_tokens={max_tokens}",
         f"controller.transport.endpoint={endpoint}", "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false"],
        env=_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    gen_log = open(work / f"generator-eta{eta}.log", "w")  # noqa: SIM115
    generator = subprocess.Popen(
        ["taskset", "-c", "1", PY, "-m", "vapo_async.generator", f"controller={endpoint}", f"model={model}",
         "generator_id=bench", "max_prompts=16", "engine.max_model_len=512"],
        env=_env(VLLM_CPU_OMP_THREADS_BIND="1", OMP_NUM_THREADS="1"), stdout=gen_log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        _, err = learner.communicate(timeout=3600)
    finally:
        from vapo_async.common.procs import stop_processes

        stop_processes([generator], signal.SIGTERM, timeout_s=60, group=True)
        gen_log.close()
    if learner.returncode != 0:
        raise RuntimeError(f"learner eta={eta} failed ({learner.returncode}):\n{err[-3000:]}")
    return scalars(run_dir / "tb")


def summarize(s: dict, skip: int) -> dict:
    """Steady-state figures of one run: steps skip .. N-1 (their tokens over the wall time from the
    end of step skip - 1 to the end of step N - 1)."""
    def vals(tag: str) -> np.ndarray:
        return np.array([v for step, _, v in s[tag] if step >= skip])

    wall = {step: w for step, w, _ in s["train/step"]}
    last = max(wall)
    trained = float(vals("batch/tokens").sum())
    span = wall[last] - wall[skip - 1]
    busy = vals("perf/update_s") + vals("perf/publish_s")
    return {
        "steps": int(last - skip + 1), "tokens_per_s": trained / span,
        "step_s": float(np.median(vals("perf/step_s"))), "wait_s": float(np.median(vals("perf/wait_s"))),
        "train_s": float(np.median(busy)), "idle_fraction": float(np.mean(vals("perf/learner_idle_fraction"))),
        "staleness_mean": float(np.mean(vals("async/staleness_mean"))),
        "dropped_stale": float(vals("async/dropped_stale").sum()),
        "tokens_per_step": float(np.mean(vals("batch/tokens"))),
    }


def write_report(res: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_async.json").write_text(json.dumps(res, indent=1))
    s0, s4 = res["eta0"], res["eta4"]
    t_gen, t_train = s0["wait_s"], s0["train_s"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    speedup = s4["tokens_per_s"] / s0["tokens_per_s"]
    eff = speedup / bound
    res.update(bound=bound, speedup=speedup, efficiency=eff)
    (RESULTS / "bench_async.json").write_text(json.dumps(res, indent=1))
    md = f"""# bench_async: eta = 0 (synchronous) vs eta = 4, one generator + one learner, one core each

Machine: {res['machine']}; 1-min load average at the end {res['load_end']:.1f} (shared machine: other
processes also ran on both cores). Model: {res['model']}. VAPO preset, no value pretraining,
{res['steps']} steps per run, first {res['skip']} dropped. Learner: `taskset -c 0`, 1 torch thread;
generator: `taskset -c 1`, vLLM OpenMP threads bound to core 1.

Stand-alone stage times (eta = 0 run, medians): T_gen = {t_gen:.2f} s (learner waiting for the batch),
T_train = {t_train:.2f} s (learner busy). Ideal overlap bound (T_gen + T_train) / max(T_gen, T_train)
= **{bound:.2f}x**.

| | eta = 0 | eta = 4 |
|---|---|---|
| trained tokens/s | {s0['tokens_per_s']:.0f} | {s4['tokens_per_s']:.0f} |
| step s (median) | {s0['step_s']:.2f} | {s4['step_s']:.2f} |
| learner wait s (median) | {s0['wait_s']:.2f} | {s4['wait_s']:.2f} |
| learner busy s (median) | {s0['train_s']:.2f} | {s4['train_s']:.2f} |
| learner idle fraction | {s0['idle_fraction']:.2f} | {s4['idle_fraction']:.2f} |
| token staleness (mean versions) | {s0['staleness_mean']:.2f} | {s4['staleness_mean']:.2f} |
| groups dropped as stale | {s0['dropped_stale']:.0f} | {s4['dropped_stale']:.0f} |

Measured speed-up {speedup:.2f}x = **{100 * eff:.0f}% of the bound** (target >= 90%:
{'met' if eff >= 0.9 else 'NOT met'}).
"""
    (RESULTS / "bench_async.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.bar(["eta=0", "eta=4", "ideal"], [s0["tokens_per_s"], s4["tokens_per_s"], s0["tokens_per_s"] * bound],
           color=["C0", "C1", "0.7"])
    ax.set_ylabel("trained tokens/s")
    ax.set_title(f"async speed-up {speedup:.2f}x of ideal {bound:.2f}x")
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_async.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--random-model", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if args.report_only:
        write_report(json.loads((RESULTS / "bench_async.json").read_text()))
        print((RESULTS / "bench_async.md").read_text())
        return
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        raise SystemExit("bench_async needs taskset and at least 2 cores")
    work = Path(tempfile.mkdtemp(prefix="bench_async-"))
    try:
        model = model_dir(args.random_model, work)
        res: dict = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "steps": args.steps,
                     "skip": args.skip, "model": "random tiny-base-shaped Qwen2" if args.random_model else model}
        for eta in (0, 4):
            t = time.time()
            res[f"eta{eta}"] = summarize(run(eta, args.steps, model, work, args.max_tokens), args.skip)
            res[f"eta{eta}"]["wall_s"] = time.time() - t
        res["load_end"] = os.getloadavg()[0]
        write_report(res)
        print((RESULTS / "bench_async.md").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
