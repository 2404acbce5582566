"""soak: a long run with two generators, watched for memory growth, stalls, deadlocks and crashes.

    python benchmarks/soak.py                     # 60 minutes (the issue's default)
    python benchmarks/soak.py --minutes 12        # a short soak (label the result as such)
    python benchmarks/soak.py --report-only       # rebuild md/png from the JSON
    python benchmarks/soak.py --minutes 120 --kill-every-min 20 --name soak_kills   # a generator killed -9 every 20 min

Runs the real learner, ``python -m vapo_async.learner`` with the default configuration plus
``generators.local=2`` (two vLLM generator processes started and stopped by the learner) and a
step budget too large to reach, then stops it with SIGTERM after ``--minutes`` (the clean stop of
learner/stopping.py: exit 143). With ``--kill-every-min N`` the script itself SIGKILLs the process
group of one generator (in turn) every N minutes, as the OOM killer would; the learner's supervisor
must restart each (``generators/restarts``). Meanwhile it samples,
every ``--sample-s`` seconds, the resident memory (RSS, psutil) of every process of the learner's
tree: the learner, each generator, each vLLM engine core, the reward workers.

Measured (targets from issue 6):
- RSS growth per process after warm-up: median RSS over the last ``--window-min`` minutes vs the
  median over the ``--window-min`` minutes after ``--warmup-min`` (target <= 5%);
- stalls: gaps between consecutive training steps (TensorBoard wall times of ``train/version``)
  longer than ``--stall-s``; a deadlock is no step for ``--deadlock-s`` (the run is then stopped;
  target 0);
- crashes: the learner exiting before the stop, or not stopping within 3 min of the SIGTERM
  (target 0); unplanned deaths: a generator or engine process disappearing mid-run other than by
  the script's own kills; restarts: ``generators/restarts`` at the end (target: every kill).

Writes benchmarks/results/soak.{json,md,png} (``--name`` picks another name).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import CURVE_TAGS, RESULTS, read_scalars, run_meta  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
def outputs(name: str) -> tuple[Path, Path, Path]:
    """benchmarks/results/NAME.{json,md,png}."""
    return RESULTS / f"{name}.json", RESULTS / f"{name}.md", RESULTS / f"{name}.png"
RSS_TARGET = 0.05


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def role(p: Any, root_pid: int) -> str:
    """A stable name of a process of the learner's tree."""
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except Exception:  # noqa: BLE001 - it may vanish between listing and reading
        return "gone"
    if p.pid == root_pid:
        return "learner"
    if "vapo_async.generator" in cmd:
        gid = next((a.split("=", 1)[1] for a in p.cmdline() if a.startswith("generator_id=")), "?")
        return f"generator {gid}"
    if "VLLM::Worker" in name or "VLLM::Worker" in cmd:
        parent = p.parent()
        return f"vLLM worker of {role(parent, root_pid) if parent else '?'}"
    if "EngineCor" in name or "EngineCore" in cmd:
        parent = p.parent()
        return f"engine core of {role(parent, root_pid) if parent else '?'}"
    if "rewards" in cmd or "math_verify" in cmd or "verify" in cmd:
        return f"reward worker {p.pid}"
    return f"{name} {p.pid}"


def sample_tree(root_pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (role, RSS MiB)} of the root and all its descendants."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = (role(p, root_pid), p.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
    return out


def last_activity(run_dir: Path) -> float:
    """Newest mtime under the run's weights/, checkpoints/ and tb/ (any sign of a step)."""
    newest = 0.0
    for sub in ("weights", "checkpoints", "tb"):
        d = run_dir / sub
        if d.is_dir():
            for p in d.iterdir():
                newest = max(newest, p.stat().st_mtime)
    return newest


def soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Run and watch the learner; returns the raw measurements."""
    from _runs import free_port_pair

    port = free_port_pair()
    cmd = [sys.executable, "-m", "vapo_async.learner", f"hydra.run.dir={run_dir}", "generators.local=2",
           f"controller.transport.endpoint=tcp://127.0.0.1:{port}", "trainer.max_steps=1000000",
           "trainer.enable_progress_bar=false", *args.overrides]
    log = open(run_dir.parent / "learner.log", "wb")  # noqa: SIM115
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[dict[str, Any]] = []
    seen: dict[int, str] = {}
    vanished: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    deadlock = False
    end = t0 + 60 * args.minutes
    while time.time() < end and proc.poll() is None:
        now = time.time()
        tree = sample_tree(proc.pid)
        if args.kill_every_min and now - t0 >= 60 * args.kill_every_min * (len(kills) + 1):
            kills.append(kill_a_generator(tree, len(kills), now - t0))
        samples.append({"t": now - t0, "rss": {str(pid): [r, mb] for pid, (r, mb) in tree.items()}})
        for pid, (r, _) in tree.items():
            seen.setdefault(pid, r)
        for pid, r in seen.items():
            if pid not in tree and not any(v["pid"] == pid for v in vanished) and r.startswith(("generator", "engine")):
                vanished.append({"pid": pid, "role": r, "t": now - t0})
        active = last_activity(run_dir)
        if active and now - max(active, t0) > args.deadlock_s and now - t0 > args.startup_s:
            deadlock = True
            break
        time.sleep(args.sample_s)
    early_exit = proc.poll()
    children = []
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
    from vapo_async.common.procs import stop_processes

    killed = False
    if early_exit is None:
        (code,) = stop_processes([proc], signal.SIGTERM, timeout_s=180, group=True)
        killed = code == -signal.SIGKILL
    else:
        code = early_exit
    stop_processes(children, signal.SIGKILL)  # generators run in their own sessions
    log.close()
    return {"samples": samples, "vanished": vanished, "kills": kills, "deadlock": deadlock, "early_exit": early_exit,
            "exit_code": code, "killed": killed, "wall_s": time.time() - t0, "cmd": cmd[1:]}


def kill_a_generator(tree: dict[int, tuple[str, float]], k: int, t: float) -> dict[str, Any]:
    """SIGKILL the process group of the ``k``-th generator in turn (the generator and its engine)."""
    gens = sorted((r, pid) for pid, (r, _) in tree.items() if r.startswith("generator "))
    if not gens:
        return {"t": t, "role": None, "pid": None, "note": "no generator alive to kill"}
    r, pid = gens[k % len(gens)]
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return {"t": t, "role": r, "pid": pid, "note": "gone before the kill"}
    print(f"soak: killed {r} (pid {pid}) at {t / 60:.1f} min", flush=True)
    return {"t": t, "role": r, "pid": pid}


def unplanned(vanished: list[dict[str, Any]], kills: list[dict[str, Any]], window_s: float = 120.0) -> list[dict[str, Any]]:
    """Processes lost mid-run that no kill of this script explains (a kill explains the
    generator's processes lost within ``window_s`` after it)."""
    out = []
    for v in vanished:
        gid = next((k["role"] for k in kills if k["role"] and k["role"] in v["role"]
                    and 0 <= v["t"] - k["t"] <= window_s + 10), None)
        if gid is None:
            out.append(v)
    return out


def step_times(run_dir: Path) -> list[list[float]]:
    """[[step, wall time], ...] of every training step (TensorBoard wall time of train/version)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in sorted((run_dir / "tb").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 1, "tensors": 1})
        acc.Reload()
        if "train/version" in acc.Tags().get("scalars", []):
            out.update({int(e.step): float(e.wall_time) for e in acc.Scalars("train/version")})
    return [[float(s), w] for s, w in sorted(out.items())]


def rss_growth(samples: list[dict[str, Any]], warmup_s: float, window_s: float) -> list[dict[str, Any]]:
    """Per process: median RSS over the window that starts ``warmup_s`` after the process's own
    start (the run's start for those there from the beginning) vs over the last window of its
    life; None when it did not live long enough for two separate windows. (A generator restarted
    mid-run has its own warm-up: measured from the run's start, its baseline would be its start-up.)"""
    series: dict[str, list[tuple[float, float, str]]] = {}
    for s in samples:
        for pid, (r, mb) in s["rss"].items():
            series.setdefault(pid, []).append((s["t"], mb, r))
    first_t = min((s["t"] for s in samples), default=0.0)
    rows = []
    for pid, pts in series.items():
        r = pts[-1][2]
        start = warmup_s + max(0.0, pts[0][0] - first_t - 60.0)  # there from the first minute: the run's start
        base = [mb for t, mb, _ in pts if start <= t <= start + window_s]
        last_t = pts[-1][0]
        tail = [mb for t, mb, _ in pts if t >= last_t - window_s]
        if len(base) < 3 or last_t - window_s < start + window_s:
            rows.append({"pid": int(pid), "role": r, "baseline_mb": None, "final_mb": pts[-1][1], "growth": None})
            continue
        b, f = statistics.median(base), statistics.median(tail)
        rows.append({"pid": int(pid), "role": r, "baseline_mb": b, "final_mb": f, "growth": (f - b) / b,
                     "peak_mb": max(mb for _, mb, _ in pts)})
    return sorted(rows, key=lambda x: x["role"])


def analyse(raw: dict[str, Any], run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    steps = step_times(run_dir) if (run_dir / "tb").is_dir() else []
    gaps = [b[1] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    growth = rss_growth(raw["samples"], 60 * args.warmup_min, 60 * args.window_min)
    measured = [g for g in growth if g["growth"] is not None]
    curves = read_scalars(run_dir / "tb", (*CURVE_TAGS, "generators/restarts")) if (run_dir / "tb").is_dir() else {}
    restarts = curves.get("generators/restarts", [])
    return {
        "minutes": args.minutes, "warmup_min": args.warmup_min, "window_min": args.window_min,
        "stall_threshold_s": args.stall_s, "deadlock_threshold_s": args.deadlock_s,
        "steps": len(steps), "step_gap_median_s": statistics.median(gaps) if gaps else None,
        "step_gap_max_s": max(gaps) if gaps else None, "stalls": sum(g > args.stall_s for g in gaps),
        "deadlocks": int(raw["deadlock"]), "restarts": int(restarts[-1][1]) if restarts else 0,
        "killed": raw["killed"], "kills": raw.get("kills", []),
        "unplanned": unplanned(raw["vanished"], raw.get("kills", [])), "vanished": raw["vanished"], "early_exit": raw["early_exit"], "exit_code": raw["exit_code"],
        "rss": growth, "max_growth": max((g["growth"] for g in measured), default=None),
        "rss_target": RSS_TARGET, "step_times": steps, "samples": raw["samples"], "wall_s": raw["wall_s"],
        "cmd": raw["cmd"], "curves": curves,
    }


def crashes(res: dict[str, Any]) -> int:
    """Learner crashes: exiting before the stop, or not stopping within 3 min of the signal.
    (Results before the SIGTERM stop counted lost generator processes here too; see ``unplanned``.)"""
    if "unplanned" not in res:  # an older result: lost processes were crashes
        return len(res["vanished"]) + (res["early_exit"] is not None) + bool(res.get("killed"))
    return (res["early_exit"] is not None) + bool(res.get("killed"))


def write_report(res: dict[str, Any], name: str = "soak") -> None:
    _, MD, PNG = outputs(name)
    res["crashes"] = crashes(res)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    series: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, str] = {}
    for s in res["samples"]:
        for pid, (r, mb) in s["rss"].items():  # vLLM renames its processes after start: key by pid
            series.setdefault(pid, []).append((s["t"] / 60, mb))
            names[pid] = f"{r} ({pid})" if not r.endswith(pid) else r
    for pid, pts in sorted(series.items(), key=lambda kv: names[kv[0]]):
        if max(mb for _, mb in pts) > 50:  # small helpers (resource trackers) are omitted from the plot
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=names[pid], lw=1)
    ax.axvspan(res["warmup_min"], res["warmup_min"] + res["window_min"], color="0.9", label="baseline window")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    ax.set_title(f"soak: {res['minutes']:.0f} min, {res['steps']} steps, {res['stalls']} stalls, "
                 f"{res['deadlocks']} deadlocks, {res['crashes']} crashes")
    st = res["step_times"]
    if len(st) > 1:
        t0 = res["start_time"]
        ax2.plot([(b[1] - t0) / 60 for b in st[1:]], [b[1] - a[1] for a, b in zip(st, st[1:], strict=False)], ".", ms=3)
        ax2.axhline(res["stall_threshold_s"], color="r", lw=0.8, label=f"stall threshold {res['stall_threshold_s']} s")
        ax2.legend(fontsize=7)
    ax2.set_xlabel("minutes since start")
    ax2.set_ylabel("seconds between steps")
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f}"

    rows = "\n".join(f"| {g['role']} | {g['pid']} | {mib(g['baseline_mb'])} | {mib(g['final_mb'])} | {pct(g['growth'])} |"
                     for g in res["rss"] if g["final_mb"] > 20)
    ok = lambda c: "met" if c else "MISSED"  # noqa: E731
    notes = "\n".join(f"- {n}" for n in res.get("notes", []))
    mg = res["max_growth"]
    ev = res.get("curves", {}).get("eval/accuracy", [])
    held_out = "n/a" if not ev else (
        f"{100 * ev[0][1]:.1f}% (step {ev[0][0]:.0f}) -> best {100 * max(v for _, v in ev):.1f}% "
        f"(step {max(ev, key=lambda p: p[1])[0]:.0f}) -> last {100 * ev[-1][1]:.1f}% (step {ev[-1][0]:.0f})")
    MD.write_text(f"""# Soak run

{res['label']}

Command: `python {' '.join(res['cmd'])}` (the default configuration plus two local generators), stopped
with {res.get('stop_signal', 'SIGINT')} after {res['minutes']:.0f} min. Load average (1 min) at start {res['meta'].get('load_avg_start', 'n/a')}, at end {res.get('load_avg_end', 'n/a')}. {res['meta']['machine']}, {res['meta']['date']}, commit {res['meta']['commit']}.
Learner: {res['learner']}. The machine was shared with other jobs (load is not controlled).

| measure | value | target |
|---|---|---|
| training steps | {res['steps']} (median {res['step_gap_median_s'] or 0:.1f} s/step, longest gap {res['step_gap_max_s'] or 0:.1f} s) | |
| stalls (> {res['stall_threshold_s']:.0f} s between steps) | {res['stalls']} | |
| deadlocks (no step for {res['deadlock_threshold_s']:.0f} s) | {res['deadlocks']} | 0 ({ok(res['deadlocks'] == 0)}) |
| learner crashes | {res['crashes']} (exited early: {res['early_exit'] is not None}; exit code after the stop signal: {res['exit_code']}) | 0 ({ok(res['crashes'] == 0)}) |
| generators killed -9 by the script | {len([k for k in res.get('kills', []) if k.get('pid')])} ({f"one every {res['kill_every_min']:g} min" if res.get('kill_every_min') else 'no kills in this run'}) | |
| generator restarts (`generators/restarts`) | {res['restarts']} | every kill ({ok(res['restarts'] >= len([k for k in res.get('kills', []) if k.get('pid')]))}) |
| processes lost mid-run that no kill explains | {len(res.get('unplanned', res['vanished']))} | 0 |
| held-out accuracy (`eval/accuracy`, avg@16) | {held_out} | |
| largest RSS growth after warm-up | {pct(mg)} | <= 5% ({ok(mg is not None and mg <= RSS_TARGET)}) |

RSS growth = median RSS over the last {res['window_min']:.0f} min of a process's life vs the median over
the {res['window_min']:.0f} min that start {res['warmup_min']:.0f} min after it started (minutes
{res['warmup_min']:.0f}-{res['warmup_min'] + res['window_min']:.0f} for the processes there from the start; a restarted
generator has its own warm-up), per process; n/a where it did not live long enough for both windows:

| process | pid | baseline MiB | final MiB | growth |
|---|---|---|---|---|
{rows}

{notes}

![soak]({PNG.name})
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--warmup-min", type=float, default=None, help="default: 20%% of --minutes")
    p.add_argument("--window-min", type=float, default=None, help="default: 15%% of --minutes")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--stall-s", type=float, default=60.0)
    p.add_argument("--deadlock-s", type=float, default=600.0)
    p.add_argument("--startup-s", type=float, default=300.0, help="no deadlock check before this")
    p.add_argument("--kill-every-min", type=float, default=0.0, help="SIGKILL a generator every N minutes")
    p.add_argument("--label", default="")
    p.add_argument("--note", action="append", default=[], help="a line for the report (kept in the JSON)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--name", default="soak", help="results file names: benchmarks/results/NAME.{json,md,png}")
    p.add_argument("overrides", nargs="*", help="extra learner overrides")
    args = p.parse_args()
    args.warmup_min = 0.2 * args.minutes if args.warmup_min is None else args.warmup_min
    args.window_min = 0.15 * args.minutes if args.window_min is None else args.window_min
    RESULTS.mkdir(parents=True, exist_ok=True)
    JSON = outputs(args.name)[0]
    if args.report_only:
        res = json.loads(JSON.read_text())
        res["rss"] = rss_growth(res["samples"], 60 * res["warmup_min"], 60 * res["window_min"])
        res["max_growth"] = max((g["growth"] for g in res["rss"] if g["growth"] is not None), default=None)
        res["notes"] = res.get("notes", []) + args.note
        write_report(res, args.name)
        JSON.write_text(json.dumps(res, indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run_dir = Path(tmp) / "run"
        start = time.time()
        raw = soak(args, run_dir)
        res = analyse(raw, run_dir, args)
        res["start_time"] = start
        res["kill_every_min"] = args.kill_every_min
        res["stop_signal"] = "SIGTERM"
        res["load_avg_end"] = round(os.getloadavg()[0], 2)
        res["learner"] = "the real learner (python -m vapo_async.learner) with 2 local vLLM generators"
        res["label"] = args.label or (f"Short soak: {args.minutes:.0f} minutes instead of the default 60."
                                      if args.minutes < 60 else "Full-length soak.")
        res["meta"] = run_meta(f"{args.minutes} min", "soak", ["default + generators.local=2"])
        res["notes"] = args.note
        log_tail = (run_dir.parent / "learner.log").read_text(errors="replace").splitlines()[-40:]
        res["log_tail"] = log_tail
    write_report(res, args.name)
    JSON.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("steps", "stalls", "deadlocks", "crashes", "max_growth", "exit_code")}))


if __name__ == "__main__":
    main()
