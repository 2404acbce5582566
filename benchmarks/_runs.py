"""Running the learner for the experiment harness (``ablation.py``, ``staleness.py``).

- Launch: one ``python -m vapo_async.learner`` run as a subprocess with Hydra overrides, its own
  run directory and a wall-clock timeout; a crash or a timeout is recorded, never raised.
- Sequence: the runs of a benchmark one after another, each record saved as it finishes, runs that
  would pass a deadline skipped.
- Harness: the command line and main loop every harness script shares (``--budget``, ``--seeds``,
  ``--steps``, ``--max-minutes``, ``--resume``, ``--dry-run``, ``--report-only``, ``--out``).

Records and scalars: ``_records.py``; aggregation and plots: ``_curves.py``; post-hoc evaluation:
``_posthoc.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from _curves import final_value
from _records import (
    CURVE_TAGS,
    REPO,
    RESULTS,
    RunRecord,
    git_commit,
    load_records,
    read_scalars,
    save_records,
)


class Evaluator(Protocol):
    """Scores a finished ``ok`` run after it ended (``_posthoc.PosthocEval``)."""

    def __call__(self, record: RunRecord, run_dir: Path) -> None: ...

    def close(self) -> None: ...


def learner_command(overrides: Sequence[str], seed: int, run_dir: Path) -> list[str]:
    """The learner's command line for one run."""
    return [sys.executable, "-m", "vapo_async.learner", *overrides, f"seed={seed}",
            f"hydra.run.dir={run_dir}"]


_BUILD_BASES = """
import json, sys
from vapo_async.data.tiny_base import ensure_tiny_base
from vapo_async.learner.__main__ import compose_config
models = [compose_config(o).model for o in json.loads(sys.argv[1])]
for cfg in {m.tiny_base_config() for m in models if m.path is None}:
    print(ensure_tiny_base(cfg), flush=True)
"""


def ensure_bases(overrides: Iterable[Sequence[str]]) -> float:
    """Build (or find in the cache) every tiny base that learner runs with these ``overrides``
    start from, before any timed run: a base built inside a run counts against its timeout (the long task's first base
    took ~27 min on 2 cores, past ``--budget long``'s 25-min limit). Returns the seconds it took."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", _BUILD_BASES, json.dumps(sorted({tuple(o) for o in overrides}))],
                   env=env, check=True)
    return time.monotonic() - t0


def _descendants(pid: int, known: dict[int, Any]) -> None:
    """Add the live descendants of ``pid`` to ``known`` (psutil handles, which refuse to signal a
    recycled pid)."""
    import psutil

    try:
        for child in psutil.Process(pid).children(recursive=True):
            known.setdefault(child.pid, child)
    except psutil.NoSuchProcess:
        pass


def _reap(known: dict[int, Any], settle_s: float = 20.0, grace_s: float = 15.0) -> list[str]:
    """Processes in ``known`` (the learner's descendants) still running ``settle_s`` after the
    learner ended: generators the learner started and did not stop (e.g. because it was killed),
    not ones merely finishing their own shutdown. SIGTERM them, SIGKILL after ``grace_s``; returns
    their descriptions (name, pid, command line)."""
    import psutil

    from vapo_async.common.procs import running, stop_processes

    _, alive = psutil.wait_procs(running(known.values()), timeout=settle_s)
    left, targets = [], running(alive)
    for p in targets:
        try:
            left.append(f"{p.name()} {p.pid} ({' '.join(p.cmdline())[:160]})")
        except psutil.NoSuchProcess:
            pass
    # SIGKILL after grace_s: SIGTERM may be blocked or ignored (a signal mask is inherited across exec)
    stop_processes(targets, signal.SIGTERM, grace_s, kill_wait_s=grace_s)
    return left


def _wait(proc: subprocess.Popen[bytes], timeout_s: float, known: dict[int, Any], grace_s: float) -> int | None:
    """Wait for the learner, snapshotting its descendants every few seconds; on timeout SIGINT it
    (Lightning stops, the learner's teardown stops its generators), then SIGKILL after ``grace_s``.
    Returns the exit code, or None on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        _descendants(proc.pid, known)
        try:
            return proc.wait(timeout=min(5.0, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() < deadline:
                continue
        from vapo_async.common.procs import stop_processes

        stop_processes([proc], signal.SIGINT, grace_s)  # not its group: the learner shares ours
        return None


def run_learner(record: RunRecord, run_dir: Path, timeout_s: float, grace_s: float = 90.0,
                require_eval: bool = True) -> RunRecord:
    """Run the learner for ``record`` in ``run_dir`` (stdout/stderr to ``run_dir/learner.log``) and
    fill in status, exit code, wall time, curves and, unless ok, the log tail. The controller gets
    a free port (not recorded: it does not change the run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "learner.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    record.commit = git_commit()
    record.load_avg = [round(os.getloadavg()[0], 2)]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        port = f"controller.transport.endpoint=tcp://127.0.0.1:{free_port_pair()}"
        cmd = learner_command([*record.overrides, port], record.seed, run_dir)
        proc = subprocess.Popen(cmd, cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        known: dict[int, Any] = {}
        record.returncode = _wait(proc, timeout_s, known, grace_s)
        record.status = "timeout" if record.returncode is None else "ok" if record.returncode == 0 else "crash"
    record.wall_s = time.monotonic() - t0
    record.load_avg.append(round(os.getloadavg()[0], 2))
    for leftover in _reap(known):
        print(f"    stopped a process the learner left running: {leftover}", flush=True)
    tb = run_dir / "tb"
    record.curves = read_scalars(tb, CURVE_TAGS) if tb.is_dir() else {}
    if record.status == "ok" and require_eval and not record.curves.get("eval/accuracy"):
        record.status = "crash"  # exited 0 but produced no held-out accuracy
    if record.status != "ok":
        lines = log_path.read_text(errors="replace").splitlines()
        record.log_tail = "\n".join(lines[-25:])
    return record


def run_sequence(todo: Sequence[RunRecord], done: list[RunRecord], raw_root: Path, json_path: Path,
                 meta: dict[str, Any], timeout_s: float, deadline: float | None = None,
                 evaluator: Evaluator | None = None) -> list[RunRecord]:
    """Run ``todo`` one after another (raw output in ``raw_root/VARIANT_sSEED``), appending each
    finished record to ``done`` and rewriting ``json_path`` after every run; with an ``evaluator``
    each ``ok`` run's published versions are then scored by it. With a ``deadline``
    (``time.monotonic()`` value) a run whose expected duration (mean wall time of the runs so far)
    would pass it is skipped; the skipped runs are returned (and listed in ``meta["skipped"]``)."""
    skipped: list[RunRecord] = []
    walls: list[float] = []
    for i, rec in enumerate(todo):
        expected = sum(walls) / len(walls) if walls else 0.0
        if deadline is not None and time.monotonic() + expected > deadline:
            skipped.append(rec)
            continue
        print(f"[{i + 1}/{len(todo)}] {rec.variant} seed {rec.seed}: {' '.join(rec.overrides)}", flush=True)
        run_dir = raw_root / f"{rec.variant}_s{rec.seed}"
        if run_dir.exists():  # left by an interrupted attempt: a learner refuses to republish v1
            shutil.rmtree(run_dir)
        run_learner(rec, run_dir, timeout_s, require_eval=evaluator is None)
        if evaluator is not None and rec.status == "ok":
            try:
                evaluator(rec, run_dir)
            except Exception as e:  # recorded on the run (a crash in the table), the sequence goes on
                rec.status, rec.log_tail = "crash", f"post-hoc evaluation failed: {type(e).__name__}: {e}"
        walls.append(rec.wall_s)
        acc = final_value(rec.curve("eval/accuracy"))
        print(f"    -> {rec.status} in {rec.wall_s:.0f} s, final eval/accuracy "
              f"{'-' if acc is None else f'{acc:.3f}'}", flush=True)
        if rec.status != "ok":
            print("    " + rec.log_tail.replace("\n", "\n    ")[-2000:], flush=True)
        done.append(rec)
        meta["skipped"] = [f"{r.variant}_s{r.seed}" for r in skipped]
        save_records(json_path, done, meta)
    meta["skipped"] = [f"{r.variant}_s{r.seed}" for r in skipped]
    save_records(json_path, done, meta)
    return skipped


def free_port_pair() -> int:
    """A free TCP port p on 127.0.0.1 with p + 1 free too (controller ROUTER and PUB), so benchmark
    runs never collide with another learner on the default 5555."""
    import socket

    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no free pair of consecutive TCP ports found on 127.0.0.1")


# ---- the harness scripts' command line and main loop --------------------------------------------

def harness_parser(description: str, name: str, budgets: Iterable[str]) -> argparse.ArgumentParser:
    """The options every harness script has; ``name`` (``ablation``) names its ``NAME_runs.json``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--budget", choices=sorted(budgets), default="quick")
    ap.add_argument("--seeds", type=int, nargs="+", help="override the budget's seeds")
    ap.add_argument("--steps", type=int, help="override the budget's training steps")
    ap.add_argument("--max-minutes", type=float, help="skip runs that would end after this many minutes")
    ap.add_argument("--resume", action="store_true", help=f"keep finished runs of {name}_runs.json")
    ap.add_argument("--dry-run", action="store_true", help="check the rows and print the commands only")
    ap.add_argument("--report-only", action="store_true", help=f"rebuild md/png from {name}_runs.json")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


@dataclass
class Plan:
    """What a harness invocation runs."""

    todo: list[RunRecord]
    """The runs, in order (seed-major)."""
    meta: dict[str, Any]
    """Provenance (``_records.run_meta``), saved beside the records."""
    timeout_s: float
    """Per-run wall-clock limit."""
    evaluator: Evaluator | None = None
    """Post-hoc scoring of each ``ok`` run (closed at the end); None: the learner's own evaluation."""


def resumable(saved: list[RunRecord], todo: list[RunRecord]) -> tuple[list[RunRecord], list[RunRecord]]:
    """``(kept, still_to_run)`` for ``--resume``: a saved ``ok`` run is kept, and not rerun, when the
    plan has no run of its (row, seed) or asks for it with the same overrides; one whose overrides
    differ from the plan's (another budget or harness version) is rerun and replaced, with a notice."""
    planned = {(r.variant, r.seed): r.overrides for r in todo}
    kept = []
    for rec in saved:
        want = planned.get((rec.variant, rec.seed))
        if rec.status != "ok":
            continue
        if want is not None and want != rec.overrides:
            print(f"--resume: rerunning {rec.variant} seed {rec.seed}: saved overrides differ from the plan's")
            continue
        kept.append(rec)
    finished = {(r.variant, r.seed) for r in kept}
    return kept, [r for r in todo if (r.variant, r.seed) not in finished]


def run_harness(args: argparse.Namespace, name: str, plan: Callable[[], Plan],
                report: Callable[[dict[str, Any], list[RunRecord], Path], None]) -> None:
    """The main loop of harness script ``name`` after ``harness_parser``: ``--report-only``
    rebuilds the report from ``OUT/NAME_runs.json``; otherwise ``plan()`` (which checks the rows)
    gives the runs, ``--dry-run`` prints their commands, ``--resume`` keeps the runs already ``ok``
    in the JSON, and the rest run one after another (raw output in ``OUT/tmp/NAME``; with
    ``--max-minutes`` a run that would end later is skipped), then the report is written."""
    json_path = args.out / f"{name}_runs.json"
    if args.report_only:
        meta, records = load_records(json_path)
        report(meta, records, args.out)
        return
    p = plan()
    todo = p.todo
    if args.dry_run:
        for rec in todo:
            print("python " + " ".join(learner_command(rec.overrides, rec.seed, Path("DIR"))[1:]))
        return
    done: list[RunRecord] = []
    if args.resume and json_path.exists():
        done, todo = resumable(load_records(json_path)[1], todo)
    t0 = time.monotonic()
    if todo:
        p.meta["base_build_s"] = round(ensure_bases(r.overrides for r in todo), 1)
    deadline = t0 + 60 * args.max_minutes if args.max_minutes else None
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run_sequence(todo, done, args.out / "tmp" / name, json_path, p.meta, p.timeout_s, deadline, p.evaluator)
    finally:
        if p.evaluator is not None:
            p.evaluator.close()
    p.meta["total_wall_s"] = time.monotonic() - t0
    save_records(json_path, done, p.meta)
    report(p.meta, done, args.out)
    print(f"wrote {args.out / f'{name}.md'}")
