"""What the experiment harness keeps of a run: ``RunRecord`` (plain JSON, committed instead of the
raw run directories), its TensorBoard scalars, and the provenance of an invocation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, also where another is installed
Curve = list[tuple[float, float]]
"""(step, value) points in increasing step order."""

CURVE_TAGS = (
    "eval/accuracy", "rollout/accuracy", "rollout/reward_mean", "rollout/response_length_mean",
    "perf/learner_tokens_per_s", "perf/step_s", "batch/tokens", "async/staleness_mean",
    "async/dropped_stale", "async/staleness_max", "train/value_warmup", "train/version",
    "critic/explained_variance", "actor/entropy", "actor/behav_weight_mean", "perf/learner_idle_fraction",
    "perf/wait_s", "rollout/response_tokens", "actor/behav_weight_max", "actor/behav_capped_frac",
    "actor/clip_fraction", "actor/approx_kl", "critic/value_loss", "critic/trained_fraction",
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


def save_records(path: Path, records: Sequence[RunRecord], meta: dict[str, Any]) -> None:
    """Write ``{"meta": meta, "runs": [record, ...]}`` as JSON (atomically)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "runs": [dataclasses.asdict(r) for r in records]}, indent=1))
    tmp.replace(path)


def load_records(path: Path) -> tuple[dict[str, Any], list[RunRecord]]:
    """(meta, records) from a file written by ``save_records``."""
    data = json.loads(path.read_text())
    return data["meta"], [RunRecord(**r) for r in data["runs"]]


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
