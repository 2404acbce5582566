"""default_run: the measured default run (``python -m vapo_async.learner`` with no arguments).

    python benchmarks/default_run.py                  # 30 min budget (+ start-up)
    python benchmarks/default_run.py --minutes 10     # shorter budget
    python benchmarks/default_run.py --report-only    # rebuild md/png from the JSON
    python benchmarks/default_run.py --set model.tiny.error_rate=0.2 --name default_run_er02

``--set`` adds learner overrides to the command (the run is then the default run plus them; the
report names them); ``--name`` is the results' file stem (default ``default_run``).

Runs the README's command, ``python -m vapo_async.learner``, adding only ``hydra.run.dir`` (where
the run goes); stops it with SIGINT once ``--minutes`` of wall time have passed (Lightning stops
cleanly and the learner stops its generator). The tiny base is built first if it is not cached
(its build time is reported separately and not counted in the budget). Reads the run's
TensorBoard scalars and records held-out accuracy (``eval/accuracy``: avg@16 at temperature 1.0 on
64 held-out synthetic problems, every 10 steps and at step 0) against wall time and steps, with
the rollout accuracy and throughput figures. Target: held-out accuracy >= 85% within 30 minutes.

Writes benchmarks/results/{name}.{json,md,png}.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package (common.procs)
sys.path.insert(0, str(REPO / "benchmarks"))
import _runs as R  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TARGET = 0.85
TAGS = ("eval/accuracy", "rollout/accuracy", "rollout/reward_mean", "rollout/response_length_mean",
        "critic/explained_variance", "train/version", "train/value_warmup", "perf/step_s",
        "perf/learner_idle_fraction", "perf/learner_tokens_per_s", "perf/generator_tokens_per_s",
        "async/staleness_mean", "actor/entropy")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def run(run_dir: Path, minutes: float, overrides: list[str]) -> tuple[float, int, float]:
    """The default command plus ``overrides``; returns (wall seconds, exit code, start time)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    start = time.time()
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", *overrides], env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=minutes * 60)
    except subprocess.TimeoutExpired:
        from vapo_async.common.procs import stop_processes

        stop_processes([proc], signal.SIGINT, timeout_s=120, group=True)
    log.close()
    return time.time() - start, proc.returncode, start


def read_curves(tb_dir: Path, start: float) -> dict[str, list[list[float]]]:
    """{tag: [[step, minutes since start, value], ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    have = set(ea.Tags()["scalars"])
    return {t: [[e.step, (e.wall_time - start) / 60, e.value] for e in ea.Scalars(t)] for t in TAGS if t in have}


def _load_start(res: dict) -> str:
    value = res.get("load_start")
    return "not recorded" if value is None else f"{value:.1f}"


def write_report(res: dict, name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
    extra = " ".join(res.get("overrides", []))
    command = "python -m vapo_async.learner" + (f" {extra}" if extra else "")
    ev = res["curves"].get("eval/accuracy", [])
    base = ev[0][2] if ev else float("nan")
    best = max((p[2] for p in ev), default=float("nan"))
    within = [p for p in ev if p[1] <= res["budget_min"]]
    reached = next((p for p in within if p[2] >= TARGET), None)
    final = within[-1] if within else None
    rows = "\n".join(f"| {int(p[0])} | {p[1]:.1f} | {100 * p[2]:.1f}% |" for p in ev)
    verdict = (f"reached {100 * reached[2]:.1f}% at step {int(reached[0])}, {reached[1]:.1f} min: target met"
               if reached else f"best {100 * best:.1f}% within the budget: target NOT met")
    steps = res["curves"].get("train/version", [])
    md = f"""# The default run, measured

Command: `{command}` (only `hydra.run.dir` added), stopped after {res['budget_min']:.0f} min
of wall time. Machine: {res['machine']}; 1-min load average at the end {res['load_end']:.1f} (it counts the run's
own learner, generator and vLLM threads; the load before the run: {_load_start(res)}).
Tiny base: {'built before the run in ' + format(res['base_build_s'], '.0f') + ' s (not counted)' if res['base_build_s'] > 30 else 'cached'}.
Wall time of the run: {res['wall_s'] / 60:.1f} min, exit code {res['returncode']}, {len(steps)} training steps.

Held-out accuracy (`eval/accuracy`: avg@16, temperature 1.0, 64 held-out synthetic problems):

| step | minutes | avg@16 |
|---|---|---|
{rows}

Base model: {100 * base:.1f}%. Target >= {100 * TARGET:.0f}% within 30 min: **{verdict}**.
{'Final within budget: ' + format(100 * final[2], '.1f') + '% at ' + format(final[1], '.1f') + ' min.' if final else ''}

Curves: {name}.png (held-out and rollout accuracy against wall time and steps).
"""
    (RESULTS / f"{name}.md").write_text(md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, xi, label in ((axes[0], 1, "wall time (min)"), (axes[1], 0, "training step")):
        for tag, style in (("eval/accuracy", "o-"), ("rollout/accuracy", "-")):
            pts = res["curves"].get(tag, [])
            if pts:
                ax.plot([p[xi] for p in pts], [p[2] for p in pts], style, label=tag, ms=3, lw=1)
        ax.axhline(TARGET, color="r", ls=":", label="target 85%")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].axvline(res["budget_min"], color="k", ls="--", lw=0.8)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=8)
    fig.suptitle("Default run: tiny base, synthetic task, VAPO, 1 local generator (2 CPU cores)"
                 + (f"\nwith {extra}" if extra else ""), fontsize=10 if extra else None)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], help="learner overrides added to the command")
    ap.add_argument("--name", default="default_run", help="results file stem")
    args = ap.parse_args()
    if args.report_only:
        write_report(json.loads((RESULTS / f"{args.name}.json").read_text()), args.name)
        print((RESULTS / f"{args.name}.md").read_text())
        return
    build_s = R.ensure_bases([args.set])
    load_start = os.getloadavg()[0]
    run_dir = RESULTS / "tmp" / args.name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    wall, code, start = run(run_dir, args.minutes, args.set)
    res = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "budget_min": args.minutes,
           "overrides": args.set,
           "base_build_s": build_s, "wall_s": wall, "returncode": code, "load_end": os.getloadavg()[0],
           "load_start": load_start,
           "curves": read_curves(run_dir / "tb", start)}
    write_report(res, args.name)
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
