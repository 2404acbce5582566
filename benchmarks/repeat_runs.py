"""repeat_runs: the default run with several seeds; did each complete without a crash, and where did
held-out accuracy end?

    python benchmarks/repeat_runs.py                          # seeds 0 1 2, 30 min each (the default run)
    python benchmarks/repeat_runs.py --minutes 8              # shorter runs (labelled as such)
    python benchmarks/repeat_runs.py --minutes 8 --append eval.every_n_steps=0   # a variant, added
    python benchmarks/repeat_runs.py --report-only            # rebuild md/png from the JSON

Each run is the README's command, ``python -m vapo_async.learner seed=S`` (plus ``hydra.run.dir``
and a free controller port, which do not change the run), stopped with SIGINT after ``--minutes``
like ``default_run.py``. A run counts as a crash when the learner exits before its time with a
non-zero code (or a zero code without any held-out accuracy); stopping it at the time budget is
not a crash. Recorded per seed: status, exit code, steps, final and best held-out accuracy
(``eval/accuracy``: avg@16, temperature 1.0, every 10 steps) and, for runs without held-out
evaluation, the training-rollout accuracy (``rollout/accuracy``, mean of the last 10 steps).
Extra positional arguments are learner overrides (a variant of the default run, named by them).

Writes benchmarks/results/repeat_runs.{json,md,png}.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _curves import final_value, markdown_table, mean_std, plot_curves
from _records import RESULTS, RunRecord, load_records, run_meta, save_records
from _runs import run_learner

JSON, MD, PNG = (RESULTS / f"repeat_runs.{ext}" for ext in ("json", "md", "png"))


def status_of(rec: RunRecord) -> str:
    """``completed`` (ran its budget or finished), or ``crash``."""
    evaluates = not any(o.startswith("eval.every_n_steps=0") for o in rec.overrides)
    if rec.status == "timeout" or rec.returncode == 0:
        if evaluates and not rec.curve("eval/accuracy"):
            return "crash (no held-out accuracy)"
        return "completed" if rec.curve("train/version") else "crash (no training step)"
    return "crash"


def rollout_tail(rec: RunRecord, n: int = 10) -> float | None:
    """Mean training-rollout accuracy over the last ``n`` steps."""
    pts = rec.curve("rollout/accuracy")[-n:]
    return sum(v for _, v in pts) / len(pts) if pts else None


def variant(rec: RunRecord) -> str:
    return "default" + (" + " + " ".join(rec.overrides) if rec.overrides else "")


def write_report(meta: dict, records: list[RunRecord]) -> None:
    rows, finals = [], []
    for r in records:
        ev = r.curve("eval/accuracy")
        fin = final_value(ev)
        if fin is not None:
            finals.append(fin)
        best = max(ev, key=lambda p: p[1]) if ev else None
        ro = rollout_tail(r)
        rows.append([variant(r), r.seed, status_of(r), "-" if r.returncode is None else r.returncode,
                     f"{r.wall_s / 60:.1f}", len(r.curve("train/version")),
                     "-" if not ev else f"{100 * ev[0][1]:.1f}%",
                     "-" if fin is None else f"{100 * fin:.1f}% (step {int(ev[-1][0])})",
                     "-" if best is None else f"{100 * best[1]:.1f}% (step {int(best[0])})",
                     "-" if ro is None else f"{100 * ro:.1f}%"])
    m, sd = mean_std(finals)
    crashes = sum(status_of(r) != "completed" for r in records)
    table = markdown_table(["run", "seed", "status", "exit code", "minutes", "steps", "held-out at step 0",
                            "final held-out", "best held-out", "rollout acc. (last 10 steps)"], rows)
    summary = "none" if m is None else f"{100 * m:.1f}% ± {100 * (sd or 0):.1f}% over {len(finals)} runs"
    notes = "\n".join(f"- {n}" for n in meta.get("notes", []))
    MD.write_text(f"""# Repeated default runs

{meta['label']}

Command per seed: `python -m vapo_async.learner seed=S [overrides]` (default configuration: tiny base,
synthetic task, VAPO, one local vLLM generator), stopped with SIGINT after {meta['minutes']:.0f} min of wall
time ("completed" = ran until stopped or finished without a crash). {meta['machine']}, {meta['date']},
commit {meta['commit']}. Held-out accuracy = `eval/accuracy`
(avg@16 at temperature 1.0 on 64 held-out problems, every 10 steps).

{table}

Crashes: **{crashes} of {len(records)}** (target 0). Final held-out accuracy: {summary}.

{notes}

![accuracy per run](repeat_runs.png)
""")
    curves = {f"{variant(r)}, seed {r.seed}": [r.curve("eval/accuracy") or r.curve("rollout/accuracy")]
              for r in records if r.curve("eval/accuracy") or r.curve("rollout/accuracy")}
    plot_curves(curves or {"(no curves)": [[(0.0, 0.0)]]}, PNG,
                f"repeated runs ({meta['minutes']:.0f} min each): held-out, else rollout accuracy",
                "accuracy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--append", action="store_true", help="add to the existing JSON instead of replacing it")
    p.add_argument("--note", action="append", default=[], help="a line for the report")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("overrides", nargs="*", help="learner overrides of this variant")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        meta, records = load_records(JSON)
        meta["notes"] = meta.get("notes", []) + args.note
        save_records(JSON, records, meta)
        write_report(meta, records)
        return
    if args.append and JSON.exists():
        meta, records = load_records(JSON)
    else:
        meta = run_meta(f"{args.minutes} min per seed", "default run, repeated seeds", ["default"])
        meta["minutes"] = args.minutes
        meta["label"] = ("Full default runs (30 min each)." if args.minutes >= 30 else
                         f"Short runs: {args.minutes:.0f} min each instead of the default run's 30 min, so final "
                         "accuracies are those reached within that budget, not the default run's.")
        records = []
    meta["notes"] = meta.get("notes", []) + args.note
    with tempfile.TemporaryDirectory(prefix="repeat-") as tmp:
        for seed in args.seeds:
            rec = RunRecord("default", seed, list(args.overrides))
            t0 = time.monotonic()
            run_learner(rec, Path(tmp) / f"seed{seed}", timeout_s=60 * args.minutes, grace_s=120)
            fin = final_value(rec.curve("eval/accuracy"))
            print(f"{variant(rec)} seed {seed}: {status_of(rec)} in {time.monotonic() - t0:.0f} s, final "
                  f"eval/accuracy {'-' if fin is None else f'{fin:.3f}'}", flush=True)
            if status_of(rec) != "completed":
                print(rec.log_tail, flush=True)
            records.append(rec)
            save_records(JSON, records, meta)
    write_report(meta, records)


if __name__ == "__main__":
    main()
