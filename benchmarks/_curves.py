"""Aggregation of run records (pure functions, unit-tested in tests/benchmarks/test_harness.py):
final value, normalised area under a curve, steps to a threshold, mean/std over seeds, mean-and-band
curves, throughput, markdown tables; and the learning-curve plot (mean line, +-1 std band)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _records import Curve, RunRecord


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


def difference(m1: float | None, s1: float | None, n1: int, m0: float | None, s0: float | None,
               n0: int) -> str:
    """``mean1 - mean0`` of two groups of runs (fractions) in points, with twice its standard error
    (Welch: sqrt(s1^2/n1 + s0^2/n0)) and whether it is resolved (|diff| > 2 s.e.) or within noise."""
    if m1 is None or m0 is None or n1 < 1 or n0 < 1:
        return "n/a"
    if n1 < 2 or n0 < 2:
        return f"{100 * (m1 - m0):+.1f} points (one seed: noise not estimated)"
    se = ((s1 or 0) ** 2 / n1 + (s0 or 0) ** 2 / n0) ** 0.5
    verdict = "resolved" if abs(m1 - m0) > 2 * se else "within seed noise"
    return f"{100 * (m1 - m0):+.1f} points (2 s.e. {200 * se:.1f}: {verdict})"


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
