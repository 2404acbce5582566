"""worker_rss: resident memory of a vLLM CPU worker that samples varied batches between reloads.

    python benchmarks/worker_rss.py                 # both variants, 60 rounds each (~6 min on 2 cores)
    python benchmarks/worker_rss.py --rounds 120

The soak (benchmarks/soak.py) saw every vLLM worker's RSS climb for the whole run. This isolates
it: one ``VLLMEngine`` (multiprocess, the tiny base, 256 MiB KV cache, max_model_len 1024); each
round publishes a new weights version, reloads it, then samples 2-8 random prompts of 5-60 numbers
x 8 responses of 32-200 tokens (seeded), so batch shapes differ from step to step as in training.
The worker's RSS (psutil) is read every ``--every`` rounds. Variants, each in a fresh process:

- ``vllm defaults``: ``VAPO_CPU_WORKER_ENV=0`` (oneDNN keeps up to 1024 kernels, one per matmul
  shape; glibc's adaptive mmap threshold);
- ``project defaults``: ``vapo_async.generator.engine.CPU_WORKER_ENV`` (what generators use).

Writes benchmarks/results/worker_rss.{json,md,png}. Growth = last reading - first reading after
round ``--every`` (engine start and the first shapes excluded); the soak's target is <= 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {"vllm defaults": {"VAPO_CPU_WORKER_ENV": "0"}, "project defaults": {}}


def worker_rss_mib() -> float:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "Worker" in child.name():
                return child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError("no vLLM worker process found under this one")


def workload(base: Path, rounds: int, every: int, tmp: Path) -> list[tuple[int, float]]:
    """Run in a child process; returns (round, worker RSS MiB) readings, round 0 = after start."""
    from safetensors.torch import load_file

    from vapo_async.common.engine import EngineConfig
    from vapo_async.common.sampling import GroupSamplingConfig
    from vapo_async.generator.engine import VLLMEngine
    from vapo_async.transport.publisher import WeightPublisher

    pub = WeightPublisher(tmp / "weights", base, keep=3)
    sd = load_file(base / "model.safetensors")
    engine = VLLMEngine(base, EngineConfig(max_model_len=1024, kv_cache_bytes=256 << 20), 0)
    rng = random.Random(0)
    readings = [(0, worker_rss_mib())]
    try:
        for r in range(1, rounds + 1):
            ann = pub.publish(r, {k: t + 1e-4 * r for k, t in sd.items()})
            engine.reload(ann.path, r)
            for j in range(rng.randint(2, 8)):
                numbers = " ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(5, 60)))
                engine.submit(f"{r}-{j}", f"Question: {numbers} Step:",
                              GroupSamplingConfig(group_size=8, max_tokens=rng.randint(32, 200)))
            while engine.has_work():
                engine.step()
            if r % every == 0:
                readings.append((r, worker_rss_mib()))
    finally:
        engine.shutdown()
        pub.close()
    return readings


def run_variant(name: str, base: Path, rounds: int, every: int) -> dict:
    env = {**os.environ, **VARIANTS[name]}
    for key in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(key, None)  # neither inherited from this shell nor from an earlier variant
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "readings.json"
        cmd = [sys.executable, __file__, "--child", str(base), str(rounds), str(every), str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        readings = json.loads(out.read_text())
    first, last = readings[1][1], readings[-1][1]
    return {"variant": name, "env": VARIANTS[name], "readings": readings, "wall_s": time.monotonic() - t0,
            "growth_mib": last - first, "growth_pct": 100 * (last - first) / first}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        xs, ys = zip(*res["readings"], strict=True)
        ax.plot(xs, ys, marker="o", label=f"{res['variant']} ({res['growth_pct']:+.1f}%)")
    ax.set_xlabel("round (reload + a varied batch)")
    ax.set_ylabel("vLLM worker RSS (MiB)")
    ax.set_title("vLLM CPU worker memory under varied batch shapes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(results: list[dict], meta: dict) -> str:
    every = results[0]["readings"][1][0]
    lines = ["# worker_rss: a vLLM CPU worker's memory under varied batches", "",
             f"Produced by `python benchmarks/worker_rss.py --rounds {meta['rounds']}` on {meta['cpus']} CPU cores "
             f"({meta['platform']}); load average at the end {meta['load_end']:.1f}. Tiny base, multiprocess engine, "
             "256 MiB KV cache; each round: publish + reload a new version, then 2-8 random prompts x 8 responses "
             "of 32-200 tokens.", "",
             f"| variant | environment | RSS after round {every} (MiB) | RSS at the end (MiB) | growth | target |",
             "|---|---|---|---|---|---|"]
    for res in results:
        env = ", ".join(f"{k}={v}" for k, v in res["env"].items()) or "CPU_WORKER_ENV"
        lines.append(f"| {res['variant']} | {env} | {res['readings'][1][1]:.0f} | {res['readings'][-1][1]:.0f} | "
                     f"{res['growth_mib']:+.0f} MiB ({res['growth_pct']:+.1f}%) | <= 5% |")
    lines += ["", "![worker rss](worker_rss.png)", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--model", type=Path, help="a HF model dir (default: the tiny base, built if needed)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        base, rounds, every, out = args.child
        with tempfile.TemporaryDirectory() as tmp:
            readings = workload(Path(base), int(rounds), int(every), Path(tmp))
        Path(out).write_text(json.dumps(readings))
        return
    if args.rounds < 2 * args.every:
        p.error(f"--rounds must be at least 2 x --every ({2 * args.every})")
    if args.model is None:
        from vapo_async.data.tiny_base import TinyBaseConfig, ensure_tiny_base

        args.model = ensure_tiny_base(TinyBaseConfig())
    results = [run_variant(name, args.model, args.rounds, args.every) for name in VARIANTS]
    meta = {"cpus": os.cpu_count(), "platform": platform.machine(), "load_end": os.getloadavg()[0],
            "rounds": args.rounds}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "worker_rss.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (RESULTS / "worker_rss.md").write_text(markdown(results, meta))
    plot(results, RESULTS / "worker_rss.png")
    for res in results:
        print(f"{res['variant']}: {res['growth_mib']:+.0f} MiB ({res['growth_pct']:+.1f}%)")


if __name__ == "__main__":
    main()
